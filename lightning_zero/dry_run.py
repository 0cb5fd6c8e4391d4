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

import importlib.util
import json
import resource
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_zero.activations import ActivationProfile, profile_activations
from lightning_zero.driver.config import ZeROConfig
from lightning_zero.driver.driver import ZeRODriver
from lightning_zero.engine.core.ledger import GatherLedger
from lightning_zero.engine.core.memory import theory_bytes
from lightning_zero.engine.meta.init_trace import record_meta_init
from lightning_zero.engine.sharded_model import ShardedModel
from lightning_zero.estimate import (
    MAX_WORLD_SIZE,
    WIRE_BYTES_PER_ELEMENT,
    ArgumentValueError,
    estimate_memory,
    parse_argument,
)
from lightning_zero.estimate_report import format_bytes

DRY_RUN_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
STATE_KEYS = ("params", "master_params", "grads", "optimizer_states", "host_params")


@dataclass
class DryRunReport:
    """What one rank of the job holds and sends (see [Note: dry run]); ``as_dict()`` is its JSON form."""

    target: str
    stage: int
    world_size: int
    rank: int
    shard_size: int
    precision: str
    numel: int
    units: int
    steps: int
    model_state_bytes: dict[str, int]  # at rest after the last step: params, master_params, grads, optimizer_states
    theory_model_state_bytes: float  # 16Ψ/S for fp32 Adam (S: the shard group; 8Ψ/S under bf16-true), no padding
    peak_gathered_bytes: int  # stage 3's gathered units at their most, in the last step
    units_at_peak: list[str]
    reduce_buffer_bytes: int  # the bound on the reduce-scatter buffers in flight or kept (the two largest units)
    peak_step_bytes: dict[str, int]  # at the last step's peak: model state at rest, gathered units, step allocations
    bytes_sent_per_step: dict[str, dict[str, int]]  # by Comm ("world"; hybrid: "shard", "replicate"), then by kind
    calls_per_step: dict[str, dict[str, int]]
    theory_bytes_sent_per_step: float  # 2Ψ or 3Ψ elements x (S-1)/S, plus the replica all-reduce under hybrid
    # (gathers in the compute dtype, reductions in fp32)
    estimate: dict[str, Any]  # the estimator's row for the same configuration
    wall_seconds: float
    peak_rss_bytes: int
    notes: list[str] = field(default_factory=list)

    @property
    def model_state_total(self) -> int:
        return sum(self.model_state_bytes.values())

    @property
    def bytes_sent_total(self) -> int:
        return sum(sum(kinds.values()) for kinds in self.bytes_sent_per_step.values())

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["model_state_total"] = self.model_state_total
        data["bytes_sent_total"] = self.bytes_sent_total
        return data

    def _sent(self, group: str) -> str:
        kinds = self.bytes_sent_per_step[group]
        calls = self.calls_per_step[group]
        return f"{group}: " + ", ".join(f"{k} {format_bytes(v)} ({calls[k]} calls)" for k, v in kinds.items())

    def table(self) -> str:
        """A short text report, with the theory and the estimator beside the measured figures."""
        hybrid = f", shard groups of {self.shard_size}" if self.shard_size != self.world_size else ""
        est_state = self.estimate.get("device_total", 0.0) + self.estimate.get("cpu_total", 0.0)
        lines = [
            f"{self.target}: {self.numel:,} parameters in {self.units} units, ZeRO stage {self.stage}, rank "
            f"{self.rank} of {self.world_size}{hybrid}, {self.precision}, {self.steps} steps (fake process group)",
            "",
            "| | measured | theory | estimator |",
            "|---|---:|---:|---:|",
            f"| model state at rest | {format_bytes(self.model_state_total)} | "
            f"{format_bytes(self.theory_model_state_bytes)} | {format_bytes(est_state)} |",
            f"| peak gathered (stage 3) | {format_bytes(self.peak_gathered_bytes)} | | "
            f"{format_bytes(self.estimate.get('gathered') or 0.0)} |",
            f"| peak in a step | {format_bytes(self.peak_step_bytes.get('total', 0))} | | "
            f"{format_bytes(self.estimate.get('device_peak', 0.0))} |",
            f"| bytes sent per step | {format_bytes(self.bytes_sent_total)} | "
            f"{format_bytes(self.theory_bytes_sent_per_step)} | {format_bytes(self.estimate.get('comm_bytes', 0.0))} |",
            "",
            "model state: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in self.model_state_bytes.items()),
            "peak in a step: "
            + ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in self.peak_step_bytes.items()),
            "units gathered at the peak: " + (", ".join(self.units_at_peak) or "none"),
            f"reduce-scatter buffers in flight or kept: at most {format_bytes(self.reduce_buffer_bytes)}",
            "sent per step: "
            + "; ".join(
                f"{group}: "
                + ", ".join(f"{k} {format_bytes(v)} ({self.calls_per_step[group][k]} calls)" for k, v in kinds.items())
                for group, kinds in self.bytes_sent_per_step.items()
            ),
            f"this process: {self.wall_seconds:.1f} s, peak RSS {format_bytes(self.peak_rss_bytes)}",
            *self.notes,
        ]
        return "\n".join(lines)


class StepMemory(TorchDispatchMode):
    """Tensor storage a block of code allocates, alive at each aten op, and its peak, with stage 3's gathered units
    (``ledger``) beside it: the peak is the op where the two together are largest.

    [Note: peak bytes in a step]
    Every tensor an op returns on a storage that did not exist before the block (activations, what autograd saves,
    full gradients before their reduction, reduce-scatter buffers, the gradient shards produced, the optimizer's
    temporaries) is counted from the op that made it until its last tensor is gone (a weak reference per tensor,
    counted per storage). The gathered units are the ledger's: their buffers exist before the step and are resized,
    not allocated, so they are not counted twice. Model state at rest (parameters, masters, optimizer states) is
    what existed before and is added by the caller. Example::

        with StepMemory(sharded.gathered) as step:
            train_one_step()
        step.peak_allocated, step.gathered_at_peak
    """

    def __init__(self, ledger: GatherLedger) -> None:
        super().__init__()
        self._ledger = ledger
        self._before: set[int] = set()  # storages seen as inputs before they were made here: older than the block
        self._tensors: dict[int, int] = {}  # storage -> tensors alive on it
        self._bytes: dict[int, int] = {}
        self._refs: dict[int, Any] = {}  # the weak references themselves, kept alive (by id: they compare by value)
        self.allocated = 0
        self.peak_allocated = 0
        self.gathered_at_peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten((args, kwargs))[0]:
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                key = tensor.untyped_storage().data_ptr()
                if key not in self._tensors:
                    self._before.add(key)
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                self._track(tensor)
        gathered = self._ledger.current
        if self.allocated + gathered > self.peak_allocated + self.gathered_at_peak:
            self.peak_allocated, self.gathered_at_peak = self.allocated, gathered
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or (key in self._before and key not in self._tensors):
            return  # no memory, or a view or in-place result of a storage older than the block
        if key not in self._tensors:
            self._tensors[key] = 0
            self._bytes[key] = storage.nbytes()
            self.allocated += storage.nbytes()
        self._tensors[key] += 1

        def gone(ref: Any, key: int = key) -> None:
            self._refs.pop(id(ref), None)
            self._tensors[key] -= 1
            if self._tensors[key] == 0:
                del self._tensors[key]
                self.allocated -= self._bytes.pop(key)
                self._before.discard(key)  # the address may be handed out again

        ref = weakref.ref(tensor, gone)
        self._refs[id(ref)] = ref


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

    from lightning_zero.strategies.precision import ZeROPrecision

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
        plugin = ZeROPrecision(precision)  # type: ignore[arg-type]
        factory = _factory(target, init_kwargs or {})
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
        optimizer = _optimizer(module)
        sharded.bind_optimizer(optimizer)
        sharded.reducer.check_finite = False  # the reduced values are this rank's alone: nothing to check
        batch = _batch(module, batch_shape)
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
        report = _report(
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


def build_on_meta(target: str | Callable[[], Any], init_kwargs: dict[str, Any] | None = None) -> nn.Module:
    """The ``LightningModule`` that ``target`` names (as ``dry_run`` takes it), built on the meta device as stage 3
    builds it (its ``configure_model`` too): every parameter's shape, and no memory, for ``estimate_memory``.

    Example::

        estimate_memory(build_on_meta("examples/dry_run_gpt.py:GPT1B"), devices=8)
    """
    factory = _factory(target, init_kwargs or {})
    with record_meta_init():
        module = factory()
        if hasattr(module, "configure_model"):
            module.configure_model()
    return module


def _factory(target: str | Callable[[], Any], kwargs: dict[str, Any]) -> Callable[[], Any]:
    if not isinstance(target, str):
        return lambda: target(**kwargs)
    location, sep, name = target.rpartition(":")
    if not sep or not location or not name:
        raise ValueError(f"expected FILE.py:CLASS or module:CLASS, got {target!r}")
    if location.endswith(".py"):
        path = Path(location).resolve()
        if not path.is_file():
            raise ValueError(f"{location!r} is not a file")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        source = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(path.stem, source)
        spec.loader.exec_module(source)
    else:
        source = importlib.import_module(location)
    if not hasattr(source, name):
        raise ValueError(f"{location!r} has no {name!r}")
    cls = getattr(source, name)
    return lambda: cls(**kwargs)


def _optimizer(module: Any) -> torch.optim.Optimizer:
    """The module's first optimizer (``configure_optimizers`` may return one, a list, or Lightning's dict)."""
    configured = module.configure_optimizers()
    if isinstance(configured, dict):
        configured = configured["optimizer"]
    if isinstance(configured, (list, tuple)):
        configured = configured[0]
        if isinstance(configured, (list, tuple)):
            configured = configured[0]
    if not isinstance(configured, torch.optim.Optimizer):
        raise TypeError(f"configure_optimizers returned {type(configured).__name__}; dry_run needs an optimizer")
    return configured


def _batch(module: Any, batch_shape: tuple[int, ...] | None) -> Any:
    if batch_shape is not None:
        x = torch.zeros(batch_shape, dtype=torch.long)
        return x, x.clone()
    loader = getattr(module, "train_dataloader", None)
    try:
        return next(iter(loader())) if callable(loader) else None
    except Exception as error:  # a datamodule-driven module: its own dataloader hook raises
        raise ValueError(f"the module's train_dataloader() gave no batch ({error}); pass batch_shape") from error


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


def _report(
    target: str,
    module: Any,
    sharded: ShardedModel,
    optimizer: Any,
    config: ZeROConfig,
    precision: str,
    plugin: Any,
    world_size: int,
    rank: int,
    steps: int,
    state: dict[str, int],
    before: dict[str, Any],
    after: dict[str, Any],
    activations: ActivationProfile | None = None,
) -> DryRunReport:
    numel = sum(p.numel() for p in _unique_params(module))
    shard = sharded.shard_size
    # Bytes per element the theory assumes: a "-true" half precision keeps parameters, gradients and Adam's two
    # states in the half type; fp32 and mixed precision keep fp32 ones (mixed: the master). Gathers move the compute
    # dtype, reductions fp32 (the default reduce dtype of half-precision parameters).
    held = 2 if precision.endswith("-true") and precision != "32-true" else 4
    theory = theory_bytes(config.stage, numel, shard, held, held, 2 * held)
    sent: dict[str, dict[str, int]] = {}
    calls: dict[str, dict[str, int]] = {}
    for name, stats in after.items():
        delta = stats.since(before[name]) if name in before else stats
        sent[name] = {k: int(v.bytes_sent) for k, v in delta.by_kind.items() if v.calls}
        calls[name] = {k: int(v.calls) for k, v in delta.by_kind.items() if v.calls}
    element = 4  # reduced gradients, fp32; an int8 row's bytes per element where quantized
    compute = 4 if precision == "32-true" else 2
    wire = WIRE_BYTES_PER_ELEMENT
    gathered = (2 if config.stage == 3 else 1) * numel * (wire if config.quantize_weights else compute)
    reduced = numel * (wire if config.quantize_grads else element)
    traffic = (gathered + reduced) * (shard - 1) / shard
    if shard != world_size:  # each shard group's reduced gradient shard, all-reduced across the replicas
        replicas = world_size // shard
        traffic += 2 * (numel / shard) * element * (replicas - 1) / replicas
    per_node = min(world_size, 8)  # the estimator's nodes: 8 devices each, as the default --shard-size "node"
    est = estimate_memory(
        module,
        devices=per_node,
        nodes=max(1, world_size // per_node),
        precision=precision,
        offload_optimizer=config.offload_optimizer,
        offload_params=config.offload_params,
        unit_modules=None if config.unit_modules is None else list(config.unit_modules),
        shard_size=None if shard == world_size else shard,
        activations=activations,
        quantize_weights=config.quantize_weights,
        quantize_grads=config.quantize_grads,
    )
    row = est.row(f"zero{config.stage}")
    model_state = {k: state[k] for k in STATE_KEYS}
    notes = []
    if world_size % min(world_size, 8):
        notes.append("estimator: the world does not split into nodes of 8; its row assumes one node")
    return DryRunReport(
        target=target,
        stage=config.stage,
        world_size=world_size,
        rank=rank,
        shard_size=shard,
        precision=precision,
        numel=numel,
        units=len(sharded.units),
        steps=steps,
        model_state_bytes=model_state,
        theory_model_state_bytes=float(theory.total),
        peak_gathered_bytes=sharded.gathered.peak,
        units_at_peak=list(sharded.gathered.at_peak),
        reduce_buffer_bytes=int(sharded.reducer.max_in_flight_bytes),
        peak_step_bytes={},
        bytes_sent_per_step=sent,
        calls_per_step=calls,
        theory_bytes_sent_per_step=traffic,
        estimate={
            "device_total": row.device.total,
            "cpu_total": row.cpu.total,
            "gathered": row.gathered,
            "activations": row.activations,
            "device_peak": row.device_peak,
            "comm_bytes": row.comm_bytes,
            "comm_seconds": row.comm_seconds,
        },
        wall_seconds=0.0,
        peak_rss_bytes=0,
        notes=notes,
    )


def _unique_params(module: nn.Module) -> list[nn.Parameter]:
    return list(dict.fromkeys(module.parameters()))


def write_json(report: DryRunReport, path: str | Path) -> None:
    """``report.as_dict()`` as JSON at ``path``."""
    Path(path).write_text(json.dumps(report.as_dict(), indent=2) + "\n")
