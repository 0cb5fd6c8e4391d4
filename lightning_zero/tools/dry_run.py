"""``dry_run``: one rank of an N-rank ZeRO job, run for real in one process, to see whether the job fits and what
it sends, before any cluster is booked.

[Note: dry run]
The process joins torch's fake process-group backend (``init_process_group("fake", ...)``) as rank ``r`` of
``N``: every collective returns at once without sending anything (an all-gather fills every slot with this
rank's shard, a reduce-scatter keeps this rank's chunk unreduced, an all-reduce leaves its input). Everything
else is the real engine, through the same ``ZeRODriver.shard`` the strategies call: the model built on the meta
device and created one unit at a time already sharded, the units, layouts, buckets and prefetches, ``K`` real
training steps of the real schedule on one batch. The values are meaningless; the memory and the schedule are
real, and so are the bytes ``Comm`` counts with its ring model (each collective counted as the real one would
send). What the simulation leaves out:

- activations and the autograd graph are this process's (one micro-batch of the given shape), so the peak RSS is
  the job's only for that batch; the peak in a step (``StepMemory``, see [Note: peak bytes in a step]) counts
  them as tensors, beside the model state at rest and the gathered units;
- every collective completes at once, so no reduction is still in flight when the next begins (a real run may
  hold up to the reduce-buffer bound there), and none allocates beyond its output, as NCCL's do (gloo, which has
  no reduce-scatter, passes a small one through a temporary the size of the unit's gradients);
- CPU memory has no caching allocator: a GPU's fragmentation and NCCL's own buffers (typically a few hundred MB
  per process) are not counted;
- time: collectives cost nothing here, so the wall time is the compute of one rank on this machine, not a step
  time; the estimator's network time is given beside it.

The estimator's row for the same configuration is given beside the measured figures; its peak in a step adds the
activations ``profile_activations`` measures on a second copy of the module built on meta, with the same batch
and policy (not under mixed precision: autocast does not run on meta).

Agreements need other ranks, so the collective checks are off; a checkpoint save is not simulated.

Example::

    report = dry_run("examples/dry_run_gpt.py:GPT1B", world_size=512, stage=3)
    print(report.table())
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from lightning_zero.driver.config import ZeROConfig
from lightning_zero.driver.driver import ZeRODriver
from lightning_zero.driver.precision import PrecisionDtypes
from lightning_zero.engine.sharded_model import ShardedModel
from lightning_zero.planning.activations import ActivationProfile, profile_activations
from lightning_zero.planning.arguments import MAX_WORLD_SIZE, ArgumentValueError, parse_argument
from lightning_zero.tools.dry_run_report import STATE_KEYS, DryRunReport, build_report
from lightning_zero.tools.step_memory import StepMemory
from lightning_zero.tools.targets import first_batch, first_optimizer, target_factory

DRY_RUN_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


def dry_run(
    target: str | Callable[[], Any],
    world_size: int,
    stage: int = 3,
    rank: int = 0,
    shard_size: int | str | None = None,
    precision: str = "32-true",
    offload_optimizer: bool = False,
    offload_params: bool = False,
    unit_modules: list[type[nn.Module] | str] | None = None,
    steps: int = 2,
    batch_shape: tuple[int, ...] | None = None,
    init_kwargs: dict[str, Any] | None = None,
    activation_checkpointing: list[type[nn.Module] | str] | None = None,
    quantize_weights: str | None = None,
    quantize_grads: str | None = None,
) -> DryRunReport:
    """Run rank ``rank`` of a ``world_size``-rank ZeRO job in this process (see [Note: dry run]) and report its
    memory and communication. ``target``: ``"FILE.py:CLASS"`` or ``"module:CLASS"`` (a ``LightningModule`` class,
    built with ``init_kwargs``, its model made in ``__init__`` or ``configure_model``), or a function returning one.
    The batch is the first of the module's ``train_dataloader()``; with ``batch_shape``, ``(x, y)``: two int64
    tensors of that shape (token ids 0), as language models take. ``activation_checkpointing``: module classes (or
    names) whose forward is recomputed in backward (the strategies' ``activation_checkpointing_policy``).
    ``quantize_weights`` / ``quantize_grads``: the strategies' options (the bytes are those of the int8 rows). Needs a
    process without a process group."""
    _check_arguments(world_size, stage, rank, steps, batch_shape, precision)
    group_size = parse_argument("shard_size", lambda size: _resolve(size, world_size), shard_size)
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("dry_run needs a process without a process group (it joins a fake one of its own)")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    start = time.perf_counter()
    torch.manual_seed(0)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        config = ZeROConfig(
            stage=stage,
            unit_modules=unit_modules,
            collective_checks="off",
            offload_optimizer=offload_optimizer,
            offload_params=offload_params,
            shard_size=shard_size,
            activation_checkpointing_policy=activation_checkpointing or None,
            quantize_weights=quantize_weights,
            quantize_grads=quantize_grads,
        )
        driver = ZeRODriver(config)
        device = torch.device("cpu")
        plugin = PrecisionDtypes(precision)
        factory = target_factory(target, init_kwargs or {})
        # In the precision's init context, as Lightning builds the model for the strategies (bf16-true: the layers
        # are made in bf16, and the cast at setup has nothing left to do).
        with driver.recording_init(device), plugin.module_init_context():
            module = factory()
            if hasattr(module, "configure_model"):
                module.configure_model()
        sharded = driver.shard(
            module,
            device=device,
            param_dtype=plugin.default_param_dtype,
            shard_size=group_size,
            prepare=plugin.convert_module,
        )
        optimizer = first_optimizer(module)
        sharded.bind_optimizer(optimizer)
        sharded.reducer.check_finite = False  # the reduced values are this rank's alone: nothing to check
        batch = first_batch(module, batch_shape)
        activations, note = _profile(factory, plugin, precision, config, batch)
        for step in range(steps - 1):
            _train_step(module, sharded, optimizer, plugin, batch, step)
            optimizer.zero_grad()
        before = {name: comm.stats.snapshot() for name, comm in sharded.comms().items()}
        sharded.gathered.reset()
        at_rest = sharded.memory_stats()  # before the last step: what it starts from
        with StepMemory(sharded.gathered) as tracked:
            _train_step(module, sharded, optimizer, plugin, batch, steps - 1)
        after = {name: comm.stats.snapshot() for name, comm in sharded.comms().items()}
        state = sharded.memory_stats()
        report = build_report(
            target if isinstance(target, str) else getattr(target, "__name__", "model"),
            module,
            sharded,
            optimizer,
            config,
            precision,
            plugin,
            world_size,
            rank,
            steps,
            state,
            before,
            after,
            activations,
        )
        if note:
            report.notes.append(note)
        report.peak_step_bytes = {
            "model_state_at_rest": sum(at_rest[k] for k in STATE_KEYS),
            "gathered": tracked.gathered_at_peak,
            "step_allocations": tracked.peak_allocated,
        }
        report.peak_step_bytes["total"] = sum(report.peak_step_bytes.values())
        optimizer.zero_grad()
        report.wall_seconds = time.perf_counter() - start
        report.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return report
    finally:
        dist.destroy_process_group()


def _profile(
    factory: Callable[[], Any], plugin: Any, precision: str, config: ZeROConfig, batch: Any
) -> tuple[ActivationProfile | None, str | None]:
    """The activations of one micro-batch of ``batch`` for the estimator, measured on a second copy of the module
    built on the meta device (see [Note: activation memory per unit] in ``activations.py``)."""
    if batch is None:
        return None, None
    if precision.endswith("-mixed"):  # autocast has no meta device: the profile would be the fp32 one
        return None, f"estimator: activations not profiled under {precision} (autocast does not run on meta)"
    with torch.device("meta"), plugin.module_init_context():
        copy = factory()
        if hasattr(copy, "configure_model"):
            copy.configure_model()
    copy = plugin.convert_module(copy)
    on_meta = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, batch)
    try:
        profile = profile_activations(
            copy,
            lambda module: module.training_step(on_meta, 0),
            unit_modules=None if config.unit_modules is None else list(config.unit_modules),
            activation_checkpointing_policy=config.activation_checkpointing_policy,
        )
    except Exception as error:  # an op without a meta kernel, a step that reads values: the estimate goes without
        return None, f"estimator: activations not profiled (the training step does not run on meta: {error})"
    return profile, None


def _check_arguments(
    world_size: int, stage: int, rank: int, steps: int, batch_shape: tuple[int, ...] | None, precision: str
) -> None:
    """Refuse what ``dry_run`` cannot run, naming the argument (``ArgumentValueError``), before anything starts."""
    if precision not in DRY_RUN_PRECISIONS:
        raise ArgumentValueError("precision", f"must be one of {DRY_RUN_PRECISIONS} in a dry run, got {precision!r}")
    for name, value in (("world_size", world_size), ("steps", steps)):
        if not _is_int(value) or value < 1:
            raise ArgumentValueError(name, f"must be an integer >= 1, got {value!r}")
    if world_size > MAX_WORLD_SIZE:
        raise ArgumentValueError(
            "world_size", f"must be at most {MAX_WORLD_SIZE:,} (torch's largest), got {world_size:,}"
        )
    if stage not in (1, 2, 3) or not _is_int(stage):
        raise ArgumentValueError("stage", f"must be 1, 2 or 3, got {stage!r}")
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise ArgumentValueError("rank", f"must be in [0, {world_size}) (one of the world_size ranks), got {rank!r}")
    if batch_shape is not None and (not batch_shape or not all(_is_int(n) and n >= 1 for n in batch_shape)):
        raise ArgumentValueError("batch_shape", f"must be positive integers, e.g. (1, 128), got {batch_shape!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _resolve(shard_size: int | str | None, world_size: int) -> int:
    from lightning_zero.engine.comm.mesh import resolve_shard_size

    return resolve_shard_size(shard_size, world_size, min(world_size, 8))


def _train_step(module: Any, sharded: ShardedModel, optimizer: Any, plugin: Any, batch: Any, step: int) -> None:
    """One training step as ``ZeROStrategy`` runs it: the step begun, the user's ``training_step`` in the precision's
    forward context, backward, the step ended, the optimizer on the shards, the updated shards gathered."""
    if batch is None:
        raise ValueError("the module has no train_dataloader(): pass batch_shape")
    sharded.begin_step()
    with plugin.forward_context():
        out = module.training_step(batch, step)
    loss = out["loss"] if isinstance(out, dict) else out
    loss.backward()
    sharded.end_step()
    with sharded.on_shards(optimizer):
        optimizer.step()
    sharded.after_optimizer_step(optimizer)
