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
from collections.abc import Sequence

from torch import nn

from lightning_zero.engine.comm.mesh import resolve_shard_size
from lightning_zero.engine.comm.quantized import check_quantization
from lightning_zero.planning.activations import ActivationProfile
from lightning_zero.planning.arguments import (
    ELEMENT_SIZES,
    MAX_WORLD_SIZE,
    PRECISION_ALIASES,
    PRECISIONS,
    ArgumentValueError,
    parse_argument,
    parse_bytes,
    parse_count,
)
from lightning_zero.planning.counts import Counts, count_model, count_numel, plan_model
from lightning_zero.planning.estimate_report import (
    INTER_NODE_GBPS,
    INTRA_NODE_GBPS,
    PCIE_GBPS,
    MemoryEstimate,
    StrategyEstimate,
    format_bytes,
    format_seconds,
)
from lightning_zero.planning.rows import Links, Setting, candidate_rows, dtypes_for, recommend, strategy_rows


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
    if isinstance(precision, int) or precision in PRECISION_ALIASES:
        precision = PRECISION_ALIASES.get(str(precision), str(precision))
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
        plan = plan_model(model_or_numel, unit_modules)
        units = len(plan)

        def counts_for(size: int) -> Counts:
            return count_model(plan, size)

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

        def counts_for(size: int) -> Counts:
            return count_numel(numel, size, largest)

        counts = counts_for(world_size)

    d = dtypes_for(precision, optimizer_state_bytes, reduce_dtype_bytes, param_dtype_bytes)
    intra = float(bandwidth_gbps or intra_node_gbps or INTRA_NODE_GBPS)
    inter = float(bandwidth_gbps or inter_node_gbps or INTER_NODE_GBPS)
    links = Links(intra, inter, float(pcie_gbps or PCIE_GBPS), devices, nodes)
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
    setting = Setting(
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
    rows = strategy_rows(counts_for(shard), setting, shard, offload_optimizer, offload_params)
    if counts.gathered_numel(prefetch) is None:
        notes.append(
            "stage 3's gathered units are not counted: the largest unit is unknown for a bare parameter count "
            "(give largest_unit_params / --largest-unit, or a model)"
        )
    recommended = recommend(candidate_rows(counts_for, setting), memory)
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
