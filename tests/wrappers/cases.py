"""Functions run on every rank of a real gloo world by the wrappers' tests.

Each case trains a wrapped model on rank-dependent data and compares its parameters with
an oracle computed on the same rank without any distributed code: one process that sees
the batches of every rank concatenated (which is what DDP must compute). Cases return the
largest absolute parameter difference, so the tests can assert and report it.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import FullyShardedDataParallel

import comm_collectives as dist
from comm_wrappers import (
    AmpOptimWrapper,
    LossModel,
    MMDistributedDataParallel,
    MMFullyShardedDataParallel,
    MMFullyShardedDataParallel2,
    MMSeparateDistributedDataParallel,
    OptimWrapper,
    OptimWrapperDict,
    is_model_wrapper,
    unwrap_model,
)

BATCH = 4


class Net(nn.Module):
    """A small MLP that follows MMEngine's BaseModel contract (``forward(..., mode=)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(4, 8)
        self.lin2 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, inputs: torch.Tensor, targets: Any = None, mode: str = "tensor") -> Any:
        out = self.head(torch.tanh(self.lin2(torch.tanh(self.lin1(inputs)))))
        if mode == "loss":
            return {"loss": ((out.float() - targets) ** 2).mean(), "mean_out": out.detach().mean()}
        return out


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-dependent data: every (step, micro-step, rank) has its own batch."""
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    inputs = torch.randn(BATCH, 4, generator=generator) + rank
    targets = torch.randn(BATCH, 2, generator=generator)
    return inputs, targets


def global_batch(step: int, micro: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [batch(step, micro, r) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def make_optimizer(params: Any, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def oracle(
    steps: int,
    accum: int,
    world: int,
    *,
    clip: float | None = None,
    optimizer: str = "sgd",
    dtype: torch.dtype | None = None,
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """One process, plain torch: each update sees every rank's micro-batches.

    On ``device``, with autocast to ``dtype`` and, for float16, a dynamic ``GradScaler``
    (clipping after unscaling), as a hand-written mixed-precision loop does.
    """
    model = make_net().to(device)
    optim = make_optimizer(model.parameters(), optimizer)
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    for step in range(steps):
        for micro in range(accum):
            inputs, targets = (t.to(device) for t in global_batch(step, micro, world))
            with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
                loss = model(inputs, targets, mode="loss")["loss"]
            scaler.scale(loss / accum).backward()
        if clip is not None:
            scaler.unscale_(optim)
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optim)
        scaler.update()
        optim.zero_grad()
    return params_of(model)


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("module.", "")


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters by name, whatever the wrapper (FSDP1 shards are gathered)."""
    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            return {_clean(n): p.detach().clone() for n, p in model.named_parameters()}
    out = {}
    for name, param in unwrap_model(model).named_parameters():
        full = getattr(param, "full_tensor", None)
        value = full() if callable(full) else param
        out[_clean(name)] = value.detach().clone()
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float((a[k].float().cpu() - b[k].float().cpu()).abs().max()) for k in a)


def wrap(kind: str, **options: Any) -> nn.Module:
    net = make_net()
    if kind == "ddp":
        return MMDistributedDataParallel(net, **options)
    if kind == "fsdp":
        return MMFullyShardedDataParallel(net, **options)
    if kind == "fsdp2":
        return MMFullyShardedDataParallel2(net, **options)
    raise ValueError(kind)


def train(
    model: nn.Module,
    steps: int,
    accum: int,
    *,
    clip: float | None = None,
    optimizer: str = "sgd",
    amp: torch.dtype | None = None,
    use_fsdp: bool = False,
) -> OptimWrapper:
    clip_grad = None if clip is None else {"type": "norm", "max_norm": clip}
    optim = make_optimizer(model.parameters(), optimizer)
    if amp is not None:
        wrapper: OptimWrapper = AmpOptimWrapper(
            optim, dtype=amp, accumulative_counts=accum, clip_grad=clip_grad, use_fsdp=use_fsdp
        )
    else:
        wrapper = OptimWrapper(optim, accumulative_counts=accum, clip_grad=clip_grad)
    rank = dist.get_rank()
    for step in range(steps):
        for micro in range(accum):
            log_vars = model.train_step(batch(step, micro, rank), wrapper)  # type: ignore[operator]
            assert list(log_vars) == ["loss", "mean_out"], list(log_vars)
    return wrapper


def equivalence(
    kind: str,
    steps: int = 3,
    accum: int = 1,
    clip: float | None = None,
    optimizer: str = "sgd",
    amp: str | None = None,
    **options: Any,
) -> dict[str, float]:
    """Train a wrapped model; its difference to the oracle and to DDP trained the same way."""
    world = dist.get_world_size()
    dtype = getattr(torch, amp) if amp else None
    model = wrap(kind, **options)
    optim = train(
        model, steps, accum, clip=clip, optimizer=optimizer, amp=dtype, use_fsdp=kind != "ddp"
    )
    got = params_of(model)
    expected = oracle(steps, accum, world, clip=clip, optimizer=optimizer, dtype=dtype)
    result = {"oracle": max_diff(got, expected)}
    if kind != "ddp":
        reference = wrap("ddp")
        train(reference, steps, accum, clip=clip, optimizer=optimizer, amp=dtype)
        result["ddp"] = max_diff(got, params_of(reference))
    if clip is not None:
        result["grad_norm"] = float(optim.grad_norm)  # type: ignore[arg-type]
    return result


def ddp_sync_counts(accum: int = 4) -> dict[str, Any]:
    """All-reduce calls per micro-step under accumulation, and the result against the oracle."""
    model = wrap("ddp")
    calls: list[int] = []

    def counting_hook(state, bucket):  # type: ignore[no-untyped-def] # DDP checks the annotations
        calls.append(1)
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    model.register_comm_hook(None, counting_hook)  # type: ignore[operator]
    wrapper = OptimWrapper(make_optimizer(model.parameters(), "sgd"), accumulative_counts=accum)
    per_micro = []
    for step in range(2):
        for micro in range(accum):
            before = len(calls)
            model.train_step(batch(step, micro, dist.get_rank()), wrapper)  # type: ignore[operator]
            per_micro.append(len(calls) - before)
    # One update over the big batch: every rank's 4 micro-batches at once.
    big = make_net()
    optim = make_optimizer(big.parameters(), "sgd")
    world = dist.get_world_size()
    for step in range(2):
        parts = [global_batch(step, micro, world) for micro in range(accum)]
        inputs = torch.cat([p[0] for p in parts])
        targets = torch.cat([p[1] for p in parts])
        big(inputs, targets, mode="loss")["loss"].backward()
        optim.step()
        optim.zero_grad()
    return {"per_micro": per_micro, "diff": max_diff(params_of(model), params_of(big))}


def fsdp_val_test_steps(kind: str) -> float:
    """val_step and test_step through the sharded forward equal the full model's output."""
    model = wrap(kind)
    inputs, targets = batch(0, 0, dist.get_rank())
    with torch.no_grad():
        expected = make_net()(inputs)
    got_val = model.val_step((inputs, targets))  # type: ignore[operator]
    got_test = model.test_step({"inputs": inputs})  # type: ignore[operator]
    return max(float((got_val - expected).abs().max()), float((got_test - expected).abs().max()))


# ---------------------------------------------------------------- separate DDP (GAN)
class Gan(nn.Module):
    """A toy GAN: two optimizers, each over its own child, and a parameter-free child."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.generator = nn.Linear(3, 4)
        self.discriminator = nn.Linear(4, 1)
        self.activation = nn.Tanh()  # no parameters: moved, not wrapped

    def losses(self, noise: torch.Tensor, real: torch.Tensor) -> tuple[Any, Any]:
        fake = self.activation(self.generator(noise))
        g_loss = -self.discriminator(fake).mean()
        d_loss = self.discriminator(fake.detach()).mean() - self.discriminator(real).mean()
        return g_loss, d_loss

    def train_step(self, data: Any, optim_wrapper: OptimWrapperDict) -> dict[str, torch.Tensor]:
        noise, real = data
        g_wrapper, d_wrapper = optim_wrapper["generator"], optim_wrapper["discriminator"]
        with torch.no_grad():
            fake = self.activation(self.generator(noise))
        with d_wrapper.optim_context(self.discriminator):
            d_loss = self.discriminator(fake).mean() - self.discriminator(real).mean()
        d_wrapper.update_params(d_loss)
        # The generator's step must not leave gradients on the discriminator.
        discriminator = unwrap_model(self.discriminator)
        discriminator.requires_grad_(False)
        with g_wrapper.optim_context(self.generator):
            g_loss = -discriminator(self.activation(self.generator(noise))).mean()
        g_wrapper.update_params(g_loss)
        discriminator.requires_grad_(True)
        return {"g_loss": g_loss.detach(), "d_loss": d_loss.detach()}


def gan_batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(500 + 100 * step + 10 * micro + rank)
    return torch.randn(BATCH, 3, generator=generator), torch.randn(BATCH, 4, generator=generator)


def separate_ddp_gan(accum: int = 2, steps: int = 2) -> dict[str, Any]:
    """A two-optimizer GAN under separate DDP with accumulation, against one process."""
    gan = Gan()
    model = MMSeparateDistributedDataParallel(gan)
    wrapped = {n: type(c).__name__ for n, c in gan.named_children()}
    wrappers = OptimWrapperDict(
        generator=OptimWrapper(
            torch.optim.SGD(gan.generator.parameters(), lr=0.1), accumulative_counts=accum
        ),
        discriminator=OptimWrapper(
            torch.optim.SGD(gan.discriminator.parameters(), lr=0.05), accumulative_counts=accum
        ),
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(steps):
        for micro in range(accum):
            with model.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                model.train_step(gan_batch(step, micro, rank), wrappers)
    # The oracle: the same updates, one process, every rank's batches at once.
    ref = Gan()
    g_opt = torch.optim.SGD(ref.generator.parameters(), lr=0.1)
    d_opt = torch.optim.SGD(ref.discriminator.parameters(), lr=0.05)
    for step in range(steps):
        for micro in range(accum):
            parts = [gan_batch(step, micro, r) for r in range(world)]
            noise = torch.cat([p[0] for p in parts])
            real = torch.cat([p[1] for p in parts])
            with torch.no_grad():
                fake = ref.activation(ref.generator(noise))
            d_loss = ref.discriminator(fake).mean() - ref.discriminator(real).mean()
            (d_loss / accum).backward()
            if micro == accum - 1:
                d_opt.step()
                d_opt.zero_grad()
            ref.discriminator.requires_grad_(False)
            g_loss = -ref.discriminator(ref.activation(ref.generator(noise))).mean()
            (g_loss / accum).backward()
            ref.discriminator.requires_grad_(True)
            if micro == accum - 1:
                g_opt.step()
                g_opt.zero_grad()
    got = {n: p.detach() for n, p in gan.named_parameters()}
    expected = {n: p.detach() for n, p in ref.named_parameters()}
    model.train(False)
    modes = [m.training for m in gan.modules()]
    return {
        "wrapped": wrapped,
        "diff": max_diff({_clean(k): v for k, v in got.items()}, expected),
        "eval_propagates": not any(modes),
    }


def separate_ddp_no_sync_skips_every_child() -> list[bool]:
    """Inside no_sync() no child all-reduces: gradients stay rank-local."""
    gan = Gan()
    model = MMSeparateDistributedDataParallel(gan)
    rank = dist.get_rank()
    with model.no_sync():
        g, d = gan.losses(*gan_batch(0, 0, rank))
        (g + d).backward()
    local = [p.grad.clone() for p in gan.parameters()]  # type: ignore[union-attr]
    gathered = dist.all_gather(torch.cat([t.flatten() for t in local]))
    return [not torch.equal(gathered[0], gathered[r]) for r in range(1, len(gathered))]


class Broken(nn.Module):
    """Its second child cannot be wrapped (a parameter on a device DDP refuses: meta)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(2, 2)
        self.second = nn.Linear(2, 2, device="meta")


def separate_ddp_failure_leaves_module_intact() -> dict[str, Any]:
    model = Broken()
    before = {n: type(c).__name__ for n, c in model.named_children()}
    try:
        MMSeparateDistributedDataParallel(model)
    except Exception as error:  # what DDP raises for a meta module is torch's business
        raised = type(error).__name__
    else:
        raised = None
    after = {n: type(c).__name__ for n, c in model.named_children()}
    return {"raised": raised, "before": before, "after": after}


# ---------------------------------------------------------------- MMEngine interop
def mmengine_model() -> nn.Module:
    """A real ``mmengine.model.BaseModel`` subclass around `Net`."""
    from mmengine.model import BaseModel

    class MMNet(BaseModel):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = Net()

        def forward(self, inputs: Any, data_samples: Any = None, mode: str = "tensor") -> Any:
            if mode == "loss":
                return {"loss": self.net(inputs, data_samples, mode="loss")["loss"]}
            return self.net(inputs)

    return MMNet()


def mmengine_interop(kind: str, optim_kind: str) -> dict[str, float]:
    """A real mmengine BaseModel subclass with MMEngine's OptimWrapper or ours."""
    from mmengine.optim import OptimWrapper as MMOptimWrapper

    model = mmengine_model()
    if kind == "separate":
        # BaseModel's own train_step runs; its child is a DDP of its own.
        wrapped = MMSeparateDistributedDataParallel(model)
    elif kind == "ddp":
        wrapped: nn.Module = MMDistributedDataParallel(model)
    elif kind == "fsdp":
        wrapped = MMFullyShardedDataParallel(model)
    else:
        wrapped = MMFullyShardedDataParallel2(model)
    optim = make_optimizer(wrapped.parameters(), "sgd")
    wrapper: Any = (
        MMOptimWrapper(optim, accumulative_counts=2)
        if optim_kind == "mmengine"
        else OptimWrapper(optim, accumulative_counts=2)
    )
    rank = dist.get_rank()
    for step in range(2):
        for micro in range(2):
            inputs, targets = batch(step, micro, rank)
            wrapped.train_step({"inputs": inputs, "data_samples": targets}, wrapper)  # type: ignore[operator]
    got = {k.removeprefix("net."): v for k, v in params_of(wrapped).items()}
    inputs, _ = batch(0, 0, rank)
    predicted = wrapped.val_step({"inputs": inputs})  # type: ignore[operator]
    ref = Net()
    ref.load_state_dict(oracle(2, 2, dist.get_world_size()))
    with torch.no_grad():
        expected_prediction = ref(inputs)
    return {
        "diff": max_diff(got, oracle(2, 2, dist.get_world_size())),
        "prediction": float((predicted - expected_prediction).abs().max()),
    }


# ---------------------------------------------------------------- errors and helpers
def error_of(fn: Callable[[], Any]) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as error:
        return type(error).__name__, str(error)
    return None


class NoMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.lin(inputs)


def bad_inputs() -> dict[str, Any]:
    """Each bad option or model gives an error that says what is valid and how to fix it."""
    policy = {"type": "size_based_auto_wrap_policy", "min_num_params": 10}
    mixed = {"param_dtype": "bfloat16"}
    out: dict[str, Any] = {
        "strategy": error_of(lambda: wrap("fsdp", sharding_strategy="FULL_SHARDED")),
        "prefetch": error_of(lambda: wrap("fsdp", backward_prefetch="PRE")),
        "policy": error_of(lambda: wrap("fsdp", auto_wrap_policy={"type": "size_policy"})),
        "policy_class": error_of(lambda: wrap("fsdp", auto_wrap_policy="Block")),
        "mixed": error_of(lambda: wrap("fsdp", mixed_precision={"param_dtype": "bf17"})),
        "mixed2_buffer": error_of(
            lambda: wrap("fsdp2", mixed_precision={"buffer_dtype": "bfloat16"})
        ),
        "init_fn": error_of(lambda: wrap("fsdp", param_init_fn="no_such_init")),
        "ignored": error_of(lambda: wrap("fsdp", ignored_modules=["nope"])),
        "clip": error_of(
            lambda: OptimWrapper(
                make_optimizer(make_net().parameters(), "sgd"), clip_grad={"type": "l2"}
            )
        ),
    }
    # The accepted forms work and the caller's dicts are left as they were.
    fsdp = wrap("fsdp", auto_wrap_policy=policy, mixed_precision=mixed, cpu_offload=False)
    fsdp2 = wrap("fsdp2", auto_wrap_policy=["Linear"], mixed_precision=mixed)
    out["configs_untouched"] = policy == {
        "type": "size_based_auto_wrap_policy",
        "min_num_params": 10,
    } and mixed == {"param_dtype": "bfloat16"}
    out["fsdp_units"] = sum(isinstance(m, FullyShardedDataParallel) for m in fsdp.modules())
    from torch.distributed.fsdp import FSDPModule

    out["fsdp2_units"] = sum(isinstance(m, FSDPModule) for m in fsdp2.modules())
    no_mode = MMDistributedDataParallel(NoMode())
    wrapper = OptimWrapper(torch.optim.SGD(no_mode.parameters(), lr=0.1))
    out["no_mode"] = error_of(lambda: no_mode.train_step((torch.ones(1, 2),), wrapper))
    adapted = MMDistributedDataParallel(LossModel(NoMode(), nn.MSELoss()))
    wrapper = OptimWrapper(torch.optim.SGD(adapted.parameters(), lr=0.1))
    out["adapted"] = sorted(adapted.train_step((torch.ones(1, 2), torch.zeros(1, 1)), wrapper))
    return out


class PartlyUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(2, 1)
        self.unused = nn.Linear(2, 1)

    def forward(self, inputs: torch.Tensor, mode: str = "tensor") -> Any:
        out = self.used(inputs)
        return {"loss": out.sum()} if mode == "loss" else out


def anomalous_params() -> list[str]:
    model = MMDistributedDataParallel(
        PartlyUsed(), detect_anomalous_params=True, find_unused_parameters=True
    )
    wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.train_step((torch.ones(1, 2),), wrapper)
    return [str(w.message) for w in caught if "took no part" in str(w.message)]


def registry_builtins() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net = make_net()
    ddp = nn.parallel.DistributedDataParallel(net)
    # torch's default mesh is on the machine's accelerator: a gloo world needs a CPU one
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = fully_shard(make_net(), mesh=mesh)
    fsdp1 = FullyShardedDataParallel(make_net(), device_id=torch.device("cpu"))
    ours = MMFullyShardedDataParallel2(make_net())
    return {
        "ddp": (is_model_wrapper(ddp), unwrap_model(ddp) is net),
        "fsdp1": (is_model_wrapper(fsdp1), type(unwrap_model(fsdp1)).__name__),
        "fsdp2": (is_model_wrapper(sharded), unwrap_model(sharded) is sharded),
        "ours2": (is_model_wrapper(ours), unwrap_model(ours) is ours.module),
        "plain": is_model_wrapper(net),
    }


def param_init_fn_dict() -> dict[str, Any]:
    """A model built on the meta device, materialised by ``param_init_fn=dict(type=...)``."""
    torch.manual_seed(0)
    with torch.device("meta"):
        net = Net()
    spec = {"type": "reset_parameters", "device": "cpu"}
    original = copy.deepcopy(spec)
    model = MMFullyShardedDataParallel(net, param_init_fn=spec)
    full = params_of(model)
    gathered = dist.all_gather_object({k: v.sum().item() for k, v in full.items()})
    return {
        "devices": sorted({str(p.device) for p in model.parameters()}),
        "same_on_ranks": all(g == gathered[0] for g in gathered),
        "untouched": spec == original,
    }


def doctor_check() -> list[tuple[str, bool, str]]:
    from comm_wrappers.doctor import check

    return [(r.name, r.ok, r.detail) for r in check()]


def fsdp1_clip_without_the_model() -> tuple[str, str] | None:
    """update_params outside optim_context under FSDP1: clipping by norm refuses the shard."""
    model = wrap("fsdp")
    wrapper = OptimWrapper(
        make_optimizer(model.parameters(), "sgd"), clip_grad={"type": "norm", "max_norm": 0.1}
    )
    inputs, targets = batch(0, 0, dist.get_rank())
    loss = model(inputs, targets, mode="loss")["loss"]
    return error_of(lambda: wrapper.update_params(loss))


# ---------------------------------------------------------------- review regressions
class Overflowing(nn.Module):
    """Rank 0's gradient of ``a`` overflows in float16; ``rest`` is finite everywhere."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Parameter(torch.ones(4))
        self.rest = nn.Linear(16, 16)

    def forward(self, inputs: torch.Tensor, big: torch.Tensor, mode: str = "tensor") -> Any:
        return {"loss": (self.a * big).sum() + self.rest(inputs).float().pow(2).mean()}


def fp16_overflow_on_one_rank_under_fsdp1() -> dict[str, Any]:
    """Every rank skips the step and lowers the scale, with or without use_fsdp."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    out = {}
    big = torch.tensor(1e35 if dist.get_rank() == 0 else 1.0)
    for use_fsdp in (False, True):
        model = MMFullyShardedDataParallel(Overflowing())
        wrapper = AmpOptimWrapper(
            torch.optim.SGD(model.parameters(), lr=0.1), dtype="float16", use_fsdp=use_fsdp
        )
        before = params_of(model)
        model.train_step((torch.ones(2, 16), big), wrapper)
        after = params_of(model)
        out[use_fsdp] = {
            "sharded": isinstance(wrapper.loss_scaler, ShardedGradScaler),
            "scale": float(wrapper.loss_scaler.get_scale()),
            "stepped": bool((before["rest.weight"] != after["rest.weight"]).any()),
        }
    return out


class WithOwnParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.child = nn.Linear(2, 2)


def review_errors() -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp.wrap import CustomPolicy

    policy = CustomPolicy(lambda module: isinstance(module, nn.Linear) and module.out_features == 8)
    fsdp1 = wrap("fsdp", auto_wrap_policy=policy)
    fsdp2 = wrap("fsdp2", auto_wrap_policy=policy)
    static = MMDistributedDataParallel(make_net(), static_graph=True)
    static_wrapper = OptimWrapper(make_optimizer(static.parameters(), "sgd"), accumulative_counts=2)
    inner = wrap("fsdp", auto_wrap_policy=["Linear"])
    inner_wrapper = OptimWrapper(
        make_optimizer(inner.parameters(), "sgd"), clip_grad={"max_norm": 0.1}
    )
    inputs, targets = batch(0, 0, dist.get_rank())
    with inner_wrapper.optim_context(inner):  # the first forward decides the root
        inner(inputs, targets, mode="loss")["loss"].backward()
    inner_wrapper.zero_grad()

    def clip_with_inner_module() -> None:
        user_module = unwrap_model(inner)
        with inner_wrapper.optim_context(user_module):
            loss = inner(inputs, targets, mode="loss")["loss"]
        inner_wrapper.update_params(loss)

    nonfinite = wrap("fsdp")
    nonfinite_wrapper = OptimWrapper(
        make_optimizer(nonfinite.parameters(), "sgd"),
        clip_grad={"max_norm": 0.1, "error_if_nonfinite": True},
    )
    nan_batch = (torch.full((BATCH, 4), float("nan")), targets)
    return {
        "custom1": sum(isinstance(m, FullyShardedDataParallel) for m in fsdp1.modules()),
        "custom2": sum(isinstance(m, FSDPModule) for m in fsdp2.modules()),
        "static": error_of(lambda: static.train_step(batch(0, 0, 0), static_wrapper)),
        "inner": error_of(clip_with_inner_module),
        "nonfinite": error_of(lambda: nonfinite.train_step(nan_batch, nonfinite_wrapper)),
        "own_param": error_of(lambda: MMSeparateDistributedDataParallel(WithOwnParameter())),
        "no_train_step": error_of(lambda: MMSeparateDistributedDataParallel(Gan()).val_step(None)),
        "fsdp2_strategy": error_of(lambda: wrap("fsdp2", sharding_strategy="FULL_SHARD")),
        "mp_ignore": type(
            wrap("fsdp", mixed_precision={"_module_classes_to_ignore": (nn.BatchNorm1d,)})
        ).__name__,
    }
