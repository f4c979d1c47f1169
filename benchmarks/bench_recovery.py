"""Benchmark recovery after a killed rank: comm's job against plain torch + DCP, under torchrun.

The job (``recovery_job.py``): the demo's `DigitsNet` on the handwritten digits under
comm's DDP strategy at world 2, `ElasticSampler` (global batch 64), an async checkpoint
every ``--save-every`` steps (``keep_last=2``), ``resume(missing_ok=True)`` at start,
started by ``scripts/launch/torchrun.sh restart static|c10d`` (torchrun, 2 ranks,
``--max-restarts 1``, ``--monitor-interval 0.1``). Rank 1 SIGKILLs itself right after step
``--kill-step`` of the first attempt; torchrun stops the survivor and starts both again.

- Recovery time, kill to the first step after the restart, in parts (each boundary is
  the slower rank's): noticing (the kill to the agent's first log line about it: it sends
  the survivor SIGTERM), the survivor stopped (the agent's "Worker group FAILED"), the new
  worker processes started (their exec time, from /proc: the agent's rendezvous and
  spawn), imports, the rendezvous (``setup_env``: ``init_dist``), prepare (model, DDP,
  optimizer, data), load (``resume``), the first step. Medians over the runs that came
  back; the goal is at most 10 s in all. Also: when the survivor's collective raised.
- Steps lost: the kill's step minus the step the restart resumed from (the steps done
  after the last complete checkpoint).
- The same job with plain torch (``recovery_plain.py``: ``init_process_group("gloo")``
  from env://, ``DistributedDataParallel``, ``torch.distributed.checkpoint.async_save`` of
  ``get_state_dict`` over a gloo group of its own, the newest folder with DCP's
  ``.metadata`` loaded at start), the same kill under the same launcher: how many of N
  runs come back, beside comm's count (a run that has not ended after
  ``--launch-timeout`` s counts as hung).
- Checkpoint cost, in one world of its own (no kill): blocks of ``--block-steps`` steps
  with no checkpoint or an async save every k steps (k in ``--intervals``), alternated
  and rotated, the block's time the slower rank's; overhead = median over the repeats of
  (block with saves / block without, same repeat) - 1; the goal is at most 3%. Each save's
  time in the ``save_checkpoint_async`` call (of which the CPU copy), and waiting for the
  previous save, show where the cost goes; the same blocks with plain DCP ``async_save``
  beside it.

``--stress N`` instead runs the comm job once with ``--max-restarts N`` and a kill in each
of its first N attempts (rank ``c % 2`` of attempt ``c``, 6 to 9 steps after the step the
attempt resumed from, a checkpoint every 5 steps): all N must come back, and the final
model must equal a run that never stopped (within 1e-5).

    python benchmarks/bench_recovery.py [--smoke] [--runs N] [--plain N] [--out DIR]
    python benchmarks/bench_recovery.py --stress 20

Writes DIR/results.md and DIR/results.json (``--stress``: DIR defaults to
benchmarks/results/recovery-stress). ``--smoke`` (CI): one kill and restart (static
rendezvous), no plain-torch run, two cost samples of k = 10.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from _common import ROOT, rank_env, write_results

LAUNCH = ROOT / "scripts" / "launch" / "torchrun.sh"
HERE = Path(__file__).resolve().parent
JOBS = {"comm": HERE / "recovery_job.py", "plain": HERE / "recovery_plain.py"}
GOAL_S = 10.0
GOAL_COST = 0.03
TOLERANCE = 1e-5
# The parts of the recovery time: (key, label, the phase that ends it).
PARTS = [
    ("noticing", "noticing", "noticed"),
    ("stopping", "survivor stopped", "stopped"),
    ("spawn", "new workers started", "process_start"),
    ("imports", "imports", "imported"),
    ("rendezvous", "rendezvous (init_dist)", "ready"),
    ("prepare", "prepare (model, data)", "prepared"),
    ("load", "load (resume)", "resumed"),
    ("first_step", "first step", "first_step"),
]
_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Timeout)\w*: ")
_LOG_LINE = re.compile(r"^([IWEF])(\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) \d+ \S+\] (.*)$")


# ---------------------------------------------------------------- one launch
def launch(
    job: str,
    rdzv: str,
    folder: Path,
    args: list[str],
    *,
    max_restarts: int,
    timeout: float,
) -> dict[str, Any]:
    """Run a job under ``torchrun.sh restart RDZV``; return its outcome and its records."""
    out, work = folder / "out", folder / "work"
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(rank_env())
    env.setdefault("PYTHON_RANK", sys.executable)
    env.update(
        LOGLEVEL="INFO",  # the agent's log lines (with timestamps) of the restart
        COMM_MAX_RESTARTS=str(max_restarts),
        COMM_LAUNCH_TIMEOUT=str(int(timeout)),
        PYTHONPATH=os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    command = ["bash", str(LAUNCH), "restart", rdzv, str(JOBS[job])]
    command += ["--work-dir", str(work), "--out", str(out), *args]
    started = time.time()
    try:
        proc = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout + 30
        )
        code, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as expired:  # torchrun.sh's own timeout did not act
        code = 124
        log = "".join(
            part.decode() if isinstance(part, bytes) else (part or "")
            for part in (expired.stdout, expired.stderr)
        )
    return {
        "returncode": code,
        "seconds": time.time() - started,
        "log": log,
        "attempts": _attempts(out),
        "kills": sorted(
            (json.loads(p.read_text()) for p in out.glob("killed-*.json")),
            key=lambda k: k["restart_count"],
        ),
        "final": out / "final.pt" if (out / "final.pt").exists() else None,
        "cost": json.loads((out / "cost.json").read_text())
        if (out / "cost.json").exists()
        else None,
    }


def _attempts(out: Path) -> dict[int, list[dict[str, Any]]]:
    """Each attempt's records (one per rank), by restart count."""
    attempts: dict[int, list[dict[str, Any]]] = {}
    for path in out.glob("attempt-*.json"):
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError:  # killed while writing it
            continue
        attempts.setdefault(int(record["restart_count"]), []).append(record)
    return {count: sorted(records, key=lambda r: r["rank"]) for count, records in attempts.items()}


def agent_events(log: str) -> list[tuple[float, str]]:
    """The torchrun agent's lines about failures and starts: (time.time() value, kind)."""
    year = datetime.now().year
    events = []
    for line in log.splitlines():
        match = _LOG_LINE.match(line)
        if not match:
            continue
        month, day, hour, minute, second, micro = (int(g) for g in match.groups()[1:7])
        text = match.group(8)
        stamp = datetime(year, month, day, hour, minute, second, micro).timestamp()
        if "closing signal" in text or "failed (exitcode" in text:
            events.append((stamp, "noticed"))
        if "Worker group FAILED" in text:
            events.append((stamp, "stopped"))
        if "Starting worker group" in text:
            events.append((stamp, "starting"))
    return events


def recovery(kill: dict[str, Any], after: list[dict[str, Any]], events: list[tuple[float, str]],
             before: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """The parts of one recovery: from the kill to the first step of the next attempt."""
    killed = float(kill["time"])
    bounds: dict[str, float] = {"kill": killed}
    noticed = [t for t, kind in events if kind == "noticed" and t >= killed - 0.002]
    if noticed:
        bounds["noticed"] = max(noticed[0], killed)
        stopped = [t for t, kind in events if kind == "stopped" and t >= bounds["noticed"]]
        if stopped:
            bounds["stopped"] = stopped[0]
    previous = killed
    parts: dict[str, float] = {}
    for key, _, phase in PARTS:
        if phase in ("noticed", "stopped"):
            value = bounds.get(phase)
        else:
            values = [r.get(phase) for r in after]
            value = max(values) if values and None not in values else None  # type: ignore[type-var]
        if value is None:
            continue
        parts[key] = max(float(value) - previous, 0.0)
        previous = float(value)
    raised = [r["raised"] - killed for r in before if "raised" in r]
    done = all("first_step" in r for r in after) and len(after) > 0
    return {
        "parts": parts,
        "total": previous - killed if done else None,
        "survivor_raised": min(raised) if raised else None,
        "kill_step": kill["step"],
        "resumed_from": after[0].get("resumed_from") if after else None,
        "steps_lost": kill["step"] - after[0]["resumed_from"]
        if after and "resumed_from" in after[0]
        else None,
    }


def outcome(run: dict[str, Any], expected_kills: int) -> str:
    """``back`` (every kill restarted and the job finished), ``hung`` or ``failed``."""
    attempts = run["attempts"]
    finished = run["returncode"] == 0 and run["final"] is not None
    if finished and len(run["kills"]) == expected_kills and len(attempts) == expected_kills + 1:
        return "back"
    return "hung" if run["returncode"] in (124, 137) else "failed"


def where_it_stopped(run: dict[str, Any]) -> str:
    """The last phase the last attempt's ranks finished, and the error the log ends with."""
    attempts = run["attempts"]
    if not attempts:
        return "no attempt started"
    last = attempts[max(attempts)]
    order = ["imported", "before_rendezvous", "ready", "prepared", "resumed", "first_step"]
    phases = [max((p for p in order if p in r), key=order.index) for r in last]
    errors = []
    for line in run["log"].splitlines():
        text = re.sub(r"^\[(default)?rank\d+\]:\s*", "", line.strip())
        if _ERROR_LINE.match(text) and "ChildFailedError" not in text:
            errors.append(text[:200])
    return f"attempt {max(attempts)}: ranks reached {phases}; {errors[-1] if errors else ''}"


def analyse(run: dict[str, Any]) -> list[dict[str, Any]]:
    """One `recovery` per kill whose next attempt started."""
    events = agent_events(run["log"])
    found = []
    for kill in run["kills"]:
        count = int(kill["restart_count"])
        after = run["attempts"].get(count + 1, [])
        if after:
            found.append(recovery(kill, after, events, run["attempts"].get(count, [])))
    return found


# ---------------------------------------------------------------- the measurements
def job_args(settings: dict[str, Any]) -> list[str]:
    return [
        "--steps", str(settings["steps"]), "--save-every", str(settings["save_every"]),
        "--kill-step", str(settings["kill_step"]), "--kill-rank", "1",
    ]  # fmt: skip


def restarts(settings: dict[str, Any], scratch: Path) -> dict[str, Any]:
    """Comm's and plain torch's runs with one kill each: outcomes and recoveries."""
    rows: dict[str, Any] = {}
    for rdzv in settings["rdzv"]:
        count = {"comm": settings["runs"], "plain": settings["plain"]}
        order = [job for job in ("comm", "plain") if count[job]]
        runs: dict[str, list[dict[str, Any]]] = {job: [] for job in order}
        for index in range(max(count.values())):
            for job in order if index % 2 == 0 else order[::-1]:
                if index >= count[job]:
                    continue
                folder = scratch / f"{job}-{rdzv}-{index}"
                run = launch(job, rdzv, folder, job_args(settings), max_restarts=1,
                             timeout=settings["launch_timeout"])  # fmt: skip
                state = outcome(run, expected_kills=1)
                entry = {
                    "outcome": state,
                    "seconds": round(run["seconds"], 1),
                    "recoveries": analyse(run),
                }
                if state != "back":
                    entry["stopped"] = where_it_stopped(run)
                runs[job].append(entry)
                print(f"{job} {rdzv} run {index}: {state} ({run['seconds']:.1f} s)", flush=True)
                shutil.rmtree(folder, ignore_errors=True)
        rows[rdzv] = runs
    return rows


def cost(settings: dict[str, Any], scratch: Path) -> dict[str, Any]:
    """The checkpoint-cost blocks of each job (rounds alternate comm and plain)."""
    args = [
        "--cost", ",".join(str(k) for k in settings["intervals"]),
        "--block-steps", str(settings["block_steps"]),
        "--repeats", str(settings["cost_repeats"]), "--warmup", "1",
    ]  # fmt: skip
    pooled: dict[str, dict[str, list[dict[str, float]]]] = {}
    jobs = ["comm", "plain"] if settings["cost_plain"] else ["comm"]
    for round_ in range(settings["cost_rounds"]):
        for job in jobs if round_ % 2 == 0 else jobs[::-1]:
            folder = scratch / f"cost-{job}-{round_}"
            run = launch(job, "static", folder, args, max_restarts=0,
                         timeout=settings["launch_timeout"] * 4)  # fmt: skip
            if run["cost"] is None:
                message = f"the {job} cost run failed ({run['returncode']}):\n{run['log'][-4000:]}"
                raise RuntimeError(message)
            for every, samples in run["cost"]["samples"].items():
                pooled.setdefault(job, {}).setdefault(every, []).extend(samples)
            shutil.rmtree(folder, ignore_errors=True)
    return {
        job: summarise_cost(samples, settings["block_steps"]) for job, samples in pooled.items()
    }


def summarise_cost(samples: dict[str, list[dict[str, float]]], block: int) -> dict[str, Any]:
    none = samples["0"]
    rows: dict[str, Any] = {
        "0": {"step_ms": statistics.median(s["block_s"] for s in none) / block * 1e3}
    }
    for every, values in samples.items():
        if every == "0":
            continue
        saves = block // int(every)
        ratios = [v["block_s"] / n["block_s"] for v, n in zip(values, none)]
        overhead = statistics.median(ratios) - 1.0
        rows[every] = {
            "step_ms": statistics.median(v["block_s"] for v in values) / block * 1e3,
            "overhead": overhead,
            # what one save costs the loop in all, and the interval that would meet the goal
            "per_save_ms": overhead * rows["0"]["step_ms"] * int(every),
            "k_for_goal": overhead * int(every) / GOAL_COST,
            "call_ms": statistics.median(v["call_s"] for v in values) / saves * 1e3,
            "stage_ms": statistics.median(v["stage_s"] for v in values) / saves * 1e3,
            "wait_ms": statistics.median(v["wait_s"] for v in values) / saves * 1e3,
            "samples": len(values),
        }
    return rows


def stress(settings: dict[str, Any], scratch: Path) -> dict[str, Any]:
    """N kills in one job (``--max-restarts N``); the final model against a run that never stopped."""
    import torch

    kills, every = settings["stress"], settings["stress_save_every"]
    steps = every * (kills + 2)
    common = ["--steps", str(steps), "--save-every", str(every)]
    run = launch("comm", "static", scratch / "stress", [*common, "--kill-attempts", str(kills)],
                 max_restarts=kills, timeout=settings["stress_timeout"])  # fmt: skip
    reference = launch("comm", "static", scratch / "reference", common, max_restarts=0,
                       timeout=settings["launch_timeout"])  # fmt: skip
    state = outcome(run, expected_kills=kills)
    found = analyse(run)
    difference = None
    if run["final"] is not None and reference["final"] is not None:
        final = torch.load(run["final"])["params"]
        expected = torch.load(reference["final"])["params"]
        difference = max(float((final[k] - expected[k]).abs().max()) for k in expected)
    result = {
        "kills": kills,
        "steps": steps,
        "save_every": every,
        "outcome": state,
        "returncode": run["returncode"],
        "seconds": round(run["seconds"], 1),
        "came_back": len(found),
        "kill_steps": [k["step"] for k in run["kills"]],
        "recoveries": found,
        "max_difference": difference,
    }
    if state != "back":
        result["stopped"] = where_it_stopped(run)
        result["log_tail"] = run["log"][-3000:]
    return result


# ---------------------------------------------------------------- report
def median_parts(recoveries: list[dict[str, Any]]) -> dict[str, float]:
    complete = [r for r in recoveries if r["total"] is not None]
    parts = {key: statistics.median(r["parts"].get(key, 0.0) for r in complete)
             for key, _, _ in PARTS} if complete else {}  # fmt: skip
    if complete:
        parts["total"] = statistics.median(r["total"] for r in complete)
        parts["max_total"] = max(r["total"] for r in complete)
        raised = [r["survivor_raised"] for r in complete if r["survivor_raised"] is not None]
        parts["survivor_raised"] = statistics.median(raised) if raised else float("nan")
        parts["steps_lost"] = statistics.median(r["steps_lost"] for r in complete)
    return parts


def markdown(result: dict[str, Any]) -> str:
    settings = result["settings"]
    lines: list[str] = []
    if "load_average_before" in result:
        lines += [
            f"Run {result['date']}, torch {result['versions']['torch']}; the machine's load "
            f"average {result['load_average_before']:.1f} before, "
            f"{result['load_average_after']:.1f} after ({os.cpu_count()} cores).",
            "",
        ]
    if "restarts" in result:
        lines += [
            f"The demo's DigitsNet, DDP at world 2 (gloo, {os.cpu_count()} cores), "
            f"{settings['steps']} steps of 64 samples, an async checkpoint every "
            f"{settings['save_every']} steps; rank 1 SIGKILLs itself after step "
            f"{settings['kill_step']}; torchrun --max-restarts 1, --monitor-interval 0.1. "
            "Medians over the runs that came back; each part ends when the slower rank is "
            f"through it (goal: kill to first step at most {GOAL_S:.0f} s).",
            "",
            "| job | rendezvous | came back | "
            + " | ".join(label for _, label, _ in PARTS)
            + " | total (s) | worst (s) | survivor raised (s) | steps lost |",
            "|---|---|---:|" + "---:|" * (len(PARTS) + 4),
        ]
        for rdzv, jobs in result["restarts"].items():
            for job, runs in jobs.items():
                back = sum(r["outcome"] == "back" for r in runs)
                parts = median_parts([x for r in runs for x in r["recoveries"]
                                      if r["outcome"] == "back"])  # fmt: skip
                name = "comm" if job == "comm" else "plain torch + DCP"
                cells = [f"{name}", rdzv, f"{back} / {len(runs)}"]
                if parts:
                    cells += [f"{parts[key]:.2f}" for key, _, _ in PARTS]
                    cells += [f"**{parts['total']:.2f}**", f"{parts['max_total']:.2f}",
                              f"{parts['survivor_raised']:.2f}", f"{parts['steps_lost']:.0f}"]  # fmt: skip
                else:
                    cells += ["-"] * (len(PARTS) + 4)
                lines.append("| " + " | ".join(cells) + " |")
        failures = [
            f"- {('comm' if job == 'comm' else 'plain')} {rdzv}: {r['outcome']}: {r['stopped']}"
            for rdzv, jobs in result["restarts"].items()
            for job, runs in jobs.items()
            for r in runs
            if r["outcome"] != "back"
        ]
        if failures:
            lines += ["", "Runs that did not come back:", "", *failures]
    if "cost" in result:
        lines += [
            "",
            f"Checkpoint cost: blocks of {settings['block_steps']} steps without checkpoints "
            "or with an async save every k steps, alternated in one world (no kill); "
            f"median of {settings['cost_repeats'] * settings['cost_rounds']} repeats "
            f"(goal: overhead at most {GOAL_COST:.0%}). Per save: the time in the save call "
            "(of which the CPU copy) and waiting for the previous save.",
            "",
            "| job | k | step (ms) | step without saves (ms) | overhead | cost of one save "
            "(ms) | k for 3% | save call (ms) | of which CPU copy (ms) | wait for previous (ms) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for job, rows in result["cost"].items():
            base = rows["0"]["step_ms"]
            name = "comm" if job == "comm" else "plain torch + DCP"
            for every, row in rows.items():
                if every == "0":
                    continue
                stage = f"{row['stage_ms']:.2f}" if job == "comm" else "-"
                lines.append(
                    f"| {name} | {every} | {row['step_ms']:.2f} | {base:.2f} | "
                    f"{row['overhead']:+.1%} | {row['per_save_ms']:.1f} | "
                    f"{max(row['k_for_goal'], 1):.0f} | {row['call_ms']:.2f} | {stage} | "
                    f"{row['wait_ms']:.2f} |"
                )
    if "stress" in result:
        run = result["stress"]
        parts = median_parts(run["recoveries"])
        lines += [
            f"Stress: one comm job, --max-restarts {run['kills']}, a kill in each of its first "
            f"{run['kills']} attempts (steps {run['kill_steps']}), a checkpoint every "
            f"{run['save_every']} steps, {run['steps']} steps; {run['seconds']} s in all.",
            "",
            "| kills | came back | job finished | kill to first step: median (s) | worst (s) "
            "| steps lost: median | max | final model vs a run never stopped (max abs diff) |",
            "|---:|---:|---|---:|---:|---:|---:|---:|",
        ]
        lost = [r["steps_lost"] for r in run["recoveries"] if r["steps_lost"] is not None]
        diff = run["max_difference"]
        lines.append(
            f"| {run['kills']} | {run['came_back']} / {run['kills']} | {run['outcome']} | "
            f"{parts.get('total', float('nan')):.2f} | {parts.get('max_total', float('nan')):.2f} | "
            f"{statistics.median(lost) if lost else float('nan'):.0f} | "
            f"{max(lost) if lost else float('nan')} | "
            f"{'-' if diff is None else f'{diff:.1e}'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one kill, one cost sample (CI)")
    parser.add_argument("--runs", type=int, default=None, help="comm runs per rendezvous")
    parser.add_argument("--plain", type=int, default=None, help="plain-torch runs per rendezvous")
    parser.add_argument("--rdzv", default=None, help="static,c10d (default both; smoke: static)")
    parser.add_argument("--stress", type=int, default=0, help="N kills in one job instead")
    parser.add_argument(
        "--launch-timeout", type=float, default=45.0, help="s before a run counts as hung"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    smoke = args.smoke
    settings: dict[str, Any] = {
        "rdzv": (args.rdzv or ("static" if smoke else "static,c10d")).split(","),
        "runs": args.runs if args.runs is not None else (1 if smoke else 4),
        "plain": args.plain if args.plain is not None else (0 if smoke else 6),
        "steps": 40 if smoke else 60,
        "save_every": 10,
        "kill_step": 25,
        "intervals": [10] if smoke else [10, 25, 50],
        "block_steps": 50 if smoke else 100,
        "cost_repeats": 2 if smoke else 8,
        "cost_rounds": 1,
        "cost_plain": not smoke,
        "launch_timeout": args.launch_timeout,
        "stress": args.stress,
        "stress_save_every": 5,
        "stress_timeout": 60 + 20 * args.stress,
    }
    default_out = "recovery-stress" if args.stress else "recovery"
    out = Path(args.out or HERE / "results" / default_out)
    scratch = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    started = time.perf_counter()
    result: dict[str, Any] = {
        "settings": settings,
        "date": datetime.now().isoformat(timespec="seconds"),
        "load_average_before": os.getloadavg()[0],
    }
    try:
        if args.stress:
            result["stress"] = stress(settings, scratch)
        else:
            result["restarts"] = restarts(settings, scratch)
            result["cost"] = cost(settings, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    import torch

    result["versions"] = {"torch": torch.__version__}
    result["load_average_after"] = os.getloadavg()[0]
    result["seconds"] = round(time.perf_counter() - started, 1)
    write_results(out, result, markdown(result))
    if args.stress:
        return 0 if result["stress"]["outcome"] == "back" else 1
    comm_back = all(
        r["outcome"] == "back" for jobs in result["restarts"].values() for r in jobs["comm"]
    )
    return 0 if comm_back else 1


if __name__ == "__main__":
    raise SystemExit(main())
