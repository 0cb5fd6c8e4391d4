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
``ShardLayout`` (see [Note: flat layout] in ``engine/core/layout.py``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from typing import NamedTuple, TypeVar

from torch import nn

from lightning_zero.activations import ActivationProfile
from lightning_zero.engine.comm.mesh import resolve_shard_size
from lightning_zero.engine.comm.quantized import BLOCK, check_quantization, mixed_blocks, row_bytes
from lightning_zero.engine.core.grouping import ROOT_NAME, module_class_policy, plan_units
from lightning_zero.engine.core.layout import ShardLayout
from lightning_zero.estimate_report import (
    INTER_NODE_GBPS,
    INTRA_NODE_GBPS,
    PCIE_GBPS,
    Dtypes,
    MemoryEstimate,
    StateBytes,
    StrategyEstimate,
    format_bytes,
    format_seconds,
)

T = TypeVar("T")
R = TypeVar("R")
WIRE_BYTES_PER_ELEMENT = 1 + 4 / BLOCK  # an int8 value and its share of the block's fp32 scale
PRECISIONS = ("32-true", "bf16-true", "16-true", "bf16-mixed", "16-mixed")
_PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}  # as Lightning reads them
_COUNT_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BYTE_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
MAX_COUNT = 2**53  # the largest count whose byte arithmetic (floats) stays exact
MAX_WORLD_SIZE = 2**31 - 1  # torch.distributed's largest world size (a C int)
ELEMENT_SIZES = (1, 2, 4, 8)  # bytes per element of the dtypes (float8 ... float64)


class ArgumentValueError(ValueError):
    """A value that an argument does not allow: ``argument`` names it as the function's parameter, and
    ``requirement`` says what is allowed (the message is ``"<argument> <requirement>"`` unless given), so that the
    command line can say the same of its flag (``argument --bandwidth: must be positive (GB/s), got -1.0``).

    Example::

        raise ArgumentValueError("devices", f"must be an integer >= 1, got {devices!r}")
    """

    def __init__(self, argument: str, requirement: str, message: str | None = None) -> None:
        super().__init__(message or f"{argument} {requirement}")
        self.argument = argument
        self.requirement = requirement

    @classmethod
    def wrapping(cls, argument: str, error: ValueError) -> ArgumentValueError:
        """``error`` (raised for the value of ``argument``) with the argument named; its message unchanged."""
        return cls(argument, str(error), message=str(error))


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
    if value > MAX_COUNT:
        raise ValueError(f"a parameter count must be at most 2**53 (about 9.0e15), got {text!r}")
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
    largest_unit: int | None  # padded numel of the largest unit other than the root (None: unknown)
    root_unit: int = 0  # padded numel of the root unit (0: none, or a bare count)
    # Padded and shard numel of the units stage 3 gathers once per micro-batch rather than twice (see
    # ``stage3_gathered_bytes``): the root unit and the unit that ends the forward. 0: a bare count.
    once_padded: int = 0
    once_shard: int = 0
    # Per unit: its shard_numel, how many full blocks of its quantized rows go exactly, whether it has a trainable
    # parameter (see [Note: blocks that span parameters] in engine/comm/quantized.py), whether stage 3 gathers it
    # once per micro-batch. None: a bare count.
    quantized_rows: tuple[tuple[int, int, bool, bool], ...] | None = None

    def quantized_bytes(self, element: int, world_size: int, trainable_only: bool) -> float:
        """Bytes of one quantized collective of every unit (or of those with a trainable parameter), all its rows:
        1 + 4/256 per element, and ``element`` bytes per element of the blocks sent exactly."""
        if self.quantized_rows is None:
            return (self.trainable_padded if trainable_only else self.padded) * WIRE_BYTES_PER_ELEMENT
        return float(
            sum(
                world_size * row_bytes(numel, element, exact)
                for numel, exact, trainable, _ in self.quantized_rows
                if trainable or not trainable_only
            )
        )

    def stage3_gathered_bytes(self, element: int, world_size: int, quantized: bool) -> float:
        """Bytes of the all-gathers of one stage-3 micro-batch, all ranks' rows (the ring's (N-1)/N not applied).

        [Note: gathers per micro-batch]
        Every unit is gathered in its forward and again when backward reaches it, with two exceptions that the
        engine makes (see [Note: prefetch] in ``engine/schedule/stage3.py``): the root unit is held gathered for the
        whole step, and the unit that ends the recorded forward stays gathered for the backward that starts with
        it. Each is gathered once. Which unit ends the forward is known only by running the model; the estimate
        takes the last unit in registration order other than the root, the last block of a transformer. So a
        model below the one-unit threshold (the root unit alone, see [Note: default units] in
        ``engine/core/grouping.py``) is gathered once per micro-batch, as stages 1 and 2 are, and a bare count
        keeps the theory's two gathers of everything (3Ψ in all with the reduction)."""
        if not quantized:
            return (2 * self.padded - self.once_padded) * element
        if self.quantized_rows is None:
            return 2 * self.padded * WIRE_BYTES_PER_ELEMENT
        return float(
            sum(
                (1 if once else 2) * world_size * row_bytes(numel, element, exact)
                for numel, exact, _, once in self.quantized_rows
            )
        )

    def gathered_numel(self, prefetch: int) -> float | None:
        """Elements stage 3 holds gathered at once: the root unit, held for the whole step, and ``prefetch + 1``
        other units (at most all of them) of the largest size: the one computing and those gathered ahead."""
        if self.largest_unit is None:
            return None
        others = (self.units - (1 if self.root_unit else 0)) if self.units is not None else prefetch + 1
        return float(self.root_unit + min(prefetch + 1, others) * self.largest_unit)


def _count_numel(numel: int, world_size: int, largest_unit_params: int | None) -> _Counts:
    shard = numel / world_size
    return _Counts(numel, numel, numel, numel, shard, shard, shard, None, largest_unit_params)


_Planned = tuple[list[int], list[bool], bool]  # a unit's parameter numels, which are trainable, whether it is the root


def _plan(model: nn.Module, unit_modules: Sequence[type[nn.Module] | str] | None) -> list[_Planned]:
    """Each unit's parameter numels and which are trainable, as the engine would group them."""
    policy = None if unit_modules is None else module_class_policy(list(unit_modules))
    return [
        ([p.numel() for p in u.params], [p.requires_grad for p in u.params], u.name == ROOT_NAME)
        for u in plan_units(model, policy)
    ]


def _count_model(units: list[_Planned], world_size: int) -> _Counts:
    per_rank = [0] * world_size  # trainable elements in each rank's shards
    numel = trainable = padded = trainable_padded = shard = grad_shard = largest = root = 0
    once_padded = once_shard = 0
    quantized_rows = []
    # The units gathered once per micro-batch under stage 3: the root, and the last other unit (see [Note: gathers
    # per micro-batch]).
    ends_forward = max((i for i, (_, _, is_root) in enumerate(units) if not is_root), default=None)
    for index, (numels, trainable_mask, is_root) in enumerate(units):
        layout = ShardLayout.from_shapes([(n,) for n in numels], world_size)
        starts = (offset for offset, n in zip(layout.offsets, numels) if n)  # as ShardedUnit plans its blocks
        exact = max(map(len, mixed_blocks(layout.shard_numel, world_size, starts)), default=0)
        once = is_root or index == ends_forward
        quantized_rows.append((layout.shard_numel, exact, any(trainable_mask), once))
        if once:
            once_padded += layout.padded_numel
            once_shard += layout.shard_numel
        numel += layout.numel
        padded += layout.padded_numel
        shard += layout.shard_numel
        if is_root:
            root = layout.padded_numel
        else:
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
    counts = (numel, trainable, padded, trainable_padded, shard, grad_shard, max(per_rank), len(units), largest, root)
    return _Counts(*counts, once_padded, once_shard, tuple(quantized_rows))


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


class _Links(NamedTuple):
    """The machine the estimate assumes: bandwidths in GB/s and its shape."""

    intra_node: float  # bus bandwidth of a collective whose group stays inside one node
    inter_node: float  # ... whose group spans nodes
    pcie: float  # host-device copies, per device
    devices: int  # per node
    nodes: int

    def spans_nodes(self, group_size: int, stride: int = 1) -> bool:
        """Whether a group of ``group_size`` ranks ``stride`` apart (consecutive ranks fill a node first) spans
        nodes."""
        if self.nodes == 1 or group_size == 1:
            return False
        return stride * (group_size - 1) >= self.devices or self.devices % (stride * group_size) != 0

    def seconds(self, group_size: int, sent: float, stride: int = 1) -> float:
        bandwidth = self.inter_node if self.spans_nodes(group_size, stride) else self.intra_node
        return sent / (bandwidth * 1e9)


def _ddp_row(counts: _Counts, setting: _Setting) -> StrategyEstimate:
    d, world_size, links, memory = setting.d, setting.world_size, setting.links, setting.memory
    sent = 2 * counts.trainable * d.ddp * (world_size - 1) / world_size  # one ring all-reduce of the gradients
    device = StateBytes(counts.numel * d.ddp, counts.trainable * d.ddp, 0.0, counts.trainable * d.optimizer_states)
    spans = links.spans_nodes(world_size)
    return StrategyEstimate(
        "ddp",
        device,
        StateBytes(0.0, 0.0, 0.0, 0.0),
        0.0,
        sent,
        links.seconds(world_size, sent),
        None if memory is None else device.total + setting.activations <= memory,
        intra_node_bytes=0.0 if spans else sent,
        inter_node_bytes=sent if spans else 0.0,
        activations=setting.activations,
    )


class _Setting(NamedTuple):
    """What every row of one estimate shares."""

    d: Dtypes
    world_size: int
    prefetch: int
    links: _Links
    memory: float | None
    micro_batches: int = 1  # accumulate_grad_batches: the micro-batches of one optimizer step
    activations: float = 0.0  # one micro-batch's activations at their peak (0: not profiled)
    quantize_weights: str | None = None  # stage 3's gathers for compute (see comm/quantized.py)
    quantize_grads: str | None = None  # stages 2 and 3's reduce-scatters


def _zero_row(
    stage: int,
    counts: _Counts,
    setting: _Setting,
    shard_size: int,
    offload: bool,
    offload_params: bool,
    accumulate: str = "sharded",
) -> StrategyEstimate:
    """One ZeRO row; ``counts`` laid out over ``shard_size`` ranks (see [Note: hybrid sharding] in
    ``engine/comm/mesh.py`` and docs/multinode.md). Bytes are per optimizer step, over its ``micro_batches``:
    stage 3 gathers every unit twice per micro-batch but the root unit and the unit that ends the forward (see
    [Note: gathers per micro-batch]), and stages 2 and 3 reduce-scatter every micro-batch unless
    ``accumulate="local"`` (see [Note: local accumulation] in ``engine/schedule/grads.py``), which holds the full
    gradients on the device instead, as stage 1 does."""
    d, world_size, prefetch, links, memory, micro_batches, activations, quantize_weights, quantize_grads = setting
    c, m, k = d.compute, d.master, d.optimizer_states
    offload = offload or offload_params
    separate = d.separate_master or offload
    if stage < 3:
        params = counts.padded * c
    elif offload_params:  # the compute shard lives in CPU memory (it is the master when the dtypes match)
        params = 0.0
    else:  # the shard is the master, or is kept to save a host-to-device copy per gather (offload)
        params = counts.shard * c if offload or not separate else 0.0
    local = stage == 1 or accumulate == "local"  # full gradients added up on the device until one reduction
    full_grads = counts.trainable * c if local else 0.0
    grad_shard, master = counts.grad_shard * m, counts.shard * m if separate else 0.0
    if offload:
        device = StateBytes(params, full_grads, 0.0, 0.0)
        host_params = counts.shard * c if offload_params and d.separate_master else 0.0
        cpu = StateBytes(host_params, grad_shard, master, counts.state_shard * k)
    else:  # stage 1 (and local accumulation) counts its peak, the full gradients, rather than the shards
        device = StateBytes(params, full_grads or grad_shard, master, counts.state_shard * k)
        cpu = StateBytes(0.0, 0.0, 0.0, 0.0)
    gathered = (
        (None if counts.gathered_numel(prefetch) is None else counts.gathered_numel(prefetch) * c)
        if (stage == 3)
        else 0.0
    )
    # Inside each shard group: the reduce-scatter, and the all-gathers (stage 3: forward and backward, see [Note:
    # gathers per micro-batch]; stages 1 and 2: the updated shards after the step). Across the groups: one
    # all-reduce of each gradient shard.
    reductions = 1 if local else micro_batches
    # Quantized rows carry 1 byte per element and a 4-byte scale per block, and the blocks across parameters exactly
    # (see [Note: quantized collectives]), inside the shard group only; the replicas' all-reduce stays exact.
    weights = quantize_weights if stage == 3 else None
    grads = quantize_grads if stage > 1 else None
    gathered_bytes = (
        micro_batches * counts.stage3_gathered_bytes(c, shard_size, quantized=bool(weights))
        if stage == 3
        else counts.trainable_padded * c
    )
    reduced_bytes = (
        counts.quantized_bytes(d.reduce, shard_size, trainable_only=True)
        if grads
        else counts.trainable_padded * d.reduce
    )
    inside = (reductions * reduced_bytes + gathered_bytes) * (shard_size - 1) / shard_size
    replicas = world_size // shard_size
    across = reductions * 2 * counts.grad_shard * d.reduce * (replicas - 1) / replicas
    seconds = links.seconds(shard_size, inside) + links.seconds(replicas, across, stride=shard_size)
    intra = (0.0 if links.spans_nodes(shard_size) else inside) + (
        0.0 if links.spans_nodes(replicas, shard_size) else across
    )
    # Host-device copies per step: the gradient shard down and the updated shard up (offload_optimizer); with
    # offload_params the shard goes up at each gather instead of once after the step.
    host = 0.0
    if offload:
        uploaded = micro_batches * (2 * counts.shard - counts.once_shard) if offload_params else counts.shard
        host = reductions * grad_shard + uploaded * c
    return StrategyEstimate(
        f"zero{stage}",
        device,
        cpu,
        gathered,
        inside + across,
        seconds,
        None if memory is None else device.total + (gathered or 0.0) + activations <= memory,
        intra_node_bytes=intra,
        inter_node_bytes=inside + across - intra,
        host_bytes=host,
        host_seconds=host / (links.pcie * 1e9),
        shard_size=shard_size,
        offload_optimizer=offload,
        offload_params=offload_params,
        accumulate=accumulate if stage > 1 and micro_batches > 1 else None,
        activations=activations,
        quantize_weights=weights,
        quantize_grads=grads,
    )


def _rows(
    counts: _Counts, setting: _Setting, shard_size: int, offload: bool, offload_params: bool
) -> tuple[StrategyEstimate, ...]:
    ddp = _ddp_row(counts, setting)
    zero = [_zero_row(s, counts, setting, shard_size, offload, offload_params and s == 3) for s in (1, 2, 3)]
    if setting.micro_batches > 1:  # both accumulation modes of stages 2 and 3, after the defaults
        zero += [_zero_row(s, counts, setting, shard_size, offload, offload_params and s == 3, "local") for s in (2, 3)]
    return (ddp, *zero)


def _candidates(counts_for: Callable[[int], _Counts], setting: _Setting) -> list[StrategyEstimate]:
    """Every configuration the recommendation weighs, in order of preference on a tie: DDP, then each stage
    sharded over all ranks, then over each node (several nodes only), each without offload, with the optimizer
    offloaded, and (stage 3) with the parameters offloaded too."""
    world_size, links = setting.world_size, setting.links
    sizes = [world_size] + ([links.devices] if links.nodes > 1 and world_size % links.devices == 0 else [])
    rows = [_ddp_row(counts_for(world_size), setting)]
    for stage in (1, 2, 3):
        for size in sizes:
            for offload, offload_params in ((False, False), (True, False), (True, True)):
                if not offload_params or stage == 3:
                    counts = counts_for(size)
                    for accumulate in ("sharded", "local") if stage > 1 and setting.micro_batches > 1 else ("sharded",):
                        rows.append(_zero_row(stage, counts, setting, size, offload, offload_params, accumulate))
    return rows


def _recommend(candidates: list[StrategyEstimate], memory: float | None) -> StrategyEstimate | None:
    """The fitting candidate with the least transfer time, offloading as little as possible: a configuration
    that offloads is considered only when none that offloads less fits (offload adds the optimizer step on
    the CPU and host memory traffic, which this estimate does not time)."""
    if memory is None:
        return None
    for level in ((False, False), (True, False), (True, True)):
        fitting = [r for r in candidates if r.fits and (r.offload_optimizer, r.offload_params) == level]
        if fitting:
            fastest = min(r.transfer_seconds for r in fitting)
            # On a tie (1e-9 relative) the first in the candidates' order.
            return next(r for r in fitting if r.transfer_seconds <= fastest * (1 + 1e-9))
    return None


# ---------------------------------------------------------------------------------------------- public API
def parse_argument(argument: str, parse: Callable[[T], R], value: T) -> R:
    """``parse(value)``, its ``ValueError`` an ``ArgumentValueError`` naming ``argument`` (the message unchanged).

    Example::

        shard = parse_argument("shard_size", lambda size: resolve_shard_size(size, 16, 8), "node")
    """
    try:
        return parse(value)
    except ArgumentValueError:
        raise
    except ValueError as error:
        raise ArgumentValueError.wrapping(argument, error) from error


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
    shard_size: int | str | None = None,
    offload_params: bool = False,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
    pcie_gbps: float | None = None,
    accumulate_grad_batches: int = 1,
    activations: ActivationProfile | None = None,
    quantize_weights: str | None = None,
    quantize_grads: str | None = None,
) -> MemoryEstimate:
    """Predict per-device model-state memory and per-step communication of DDP and ZeRO stages 1-3.

    Args:
        model_or_numel: a parameter count (``7_000_000_000`` or ``"7B"``), or an ``nn.Module`` whose
            parameters are counted and laid out exactly as the engine would (padding, frozen parameters).
        devices: devices per node (as ``Trainer(devices=...)``); ``nodes``: number of nodes. N = devices x nodes.
        precision: ``"32-true"``, ``"bf16-true"``, ``"16-true"``, ``"bf16-mixed"`` or ``"16-mixed"``.
        offload_optimizer: master, sharded gradients and optimizer states in CPU memory (ZeRO rows only).
        offload_params: stage 3's parameter shards in CPU memory too, copied to the device at each gather
            (implies ``offload_optimizer`` in the stage-3 row; stages 1 and 2 keep full parameters).
        optimizer_state_bytes: optimizer state per parameter (default: 2 x master bytes, Adam/AdamW;
            0 for plain SGD, 1 x master bytes for SGD with momentum).
        reduce_dtype_bytes: element size gradients are reduce-scattered in (default 4, fp32).
        param_dtype_bytes: element size of the compute copy under mixed precision (default 2).
        bandwidth_gbps: bus bandwidth per rank in GB/s (1e9 bytes/s), as nccl-tests reports ``busbw``, for
            every collective (sets both levels below).
        intra_node_gbps / inter_node_gbps: the bus bandwidth of a collective whose group stays inside one
            node / spans nodes (defaults ``INTRA_NODE_GBPS`` and ``INTER_NODE_GBPS``).
        pcie_gbps: host-device copies per device (offload; default ``PCIE_GBPS``).
        shard_size: ranks per shard group of the ZeRO rows (hybrid sharding: states sharded inside each group,
            replicated across groups): ``None`` for all ranks, ``"node"`` for the devices of one node.
        memory_per_device: device memory (``"80GB"``, ``"80GiB"`` or bytes) to recommend a strategy for.
        unit_modules: the strategies' ``unit_modules`` (with a model only).
        prefetch: how many units stage 3 gathers ahead; it is counted as holding ``prefetch + 1`` gathered
            units of the largest size (at most as many as there are units).
        largest_unit_params: for a bare count, the parameters of the largest unit (stage 3's gather
            buffers are then counted; without it they are not). A model's units are known exactly.
        accumulate_grad_batches: micro-batches per optimizer step; bytes are per optimizer step. Above 1, stages 2
            and 3 get a second row each with ``accumulate="local"`` (one reduce-scatter per step, the full
            gradients held on the device), and the recommendation weighs both.
        activations: one micro-batch's activations per unit, from ``profile_activations`` (see [Note: activation
            memory per unit] in ``activations.py``); their peak is added to every row's device total and weighed
            by the recommendation. Without it, rows count model states only.
        quantize_weights / quantize_grads: ``"int8"``: the strategies' options of the same names (see [Note:
            quantized collectives] in ``engine/comm/quantized.py``): stage 3's gathers, and the reduce-scatters of
            stages 2 and 3, move 1 + 4/256 bytes per element inside the shard group.

    Example::

        >>> est = estimate_memory("7B", devices=8)            # fp32 Adam: the ZeRO paper's example
        >>> [round(r.device.total / 1e9, 1) for r in est.rows]
        [112.0, 63.0, 38.5, 14.0]
        >>> est = estimate_memory("7B", devices=8, precision="bf16-mixed", memory_per_device="80GB")
        >>> est.recommended.strategy, est.row("zero2").device.total / 1e9
        ('zero1', 28.0)
        >>> est = estimate_memory("70B", devices=8, nodes=8, precision="bf16-mixed", shard_size="node")
        >>> round(est.row("zero3").device.total / 1e9, 1), round(est.row("zero3").inter_node_bytes / 1e9, 1)
        (140.0, 61.2)
    """
    if isinstance(precision, int) or precision in _PRECISION_ALIASES:
        precision = _PRECISION_ALIASES.get(str(precision), str(precision))
    if precision not in PRECISIONS:
        raise ArgumentValueError("precision", f"must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    for name, value, least in (
        ("devices", devices, 1),
        ("nodes", nodes, 1),
        ("prefetch", prefetch, 0),
        ("accumulate_grad_batches", accumulate_grad_batches, 1),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ArgumentValueError(name, f"must be an integer >= {least}, got {value!r}")
    if devices * nodes > MAX_WORLD_SIZE:
        raise ArgumentValueError(
            "devices",
            f"must be at most {MAX_WORLD_SIZE // nodes:,} with {nodes} node(s): devices x nodes is the world size, at "
            f"most {MAX_WORLD_SIZE:,} (torch's largest), got {devices:,}",
        )
    if optimizer_state_bytes is not None and not (optimizer_state_bytes >= 0 and math.isfinite(optimizer_state_bytes)):
        raise ArgumentValueError(
            "optimizer_state_bytes", f"must be a finite number >= 0, got {optimizer_state_bytes!r}"
        )
    for name, value in (("reduce_dtype_bytes", reduce_dtype_bytes), ("param_dtype_bytes", param_dtype_bytes)):
        if value is not None and (isinstance(value, bool) or value not in ELEMENT_SIZES):
            raise ArgumentValueError(name, f"must be a dtype's bytes per element (1, 2, 4 or 8), got {value!r}")
    if param_dtype_bytes is not None and not precision.endswith("-mixed"):
        raise ArgumentValueError("param_dtype_bytes", f"applies to mixed precision only; {precision} fixes the dtype")
    if bandwidth_gbps is not None and not (bandwidth_gbps > 0 and math.isfinite(bandwidth_gbps)):
        raise ArgumentValueError("bandwidth_gbps", f"must be positive (GB/s), got {bandwidth_gbps!r}")
    for name, value in (
        ("intra_node_gbps", intra_node_gbps),
        ("inter_node_gbps", inter_node_gbps),
        ("pcie_gbps", pcie_gbps),
    ):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ArgumentValueError(name, f"must be positive (GB/s), got {value!r}")
    memory = None if memory_per_device is None else parse_argument("memory_per_device", parse_bytes, memory_per_device)
    world_size = devices * nodes
    shard = parse_argument("shard_size", lambda size: resolve_shard_size(size, world_size, devices), shard_size)

    notes = []
    units: int | None = None
    if isinstance(model_or_numel, nn.Module):
        if largest_unit_params is not None:
            raise ArgumentValueError(
                "largest_unit_params", "is for a bare parameter count: a model's units are planned exactly"
            )
        plan = _plan(model_or_numel, unit_modules)
        units = len(plan)

        def counts_for(size: int) -> _Counts:
            return _count_model(plan, size)

        counts = counts_for(world_size)
        if counts.numel == 0:
            raise ValueError(f"{type(model_or_numel).__name__} has no parameters")
        numel, trainable = int(counts.numel), int(counts.trainable)
    else:
        if unit_modules is not None:
            raise ArgumentValueError("unit_modules", "needs a model (an nn.Module), not a parameter count")
        numel = trainable = parse_argument("model_or_numel", parse_count, model_or_numel)
        if numel < 1:
            raise ArgumentValueError(
                "model_or_numel",
                f"must be at least 1, got {model_or_numel!r}",
                f"the parameter count must be at least 1, got {model_or_numel!r}",
            )
        largest = None
        if largest_unit_params is not None:
            largest = parse_argument("largest_unit_params", parse_count, largest_unit_params)
        if largest is not None and not 1 <= largest <= numel:
            raise ArgumentValueError(
                "largest_unit_params", f"must be between 1 and the parameter count ({numel:,}), got {largest:,}"
            )

        def counts_for(size: int) -> _Counts:
            return _count_numel(numel, size, largest)

        counts = counts_for(world_size)

    d = _dtypes(precision, optimizer_state_bytes, reduce_dtype_bytes, param_dtype_bytes)
    intra = float(bandwidth_gbps or intra_node_gbps or INTRA_NODE_GBPS)
    inter = float(bandwidth_gbps or inter_node_gbps or INTER_NODE_GBPS)
    links = _Links(intra, inter, float(pcie_gbps or PCIE_GBPS), devices, nodes)
    if bandwidth_gbps is not None:
        bandwidth, source = float(bandwidth_gbps), "given"
    elif nodes == 1:
        bandwidth = intra
        source = "given" if intra_node_gbps is not None else "default for one node: NVLink-class bus bandwidth"
        if devices > 8:
            split = f" (for nodes of 8: devices=8, nodes={devices // 8})" if devices % 8 == 0 else ""
            notes.append(
                f"{devices} devices on one node: the default bandwidth assumes they share one NVLink-class "
                f"domain; for a cluster give nodes, devices being per node{split}, or the bandwidth"
            )
    else:
        bandwidth = inter
        source = (
            "given"
            if inter_node_gbps is not None
            else "default for several nodes: one 200 Gb/s InfiniBand/RoCE link per GPU"
        )
    if world_size == 1:
        notes.append("one device: nothing is communicated and nothing is sharded")
    if accumulate_grad_batches > 1:
        notes.append(
            f"bytes are per optimizer step of {accumulate_grad_batches} micro-batches: stage 3 gathers its units "
            "in every micro-batch; stages 2 and 3 reduce-scatter every micro-batch, or once per step with "
            "accumulate='local' (the rows 'local accumulation'), which holds the full gradients meanwhile"
        )
    if activations is not None and not isinstance(activations, ActivationProfile):
        raise TypeError(
            f"activations must be an ActivationProfile (from profile_activations), got {type(activations).__name__}"
        )
    peak_activations = 0.0 if activations is None else float(activations.peak_bytes)
    check_quantization("quantize_weights", quantize_weights)
    check_quantization("quantize_grads", quantize_grads)
    setting = _Setting(
        d,
        world_size,
        prefetch,
        links,
        memory,
        accumulate_grad_batches,
        peak_activations,
        quantize_weights,
        quantize_grads,
    )
    rows = _rows(counts_for(shard), setting, shard, offload_optimizer, offload_params)
    if counts.gathered_numel(prefetch) is None:
        notes.append(
            "stage 3's gathered units are not counted: the largest unit is unknown for a bare parameter count "
            "(give largest_unit_params / --largest-unit, or a model)"
        )
    recommended = _recommend(_candidates(counts_for, setting), memory)
    text = _recommendation_text(rows, recommended, memory, world_size)
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
        shard_size=shard if shard != world_size else None,
        offload_params=offload_params,
        intra_node_gbps=intra,
        inter_node_gbps=inter,
        pcie_gbps=links.pcie,
        activations=activations,
    )


def _recommendation_text(
    rows: tuple[StrategyEstimate, ...], best: StrategyEstimate | None, memory: float | None, world_size: int
) -> str:
    if memory is None:
        return "give memory_per_device (--memory) for a recommendation"
    if best is not None:
        transfer = format_seconds(best.transfer_seconds)
        return (
            f"{best.describe(world_size)}: {format_bytes(best.device_peak)} per device of {format_bytes(memory)}, "
            f"the least transfer time ({transfer} per step, without overlap) of the options that fit, hybrid "
            "sharding included; offload only where nothing without it fits"
        )
    stage3 = next(r for r in rows if r.strategy == "zero3" and r.accumulate != "local")
    text = (
        f"nothing fits in {format_bytes(memory)} per device, not even stage 3 with its parameters and optimizer "
        f"offloaded (--offload-params; stage 3 as configured needs {format_bytes(stage3.device_peak)})"
    )
    room = memory - (stage3.gathered or 0.0) - stage3.activations
    if room > 0:
        needed = math.ceil(stage3.device.total * world_size / room)
        text += f"; stage 3 fits on about {needed} devices"
    elif stage3.activations:
        text += (
            "; the gathered units and the activations alone do not fit: make the units smaller (unit_modules), "
            "the micro-batch smaller, or checkpoint activations (activation_checkpointing_policy)"
        )
    else:
        text += "; the gathered units alone do not fit: make the units smaller (unit_modules)"
    return text
