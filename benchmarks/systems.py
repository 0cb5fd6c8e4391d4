"""The systems under test, each built the same way: same weights, same AdamW, same batches.

A system is a ``SystemSpec``: a name, the ZeRO stage whose theory it is compared with
(``None`` = DDP), and a ``build`` function that returns a ``Trainee``, which runs one training
step at a time and reports what it holds and what it sent.

Every trainee's ``step`` does, in this order: drop the previous gradients, forward, backward,
optimizer step (and whatever the system does after it). Gradients are dropped at the *start* of a
step so that, when the benchmark reads ``state_bytes()`` after a step, every system is caught at
the same moment: right after its optimizer step, before ``zero_grad``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.counting import CommCounter, register_counted_allreduce
from benchmarks.footprint import StateBytes, from_memory_stats, held_tensors, state_bytes
from benchmarks.model import BenchConfig, build_model


@dataclass(frozen=True)
class AdamWSettings:
    """The one optimizer every system uses (torch's AdamW, default implementation)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1

    def kwargs(self) -> dict[str, Any]:
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}

    def make(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, **self.kwargs())


@dataclass
class BuildContext:
    """What every system is built from."""

    config: BenchConfig
    state: dict[str, torch.Tensor]
    counter: CommCounter
    adamw: AdamWSettings = field(default_factory=AdamWSettings)

    def model(self) -> nn.Module:
        return build_model(self.config, self.state)


class Trainee(Protocol):
    def step(self, x: torch.Tensor, y: torch.Tensor) -> float: ...

    def state_bytes(self) -> StateBytes: ...

    def comm_counts(self) -> dict[str, tuple[int, int]]:
        """``{kind: (calls, bytes sent)}`` by this rank so far (the benchmark takes differences)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SystemSpec:
    name: str
    label: str
    theory_stage: int | None
    build: Callable[[BuildContext], Trainee]
    unavailable: Callable[[], str | None] = lambda: None  # why it cannot run here, or None
    family: str = "torch"


# ------------------------------------------------------------------------------------------ torch


class _PlainTrainee:
    """A module and an optimizer driven the ordinary way (DDP, DDP + ZeroRedundancyOptimizer, FSDP2)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, counter: CommCounter) -> None:
        self.module = module
        self.optimizer = optimizer
        self.counter = counter

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.module(x, y)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _inner_optimizer(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "optim", self.optimizer)  # ZeroRedundancyOptimizer's local one

    def state_bytes(self) -> StateBytes:
        params = list(self.module.parameters())
        return state_bytes(
            params,
            [p.grad for p in params],
            self._inner_optimizer().state.values(),
            held_tensors(self.optimizer),
        )

    def comm_counts(self) -> dict[str, tuple[int, int]]:
        return self.counter.counts()

    def close(self) -> None:
        self.module = self.optimizer = None  # type: ignore[assignment]


def build_ddp(ctx: BuildContext) -> Trainee:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(ctx.model())
    register_counted_allreduce(ddp)
    return _PlainTrainee(ddp, ctx.adamw.make(ddp.parameters()), ctx.counter)


def build_zero_redundancy(ctx: BuildContext) -> Trainee:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(ctx.model())
    register_counted_allreduce(ddp)
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **ctx.adamw.kwargs())
    return _PlainTrainee(ddp, optimizer, ctx.counter)


def build_fsdp2(ctx: BuildContext) -> Trainee:
    from torch.distributed.fsdp import fully_shard

    model = ctx.model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)  # the root: embeddings (tied with lm_head) and the final LayerNorm
    return _PlainTrainee(model, ctx.adamw.make(model.parameters()), ctx.counter)


# ---------------------------------------------------------------------------------- lightning_zero


class _ShardedTrainee:
    """Our engine, driven as ``ShardedModel``'s docstring shows."""

    def __init__(
        self, ctx: BuildContext, stage: int, checks: str = "off", block_units: bool = True, **options: Any
    ) -> None:
        from lightning_zero.engine import Comm, module_class_policy, shard_model

        self.model = ctx.model()
        policy = module_class_policy(["Block"]) if block_units else None  # None: the default units
        self.sharded = shard_model(self.model, stage=stage, comm=Comm(checks=checks), units=policy, **options)
        self.optimizer = ctx.adamw.make(self.model.parameters())
        self.sharded.bind_optimizer(self.optimizer)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        with self.sharded.step_context():
            loss = self.model(x, y)
            loss.backward()
        self.optimizer.step()
        self.sharded.after_optimizer_step(self.optimizer)
        return loss.item()

    def state_bytes(self) -> StateBytes:
        return from_memory_stats(self.sharded.memory_stats())

    def comm_counts(self) -> dict[str, tuple[int, int]]:
        return {k: (v.calls, v.bytes_sent) for k, v in self.sharded.comm.stats.by_kind.items()}

    def close(self) -> None:
        # Remove the engine's hooks: a gradient hook on a parameter is held from C++, which the garbage
        # collector cannot see, so a dropped ShardedModel would otherwise stay alive with its buffers.
        # gather=False: no collectives, the module is discarded anyway.
        self.sharded.release(gather=False)
        self.model = self.sharded = self.optimizer = None  # type: ignore[assignment]


def build_ours(stage: int, **options: Any) -> Callable[[BuildContext], Trainee]:
    def build(ctx: BuildContext) -> Trainee:
        return _ShardedTrainee(ctx, stage, **options)

    return build


# --------------------------------------------------------------------------------------- DeepSpeed


def deepspeed_unavailable() -> str | None:
    """Why DeepSpeed cannot run here (``None`` if it can): it must import with its CPU accelerator."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
    except Exception as error:  # ImportError, or any failure while DeepSpeed probes the machine
        return f"import deepspeed failed: {type(error).__name__}: {error}"
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    deepspeed.utils.logger.setLevel(logging.ERROR)
    accelerator = get_accelerator()
    if dist.is_initialized() and dist.get_backend() != "gloo":
        return f"the benchmark's process group is {dist.get_backend()}, DeepSpeed's CPU path needs gloo"
    if accelerator.device_name() != "cpu":
        return f"DeepSpeed picked the {accelerator.device_name()!r} accelerator, not 'cpu' (set DS_ACCELERATOR=cpu)"
    return None


class _DeepSpeedTrainee:
    def __init__(self, ctx: BuildContext, stage: int) -> None:
        import deepspeed

        self.counter = ctx.counter
        model = ctx.model()
        config = {
            "train_micro_batch_size_per_gpu": ctx.config.batch_size,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
            "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 unless told otherwise; no other system clips
            "fp16": {"enabled": False},
            "bf16": {"enabled": False},
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        # The client optimizer is torch's AdamW, as for every other system (no fused or cpu_adam op).
        optimizer = ctx.adamw.make(model.parameters())
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config, dist_init_required=False
        )

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self.engine(x, y)  # DeepSpeed zeroes gradients inside step()
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    def state_bytes(self) -> StateBytes:
        inner = self.optimizer.optimizer  # the torch AdamW, stepping DeepSpeed's fp32 partitions
        module_params = list(self.engine.module.parameters())
        partitions = [getattr(p, "ds_tensor", None) for p in module_params]  # ZeRO-3 keeps the shard here
        masters = [p for g in inner.param_groups for p in g["params"]]
        return state_bytes(
            [*module_params, *(t for t in partitions if t is not None), *masters],
            [*(p.grad for p in module_params), *(p.grad for p in masters)],
            inner.state.values(),
            held_tensors(self.optimizer),
        )

    def comm_counts(self) -> dict[str, tuple[int, int]]:
        return self.counter.counts()

    def close(self) -> None:
        destroy = getattr(self.engine, "destroy", None)
        if destroy is not None:
            destroy()
        self.engine = self.optimizer = None  # type: ignore[assignment]


def build_deepspeed(stage: int) -> Callable[[BuildContext], Trainee]:
    def build(ctx: BuildContext) -> Trainee:
        return _DeepSpeedTrainee(ctx, stage)

    return build


# ---------------------------------------------------------------------------------------- registry

DEFAULT_BUCKET_MB = 25.0  # the strategies' bucket_size_mb without unit_modules
SYSTEMS: dict[str, SystemSpec] = {
    spec.name: spec
    for spec in (
        SystemSpec("ddp", "DDP", None, build_ddp),
        SystemSpec("zero-optim", "DDP + ZeroRedundancyOptimizer", 1, build_zero_redundancy),
        SystemSpec("fsdp2", "FSDP2 fully_shard (per Block + root)", 3, build_fsdp2),
        *(
            SystemSpec(f"ds-zero{s}", f"DeepSpeed ZeRO-{s}", s, build_deepspeed(s), deepspeed_unavailable, "deepspeed")
            for s in (1, 2, 3)
        ),
        *(SystemSpec(f"zero{s}", f"lightning_zero stage {s}", s, build_ours(s), family="ours") for s in (1, 2, 3)),
        SystemSpec(
            "zero3-checked",
            "lightning_zero stage 3, collective_checks='auto' (the strategies' default)",
            3,
            build_ours(3, checks="auto"),
            family="ours",
        ),
        *(
            SystemSpec(
                f"zero{s}-defaults",
                f"lightning_zero stage {s}, the strategies' defaults (default units"
                + (", 25 MB buckets" if s < 3 else "")
                + ", collective_checks='auto')",
                s,
                build_ours(
                    s, checks="auto", block_units=False, **({"bucket_size_mb": DEFAULT_BUCKET_MB} if s < 3 else {})
                ),
                family="ours",
            )
            for s in (1, 2, 3)
        ),
        SystemSpec(
            "zero3-keep",
            "lightning_zero stage 3, reshard_after_forward=False (2Ψ)",
            3,
            build_ours(3, reshard_after_forward=False),
            family="ours",
        ),
    )
}
DEFAULT_SYSTEMS = list(SYSTEMS)
