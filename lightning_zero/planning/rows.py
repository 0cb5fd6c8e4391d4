"""The per-strategy arithmetic of the estimate: one ``StrategyEstimate`` row for DDP and for each ZeRO stage from the
``Counts`` of a layout, and the configurations the recommendation weighs (see the table in ``estimate.py``).

Example::

    rows = strategy_rows(counts, setting, shard_size=8, offload=False, offload_params=False)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from lightning_zero.planning.counts import Counts
from lightning_zero.planning.estimate_report import Dtypes, StateBytes, StrategyEstimate


def dtypes_for(
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


class Links(NamedTuple):
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


def ddp_row(counts: Counts, setting: Setting) -> StrategyEstimate:
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


class Setting(NamedTuple):
    """What every row of one estimate shares."""

    d: Dtypes
    world_size: int
    prefetch: int
    links: Links
    memory: float | None
    micro_batches: int = 1  # accumulate_grad_batches: the micro-batches of one optimizer step
    activations: float = 0.0  # one micro-batch's activations at their peak (0: not profiled)
    quantize_weights: str | None = None  # stage 3's gathers for compute (see comm/quantized.py)
    quantize_grads: str | None = None  # stages 2 and 3's reduce-scatters


def zero_row(
    stage: int,
    counts: Counts,
    setting: Setting,
    shard_size: int,
    offload: bool,
    offload_params: bool,
    accumulate: str = "sharded",
) -> StrategyEstimate:
    """One ZeRO row; ``counts`` laid out over ``shard_size`` ranks (see [Note: hybrid sharding] in
    ``engine/comm/mesh.py`` and docs/multinode.md). Bytes are per optimizer step, over its ``micro_batches``:
    stage 3 gathers every unit twice per micro-batch but the root unit and the unit that ends the forward (see
    [Note: gathers per micro-batch] in ``counts.py``), and stages 2 and 3 reduce-scatter every micro-batch unless
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
    # gathers per micro-batch] in counts.py; stages 1 and 2: the updated shards after the step). Across the groups: one
    # all-reduce of each gradient shard.
    reductions = 1 if local else micro_batches
    # Quantized rows carry 1 byte per element and a 4-byte scale per block, and the blocks across parameters exactly
    # (see [Note: quantized collectives] in engine/comm/quantized.py), inside the shard group only; the replicas'
    # all-reduce stays exact.
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


def strategy_rows(
    counts: Counts, setting: Setting, shard_size: int, offload: bool, offload_params: bool
) -> tuple[StrategyEstimate, ...]:
    ddp = ddp_row(counts, setting)
    zero = [zero_row(s, counts, setting, shard_size, offload, offload_params and s == 3) for s in (1, 2, 3)]
    if setting.micro_batches > 1:  # both accumulation modes of stages 2 and 3, after the defaults
        zero += [zero_row(s, counts, setting, shard_size, offload, offload_params and s == 3, "local") for s in (2, 3)]
    return (ddp, *zero)


def candidate_rows(counts_for: Callable[[int], Counts], setting: Setting) -> list[StrategyEstimate]:
    """Every configuration the recommendation weighs, in order of preference on a tie: DDP, then each stage
    sharded over all ranks, then over each node (several nodes only), each without offload, with the optimizer
    offloaded, and (stage 3) with the parameters offloaded too."""
    world_size, links = setting.world_size, setting.links
    sizes = [world_size] + ([links.devices] if links.nodes > 1 and world_size % links.devices == 0 else [])
    rows = [ddp_row(counts_for(world_size), setting)]
    for stage in (1, 2, 3):
        for size in sizes:
            for offload, offload_params in ((False, False), (True, False), (True, True)):
                if not offload_params or stage == 3:
                    counts = counts_for(size)
                    for accumulate in ("sharded", "local") if stage > 1 and setting.micro_batches > 1 else ("sharded",):
                        rows.append(zero_row(stage, counts, setting, size, offload, offload_params, accumulate))
    return rows


def recommend(candidates: list[StrategyEstimate], memory: float | None) -> StrategyEstimate | None:
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
