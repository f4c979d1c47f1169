"""``comm-ckpt``: look into a checkpoint, or convert it, offline on the CPU.

Usage::

    comm-ckpt inspect PATH [--json] [--allow-unsafe-pickle]
    comm-ckpt convert SRC DST [--to plain|full|sharded|deepspeed] [--allow-unsafe-pickle]
                              [--quiet] [--progress]

``inspect`` prints what a checkpoint holds: from the manifest of a comm checkpoint
folder, or from the tensors of a plain file, or from the files of a DeepSpeed folder.
``convert`` reads any checkpoint (a comm folder, DeepSpeed's own folder of ZeRO 0-3 or
its universal layout, a plain file) and writes one plain ``torch.load``-able file
(``plain``, the weights), a comm folder with the optimizer state (``full`` or
``sharded``), or DeepSpeed's universal layout (``deepspeed``), which a DeepSpeed engine
of any ZeRO stage and world size loads. Also ``python -m comm_strategies.cli``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .checkpoint import CheckpointError, convert_checkpoint, read_manifest
from .checkpoint._convert import TARGETS
from .checkpoint._manifest import MANIFEST_NAME

__all__ = ["main"]


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:,.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:,.1f} TiB"  # pragma: no cover - unreachable


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


def _describe_folder(path: Path) -> dict[str, Any]:
    manifest = read_manifest(path)
    data = manifest.to_json()
    data["kind"] = "comm checkpoint"
    data["num_params"] = sum(_numel(shape) for shape, _ in manifest.params.values())
    data["total_size"] = sum(manifest.files.values())
    return data


def _describe_file(path: Path, unsafe: bool) -> dict[str, Any]:
    from .checkpoint._convert_source import full_model_state_of

    state = full_model_state_of(path, allow_unsafe_pickle=unsafe)
    params: dict[str, list[Any]] = {
        name: [list(value.shape), str(value.dtype).removeprefix("torch.")]
        for name, value in state.items()
    }
    return {
        "kind": "plain state dict file" if path.is_file() else "DeepSpeed checkpoint folder",
        "params": params,
        "num_params": sum(_numel(shape) for shape, _ in params.values()),
        "total_size": path.stat().st_size if path.is_file() else _folder_size(path),
    }


def _folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _print_description(path: Path, data: dict[str, Any], out: Any) -> None:
    write = out.write
    write(f"{path}: {data['kind']}\n")
    if data["kind"] == "comm checkpoint":
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(data["saved_at"]))
        layout = data["format"]
        if data["zero_stage"] is not None:
            layout += f", ZeRO stage {data['zero_stage']}"
        if data["sharding"]:
            layout += f", {data['sharding']}"
        write(
            f"  strategy     {data['strategy']} ({data['wrapper']}), world size {data['world_size']}\n"
        )
        write(f"  format       {layout} (layout version {data['format_version']})\n")
        write(f"  saved at     {saved}\n")
        optimizer = "yes" if data["has_optimizer"] else "no"
        if data["optimizer_keys"]:
            optimizer += f" ({', '.join(data['optimizer_keys'])})"
        write(f"  optimizer    {optimizer}\n")
        write(f"  schedulers   {data['num_schedulers']}\n")
        write(f"  grad scaler  {'yes' if data['has_scaler'] else 'no'}\n")
        write(f"  RNG states   ranks {data['rng_ranks']}\n")
        write(f"  user state   {', '.join(data['extra_keys']) or '-'}\n")
        versions = ", ".join(f"{k} {v}" for k, v in sorted(data["versions"].items()))
        write(f"  versions     {versions}\n")
    dtypes = sorted({dtype for _, dtype in data["params"].values()})
    write(
        f"  tensors      {len(data['params'])} ({data['num_params']:,} elements; "
        f"{', '.join(dtypes)})\n"
    )
    write(f"  size         {_human(data['total_size'])}\n")
    width = max((len(name) for name in data["params"]), default=0)
    for name, (shape, dtype) in data["params"].items():
        write(f"    {name:<{width}}  {tuple(shape)}  {dtype}\n")


def _inspect(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if path.is_dir() and (path / MANIFEST_NAME).is_file():
        data = _describe_folder(path)
    elif path.exists():
        data = _describe_file(path, args.allow_unsafe_pickle)
    else:
        raise CheckpointError(f"checkpoint {path} does not exist")
    if args.json:
        json.dump(data, sys.stdout, indent=1, sort_keys=True)
        sys.stdout.write("\n")
    else:
        _print_description(path, data, sys.stdout)
    return 0


def _convert(args: argparse.Namespace) -> int:
    destination = convert_checkpoint(
        args.source,
        args.destination,
        to=args.to,
        allow_unsafe_pickle=args.allow_unsafe_pickle,
        progress=not args.quiet and (args.progress or sys.stderr.isatty()),
    )
    if not args.quiet:
        print(f"wrote {destination}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``comm-ckpt`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="comm-ckpt",
        description="Look into a checkpoint or convert it, offline on the CPU.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="what a checkpoint holds")
    inspect.add_argument("path", help="a checkpoint folder, a .pth file or a DeepSpeed folder")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    convert = commands.add_parser(
        "convert",
        help="any checkpoint -> a plain file, a full or sharded folder, or DeepSpeed's",
        description=(
            "Convert a checkpoint offline on the CPU. --to plain: one torch.load-able file "
            "(weights); full: a checkpoint folder of model.pt/optim.pt; sharded: a torch "
            "distributed checkpoint folder (both with the optimizer state, loaded by "
            "load_checkpoint under any strategy and world size); deepspeed: DeepSpeed's "
            'universal checkpoint (load it with {"checkpoint": {"load_universal": true}}).'
        ),
    )
    convert.add_argument("source", help="a checkpoint folder, a .pth file or a DeepSpeed folder")
    convert.add_argument(
        "destination", help="a .pt/.pth/.bin/.ckpt file (plain) or a folder (the others)"
    )
    convert.add_argument(
        "--to",
        choices=TARGETS,
        help="default: plain for a .pt/.pth/.bin/.ckpt destination, else sharded",
    )
    convert.add_argument("--quiet", action="store_true", help="no progress bar, no summary")
    convert.add_argument(
        "--progress", action="store_true", help="a progress bar even when stderr is no terminal"
    )
    for command in (inspect, convert):
        command.add_argument(
            "--allow-unsafe-pickle",
            action="store_true",
            help="read files that need full unpickling (old pickles, foreign objects); "
            "only files you trust",
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``comm-ckpt``; return the exit status (2 for a checkpoint error)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect":
            return _inspect(args)
        return _convert(args)
    except CheckpointError as error:
        message = str(error).replace("allow_unsafe_pickle=True", "--allow-unsafe-pickle")
        print(f"comm-ckpt: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
