"""Predict model-state memory per device and communication per step for DDP and ZeRO stages 1, 2 and 3.

The accounting (see ``docs/memory.md``; Ψ parameters, N ranks; ``c`` bytes of a compute parameter,
``m`` of a master parameter, ``K`` of optimizer state per parameter, ``r`` of a reduced gradient):

=========  =============================  ============  ==========  ===========
 row        parameters                     gradients     master      opt. states
=========  =============================  ============  ==========  ===========
 DDP        pΨ                             pΨ            -           KΨ
 stage 1    cΨ                             cΨ            mΨ/N        KΨ/N
 stage 2    cΨ                             mΨ/N          mΨ/N        KΨ/N
 stage 3    cΨ/N (0 with a separate        mΨ/N          mΨ/N        KΨ/N
            master), + gathered units
=========  =============================  ============  ==========  ===========

"master" is counted only where the master copy is separate from the compute copy (mixed precision,
or an offloaded optimizer); otherwise the parameters *are* the master. ``offload_optimizer`` moves
master, sharded gradients and optimizer states to CPU memory. From an ``nn.Module`` the sizes are
exact, padding included: units are planned and laid out by the engine's own ``plan_units`` and
``ShardLayout`` (see [Note: flat layout] in ``engine/layout.py``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, NamedTuple

from torch import nn

from lightning_zero.engine.grouping import module_class_policy, plan_units
from lightning_zero.engine.layout import ShardLayout
from lightning_zero.estimate_text import format_bytes, render

PRECISIONS = ("32-true", "bf16-true", "16-true", "bf16-mixed", "16-mixed")
_PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}  # as Lightning reads them
#: Default bus bandwidth (GB/s) within one node: NVLink class, below the 230-250 GB/s all-reduce bus
#: bandwidth nccl-tests reports for 8 x A100 SXM4 (H100 SXM reaches about 450).
INTRA_NODE_GBPS = 200.0
#: Default bus bandwidth (GB/s) across nodes: one 200 Gb/s InfiniBand (HDR) or RoCE link per GPU.
INTER_NODE_GBPS = 25.0
_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BYTE_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


# ---------------------------------------------------------------------------------------------- parsing
def parse_count(text: str | int) -> int:
    """A parameter count from ``"7B"``, ``"350M"``, ``"1.3b"``, ``"125k"``, ``"125_000_000"`` or an int.

    Example::

        >>> parse_count("7B"), parse_count("1.3b"), parse_count("350M"), parse_count("125,000,000")
        (7000000000, 1300000000, 350000000, 125000000)
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = Decimal(text)
    else:
        match = re.fullmatch(r"\s*([0-9][0-9_,]*(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([kmbgt]?)\s*", str(text), re.IGNORECASE)
        if match is None:
            raise ValueError(f"cannot read a parameter count from {text!r}; write e.g. 7B, 350M, 1.3b or 125000000")
        try:
            value = Decimal(match[1].replace("_", "").replace(",", "")) * _COUNT_SUFFIXES[match[2].lower()]
        except InvalidOperation as error:
            raise ValueError(f"cannot read a parameter count from {text!r}") from error
    if value < 0 or value != value.to_integral_value():
        raise ValueError(f"a parameter count must be a whole number >= 0, got {text!r}")
    return int(value)


def parse_bytes(text: str | float) -> float:
    """Bytes from ``"80GB"`` (decimal: 80e9), ``"80GiB"`` (binary: 80 * 2**30), ``"512MB"``, or a number.

    Example::

        >>> parse_bytes("80GB"), parse_bytes("80GiB"), parse_bytes("512 MB"), parse_bytes(1024)
        (80000000000.0, 85899345920.0, 512000000.0, 1024.0)
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([kmgt]i?b|b)?\s*", str(text), re.IGNORECASE)
        if match is None:
            raise ValueError(f"cannot read a size in bytes from {text!r}; write e.g. 80GB, 80GiB or 512MB")
        value = float(match[1]) * _BYTE_UNITS[(match[2] or "").lower()]
    if not value > 0 or math.isinf(value):
        raise ValueError(f"a size in bytes must be positive, got {text!r}")
    return value


# ---------------------------------------------------------------------------------------------- results
class Dtypes(NamedTuple):
    """Bytes per element that a precision implies (see the module docstring for the letters)."""

    precision: str
    compute: int  # c: the parameters forward and backward run on
    master: int  # m: the copy the optimizer steps; sharded gradients are kept in this dtype too
    separate_master: bool  # whether the master is a copy of its own (mixed precision)
    optimizer_states: float  # K: per parameter, all states together (Adam: 2 x master bytes)
    reduce: int  # r: gradients are reduce-scattered in this dtype
    ddp: int  # p: DDP's parameters and gradients (fp32 under Lightning's autocast mixed precision)


class StateBytes(NamedTuple):
    """Bytes per rank in one place (the device, or CPU memory)."""

    params: float
    grads: float
    master: float
    optimizer_states: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.master + self.optimizer_states


@dataclass(frozen=True)
class StrategyEstimate:
    """One row: what one rank holds and sends per optimizer step under one strategy."""

    strategy: str  # what to pass as Trainer(strategy=...): "ddp", "zero1", "zero2" or "zero3"
    device: StateBytes  # persistent, on the device
    cpu: StateBytes  # persistent, in CPU memory (offload_optimizer)
    gathered: float | None  # stage 3's transient gathered units (None: not known, 0: no such buffers)
    comm_bytes: float  # sent per rank per optimizer step
    comm_seconds: float
    fits: bool | None  # device_peak <= memory_per_device (None: no memory_per_device given)

    @property
    def stage(self) -> int | None:
        return None if self.strategy == "ddp" else int(self.strategy[-1])

    @property
    def label(self) -> str:
        return "DDP" if self.stage is None else f"stage {self.stage}"

    @property
    def device_peak(self) -> float:
        """Persistent device bytes plus stage 3's gathered units (where known)."""
        return self.device.total + (self.gathered or 0.0)


@dataclass(frozen=True)
class MemoryEstimate:
    """The result of ``estimate_memory``: one ``StrategyEstimate`` per strategy and what they assume."""

    numel: int
    trainable_numel: int
    devices: int
    nodes: int
    dtypes: Dtypes
    offload_optimizer: bool
    bandwidth_gbps: float
    bandwidth_source: str
    memory_per_device: float | None
    rows: tuple[StrategyEstimate, ...]
    recommended: StrategyEstimate | None
    recommendation: str
    notes: tuple[str, ...] = field(default=())
    units: int | None = None  # from a model: how many units the engine would make
    offload_params: bool = False  # stage 3's parameter shards in CPU memory too

    @property
    def world_size(self) -> int:
        return self.devices * self.nodes

    def row(self, strategy: str) -> StrategyEstimate:
        """The row of ``strategy`` ("ddp", "zero1", "zero2" or "zero3")."""
        for row in self.rows:
            if row.strategy == strategy:
                return row
        raise KeyError(f"no row {strategy!r}; rows: {[r.strategy for r in self.rows]}")

    def table(self) -> str:
        """The rows as an aligned text table, with the assumptions and the recommendation below it."""
        return render(self)

    def __str__(self) -> str:
        return self.table()

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON-serialisable): inputs, dtypes, rows in bytes and seconds, recommendation."""
        return {
            "numel": self.numel,
            "trainable_numel": self.trainable_numel,
            "devices": self.devices,
            "nodes": self.nodes,
            "world_size": self.world_size,
            "units": self.units,
            "dtypes": self.dtypes._asdict(),
            "offload_optimizer": self.offload_optimizer,
            "offload_params": self.offload_params,
            "bandwidth_gbps": self.bandwidth_gbps,
            "bandwidth_source": self.bandwidth_source,
            "memory_per_device": self.memory_per_device,
            "rows": [
                {
                    "strategy": r.strategy,
                    "stage": r.stage,
                    "device": {**r.device._asdict(), "total": r.device.total},
                    "cpu": {**r.cpu._asdict(), "total": r.cpu.total},
                    "gathered": r.gathered,
                    "device_peak": r.device_peak,
                    "comm_bytes": r.comm_bytes,
                    "comm_seconds": r.comm_seconds,
                    "fits": r.fits,
                }
                for r in self.rows
            ],
            "recommended": None if self.recommended is None else self.recommended.strategy,
            "recommendation": self.recommendation,
            "notes": list(self.notes),
        }


# ---------------------------------------------------------------------------------------------- counting
class _Counts(NamedTuple):
    """Element counts per rank that the formulas need; for a bare count, the unpadded theory."""

    numel: float  # every parameter (Ψ)
    trainable: float  # parameters with requires_grad
    padded: float  # sum of padded_numel over units (stages 1 and 2 keep these full buffers)
    trainable_padded: float  # the same over units with a trainable parameter (what is reduced)
    shard: float  # sum of shard_numel over units (master, stage-3 compute shard)
    grad_shard: float  # the same over units with a trainable parameter (sharded gradients)
    state_shard: float  # trainable elements in the fullest rank's shards (optimizer states)
    units: int | None  # how many units (None: unknown, a bare count)
    largest_unit: int | None  # padded numel of the largest unit (None: unknown)

    def gathered_numel(self, prefetch: int) -> float | None:
        """Elements stage 3 holds gathered at once: ``prefetch + 1`` units (at most all of them) of the largest
        size."""
        if self.largest_unit is None:
            return None
        return float(min(prefetch + 1, self.units or prefetch + 1) * self.largest_unit)


def _count_numel(numel: int, world_size: int, largest_unit_params: int | None) -> _Counts:
    shard = numel / world_size
    return _Counts(numel, numel, numel, numel, shard, shard, shard, None, largest_unit_params)


def _plan(model: nn.Module, unit_modules: Sequence[type[nn.Module] | str] | None) -> list[tuple[list[int], list[bool]]]:
    """Each unit's parameter numels and which are trainable, as the engine would group them."""
    policy = None if unit_modules is None else module_class_policy(list(unit_modules))
    return [([p.numel() for p in u.params], [p.requires_grad for p in u.params]) for u in plan_units(model, policy)]


def _count_model(units: list[tuple[list[int], list[bool]]], world_size: int) -> _Counts:
    per_rank = [0] * world_size  # trainable elements in each rank's shards
    numel = trainable = padded = trainable_padded = shard = grad_shard = largest = 0
    for numels, trainable_mask in units:
        layout = ShardLayout.from_shapes([(n,) for n in numels], world_size)
        numel += layout.numel
        padded += layout.padded_numel
        shard += layout.shard_numel
        largest = max(largest, layout.padded_numel)
        if any(trainable_mask):
            trainable_padded += layout.padded_numel
            grad_shard += layout.shard_numel
        size = layout.shard_numel
        for offset, n, is_trainable in zip(layout.offsets, numels, trainable_mask):
            if not is_trainable or n == 0:
                continue
            trainable += n
            first, last = offset // size, (offset + n - 1) // size
            for rank in range(first, last + 1):  # a parameter's pieces, rank by rank
                per_rank[rank] += min(offset + n, (rank + 1) * size) - max(offset, rank * size)
    return _Counts(numel, trainable, padded, trainable_padded, shard, grad_shard, max(per_rank), len(units), largest)


# ---------------------------------------------------------------------------------------------- accounting
def _dtypes(
    precision: str, optimizer_state_bytes: float | None, reduce_dtype_bytes: int, param_dtype_bytes: int | None
) -> Dtypes:
    if precision == "32-true":
        compute = master = ddp = 4
    elif precision.endswith("-true"):
        compute = master = ddp = 2
    else:  # mixed: half-precision compute copy, fp32 master; DDP under autocast keeps fp32 parameters
        compute, master, ddp = param_dtype_bytes or 2, 4, 4
    states = 2 * master if optimizer_state_bytes is None else optimizer_state_bytes
    return Dtypes(precision, compute, master, precision.endswith("-mixed"), states, reduce_dtype_bytes, ddp)


def _rows(
    counts: _Counts,
    d: Dtypes,
    world_size: int,
    offload: bool,
    prefetch: int,
    bandwidth: float,
    memory: float | None,
    offload_params: bool = False,
) -> tuple[StrategyEstimate, ...]:
    ring = (world_size - 1) / world_size  # each rank sends this fraction of a collective's buffer

    def row(
        strategy: str, device: StateBytes, cpu: StateBytes, gathered: float | None, sent: float
    ) -> StrategyEstimate:
        device, cpu = StateBytes(*map(float, device)), StateBytes(*map(float, cpu))
        fits = None if memory is None else device.total + (gathered or 0.0) <= memory
        return StrategyEstimate(strategy, device, cpu, gathered, sent * ring, sent * ring / (bandwidth * 1e9), fits)

    c, m, k = d.compute, d.master, d.optimizer_states
    nothing = StateBytes(0.0, 0.0, 0.0, 0.0)
    rows = [
        row(
            "ddp",
            StateBytes(counts.numel * d.ddp, counts.trainable * d.ddp, 0.0, counts.trainable * k),
            nothing,
            0.0,
            2 * counts.trainable * d.ddp,
        )
    ]
    separate = d.separate_master or offload
    gathered_numel = counts.gathered_numel(prefetch)
    for stage in (1, 2, 3):
        if stage < 3:
            params = counts.padded * c
        else:  # the shard is the master, or is kept to save a host-to-device copy per gather (offload)
            params = counts.shard * c if offload or not separate else 0.0
        full_grads = counts.trainable * c if stage == 1 else 0.0  # stage 1: full gradients through backward
        grad_shard, master = counts.grad_shard * m, counts.shard * m if separate else 0.0
        if offload and offload_params and stage == 3:
            # The compute shard on the host: a tensor of its own only when its dtype is not the master's.
            device = StateBytes(0.0, 0.0, 0.0, 0.0)
            cpu = StateBytes(counts.shard * c if d.separate_master else 0.0, grad_shard, master, counts.state_shard * k)
        elif offload:
            device = StateBytes(params, full_grads, 0.0, 0.0)
            cpu = StateBytes(0.0, grad_shard, master, counts.state_shard * k)
        else:  # stage 1 counts its peak, the full gradients, rather than the shards they become
            device = StateBytes(params, full_grads if stage == 1 else grad_shard, master, counts.state_shard * k)
            cpu = nothing
        gathered = (None if gathered_numel is None else gathered_numel * c) if stage == 3 else 0.0
        gathers = 2 if stage == 3 else 1  # stage 3: forward and backward; stages 1 and 2: after the step
        sent = (
            counts.trainable_padded * d.reduce
            + gathers * (counts.padded if stage == 3 else counts.trainable_padded) * c
        )
        rows.append(row(f"zero{stage}", device, cpu, gathered, sent))
    return tuple(rows)


def _recommend(rows: tuple[StrategyEstimate, ...], memory: float | None) -> StrategyEstimate | None:
    fitting = [r for r in rows if r.fits]
    if memory is None or not fitting:
        return None
    cheapest = min(r.comm_bytes for r in fitting)
    # The cheapest to communicate; on a tie (1e-9 relative) the first in row order, the lowest stage.
    return next(r for r in fitting if r.comm_bytes <= cheapest * (1 + 1e-9))


# ---------------------------------------------------------------------------------------------- public API
def estimate_memory(
    model_or_numel: nn.Module | int | str,
    devices: int = 1,
    nodes: int = 1,
    precision: str = "32-true",
    offload_optimizer: bool = False,
    optimizer_state_bytes: float | None = None,
    reduce_dtype_bytes: int = 4,
    param_dtype_bytes: int | None = None,
    bandwidth_gbps: float | None = None,
    memory_per_device: str | float | None = None,
    unit_modules: Sequence[type[nn.Module] | str] | None = None,
    prefetch: int = 1,
    largest_unit_params: int | str | None = None,
    offload_params: bool = False,
) -> MemoryEstimate:
    """Predict per-device model-state memory and per-step communication of DDP and ZeRO stages 1-3.

    Args:
        model_or_numel: a parameter count (``7_000_000_000`` or ``"7B"``), or an ``nn.Module`` whose
            parameters are counted and laid out exactly as the engine would (padding, frozen parameters).
        devices: devices per node (as ``Trainer(devices=...)``); ``nodes``: number of nodes. N = devices x nodes.
        precision: ``"32-true"``, ``"bf16-true"``, ``"16-true"``, ``"bf16-mixed"`` or ``"16-mixed"``.
        offload_optimizer: master, sharded gradients and optimizer states in CPU memory (ZeRO rows only).
        optimizer_state_bytes: optimizer state per parameter (default: 2 x master bytes, Adam/AdamW;
            0 for plain SGD, 1 x master bytes for SGD with momentum).
        reduce_dtype_bytes: element size gradients are reduce-scattered in (default 4, fp32).
        param_dtype_bytes: element size of the compute copy under mixed precision (default 2).
        bandwidth_gbps: bus bandwidth per rank in GB/s (1e9 bytes/s), as nccl-tests reports ``busbw``.
            Default: ``INTRA_NODE_GBPS`` on one node, ``INTER_NODE_GBPS`` on several.
        memory_per_device: device memory (``"80GB"``, ``"80GiB"`` or bytes) to recommend a strategy for.
        unit_modules: the strategies' ``unit_modules`` (with a model only).
        prefetch: how many units stage 3 gathers ahead; it is counted as holding ``prefetch + 1`` gathered
            units of the largest size (at most as many as there are units).
        largest_unit_params: for a bare count, the parameters of the largest unit (stage 3's gather
            buffers are then counted; without it they are not). A model's units are known exactly.
        offload_params: stage 3's parameter shards in CPU memory too (the stage-3 row only; implies
            ``offload_optimizer``): nothing persistent stays on the device, only the gathered units.

    Example::

        >>> est = estimate_memory("7B", devices=8)            # fp32 Adam: the ZeRO paper's example
        >>> [round(r.device.total / 1e9, 1) for r in est.rows]
        [112.0, 63.0, 38.5, 14.0]
        >>> est = estimate_memory("7B", devices=8, precision="bf16-mixed", memory_per_device="80GB")
        >>> est.recommended.strategy, est.row("zero2").device.total / 1e9
        ('zero1', 28.0)
    """
    if isinstance(precision, int) or precision in _PRECISION_ALIASES:
        precision = _PRECISION_ALIASES.get(str(precision), str(precision))
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    for name, value, least in (("devices", devices, 1), ("nodes", nodes, 1), ("prefetch", prefetch, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if optimizer_state_bytes is not None and not optimizer_state_bytes >= 0:
        raise ValueError(f"optimizer_state_bytes must be >= 0, got {optimizer_state_bytes!r}")
    for name, value in (("reduce_dtype_bytes", reduce_dtype_bytes), ("param_dtype_bytes", param_dtype_bytes)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer (bytes per element), got {value!r}")
    if param_dtype_bytes is not None and not precision.endswith("-mixed"):
        raise ValueError(f"param_dtype_bytes applies to mixed precision only; {precision} fixes the dtype")
    if bandwidth_gbps is not None and not (bandwidth_gbps > 0 and math.isfinite(bandwidth_gbps)):
        raise ValueError(f"bandwidth_gbps must be positive (GB/s), got {bandwidth_gbps!r}")
    memory = None if memory_per_device is None else parse_bytes(memory_per_device)
    world_size = devices * nodes

    notes = []
    units: int | None = None
    if isinstance(model_or_numel, nn.Module):
        if largest_unit_params is not None:
            raise ValueError("largest_unit_params is for a bare parameter count: a model's units are planned exactly")
        plan = _plan(model_or_numel, unit_modules)
        units = len(plan)
        counts = _count_model(plan, world_size)
        if counts.numel == 0:
            raise ValueError(f"{type(model_or_numel).__name__} has no parameters")
        numel, trainable = int(counts.numel), int(counts.trainable)
    else:
        if unit_modules is not None:
            raise ValueError("unit_modules needs a model (an nn.Module), not a parameter count")
        numel = trainable = parse_count(model_or_numel)
        if numel < 1:
            raise ValueError(f"the parameter count must be at least 1, got {model_or_numel!r}")
        largest = None if largest_unit_params is None else parse_count(largest_unit_params)
        counts = _count_numel(numel, world_size, largest)

    d = _dtypes(precision, optimizer_state_bytes, reduce_dtype_bytes, param_dtype_bytes)
    if bandwidth_gbps is not None:
        bandwidth, source = float(bandwidth_gbps), "given"
    elif nodes == 1:
        bandwidth, source = INTRA_NODE_GBPS, "default for one node: NVLink-class bus bandwidth"
        if devices > 8:
            split = f" (for nodes of 8: devices=8, nodes={devices // 8})" if devices % 8 == 0 else ""
            notes.append(
                f"{devices} devices on one node: the default bandwidth assumes they share one NVLink-class "
                f"domain; for a cluster give nodes, devices being per node{split}, or the bandwidth"
            )
    else:
        bandwidth, source = INTER_NODE_GBPS, "default for several nodes: one 200 Gb/s InfiniBand/RoCE link per GPU"
    if world_size == 1:
        notes.append("one device: nothing is communicated and nothing is sharded")
    offload_optimizer = offload_optimizer or offload_params
    rows = _rows(counts, d, world_size, offload_optimizer, prefetch, bandwidth, memory, offload_params)
    if counts.gathered_numel(prefetch) is None:
        notes.append(
            "stage 3's gathered units are not counted: the largest unit is unknown for a bare parameter count "
            "(give largest_unit_params / --largest-unit, or a model)"
        )
    recommended = _recommend(rows, memory)
    text = _recommendation_text(rows, recommended, memory, counts, d, world_size, offload_optimizer, prefetch)
    return MemoryEstimate(
        numel=numel,
        trainable_numel=trainable,
        devices=devices,
        nodes=nodes,
        dtypes=d,
        offload_optimizer=offload_optimizer,
        bandwidth_gbps=bandwidth,
        bandwidth_source=source,
        memory_per_device=memory,
        rows=rows,
        recommended=recommended,
        recommendation=text,
        notes=tuple(notes),
        units=units,
        offload_params=offload_params,
    )


def _recommendation_text(
    rows: tuple[StrategyEstimate, ...],
    best: StrategyEstimate | None,
    memory: float | None,
    counts: _Counts,
    d: Dtypes,
    world_size: int,
    offload: bool,
    prefetch: int,
) -> str:
    if memory is None:
        return "give memory_per_device (--memory) for a recommendation"
    if best is not None:
        return (
            f"{best.label} (strategy={best.strategy!r}): {format_bytes(best.device_peak)} per device of "
            f"{format_bytes(memory)}, the least communication of the options that fit"
        )
    stage3 = rows[-1]
    text = f"nothing fits in {format_bytes(memory)} per device (stage 3 needs {format_bytes(stage3.device_peak)})"
    if not offload:
        offloaded = _rows(counts, d, world_size, True, prefetch, 1.0, memory)[-1]
        text += f"; with offload_optimizer (--offload) stage 3 needs {format_bytes(offloaded.device_peak)}"
    room = memory - (stage3.gathered or 0.0)
    if room > 0:
        needed = math.ceil(stage3.device.total * world_size / room)
        text += f"; stage 3 fits on about {needed} devices"
    else:
        text += "; the gathered units alone do not fit: make the units smaller (unit_modules)"
    return text
