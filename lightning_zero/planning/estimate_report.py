"""What ``estimate_memory`` returns (``MemoryEstimate``, one ``StrategyEstimate`` per strategy) and how it reads as
text: byte and time formats, and the table with its notes."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from lightning_zero.planning.activations import ActivationProfile

#: Default bus bandwidth (GB/s) within one node: NVLink class, below the 230-250 GB/s all-reduce bus
#: bandwidth nccl-tests reports for 8 x A100 SXM4 (H100 SXM reaches about 450).
INTRA_NODE_GBPS = 200.0
#: Default bus bandwidth (GB/s) across nodes: one 200 Gb/s InfiniBand (HDR) or RoCE link per GPU.
INTER_NODE_GBPS = 25.0
#: Default host-device bandwidth (GB/s) per device: PCIe Gen4 x16 in practice (Gen5 reaches about 50).
PCIE_GBPS = 25.0


def format_bytes(value: float) -> str:
    """Decimal units, 4 significant digits: ``format_bytes(38.5e9) == "38.5 GB"``."""
    for unit, name in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(value) >= unit:
            return f"{value / unit:.4g} {name}"
    return f"{value:.4g} B"


def format_seconds(value: float) -> str:
    if value == 0:
        return "0"
    for unit, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if value >= unit:
            return f"{value / unit:.3g} {name}"
    return f"{value / 1e-9:.3g} ns"


def _format_count(value: int) -> str:
    for unit, name in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "k")):
        if value >= unit:
            return f"{value / unit:.4g}{name}"
    return str(value)


def _cell(device: float, cpu: float) -> str:
    if cpu == 0:
        return format_bytes(device) if device else "-"
    return f"{format_bytes(cpu)} CPU" if device == 0 else f"{format_bytes(device)} + {format_bytes(cpu)} CPU"


def render(est: MemoryEstimate) -> str:
    """The table, assumptions and recommendation of ``est`` (what ``MemoryEstimate.table()`` returns)."""
    d = est.dtypes
    offload = est.offload_optimizer or est.offload_params
    levels = est.nodes > 1
    profiled = est.activations is not None
    header = ["strategy", "params", "grads", "master", "optimizer states", "gathered"]
    header += ["activations"] if profiled else []
    header += ["device total"]
    header += ["CPU total"] if offload else []
    header += ["sent per step"] + (["of which across nodes"] if levels else []) + ["comm time"]
    header += ["host copies"] if offload else []
    header += ["fits"] if est.memory_per_device is not None else []
    lines = []
    for r in est.rows:
        gathered = "-" if r.stage != 3 else "not counted" if r.gathered is None else format_bytes(r.gathered)
        cells = [r.label] + [_cell(a, b) for a, b in zip(r.device, r.cpu)] + [gathered]
        cells += [format_bytes(r.activations)] if profiled else []
        cells += [format_bytes(r.device_peak)]
        cells += [format_bytes(r.cpu.total) if r.cpu.total else "-"] if offload else []
        cells += [format_bytes(r.comm_bytes)] + ([format_bytes(r.inter_node_bytes)] if levels else [])
        cells += [format_seconds(r.comm_seconds)]
        if offload:
            cells += [f"{format_bytes(r.host_bytes)}, {format_seconds(r.host_seconds)}" if r.host_bytes else "-"]
        cells += ["yes" if r.fits else "no"] if est.memory_per_device is not None else []
        lines.append(cells)
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]

    def fmt(cells: list[str]) -> str:
        return (
            "| "
            + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
            + " |"
        )

    trainable = "" if est.trainable_numel == est.numel else f", {est.trainable_numel:,} trainable"
    units = "" if est.units is None else f", {est.units} units"
    master = f"separate {d.master}-byte master" if d.separate_master else "they are the master"
    head = (
        f"{_format_count(est.numel)} parameters ({est.numel:,}{trainable}{units}) on {est.world_size} "
        f"device{'s' if est.world_size > 1 else ''} ({est.nodes} node{'s' if est.nodes > 1 else ''} x {est.devices}), "
        f"precision {d.precision}"
        + (f", ZeRO states sharded over groups of {est.shard_size} (hybrid)" if est.shard_size else "")
        + (", optimizer offloaded to CPU" if est.offload_optimizer else "")
        + (", stage 3's parameters offloaded to CPU" if est.offload_params else "")
        + (", stage 3's gathers in int8" if any(r.quantize_weights for r in est.rows) else "")
        + (", reduce-scatters of stages 2 and 3 in int8" if any(r.quantize_grads for r in est.rows) else "")
    )
    table = [fmt(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(fmt(cells) for cells in lines)]
    if est.activations is None:
        first = (
            "Per rank: model states (no activations, no allocator or framework overhead); the device total adds "
            "stage 3's gathered units to the persistent bytes."
        )
    else:
        a = est.activations
        recompute = (
            f" plus one recomputation of {format_bytes(a.recompute_bytes)} ({a.checkpointed_modules} modules "
            f"checkpointed; {format_bytes(a.saved_bytes)} without)"
            if a.checkpointed_modules
            else ""
        )
        first = (
            "Per rank: model states and one micro-batch's activations (no allocator or framework overhead); the "
            "device total adds stage 3's gathered units and the activations to the persistent bytes. Activations "
            f"(measured by profile_activations, what autograd saves for backward): {format_bytes(a.held_bytes)} "
            f"held until backward{recompute}, the same in every row."
        )
    paragraphs = [
        first,
        f"Bytes per element: compute params {d.compute} ({master}), sharded grads {d.master}, optimizer states "
        f"{d.optimizer_states:g} per param, reduce-scatter {d.reduce}; DDP params and grads {d.ddp}.",
        (
            f"Communication: bytes sent per rank per step (ring, x (n-1)/n in each group); time at "
            f"{est.intra_node_gbps:g} GB/s for collectives inside a node and {est.inter_node_gbps:g} GB/s for those "
            f"spanning nodes ({est.bandwidth_source}; --intra-node-bandwidth / --inter-node-bandwidth / --bandwidth), "
            "without overlap."
            if levels
            else f"Communication: bytes sent per rank per step (ring, x (N-1)/N); time at {est.bandwidth_gbps:g} GB/s "
            f"({est.bandwidth_source}; override with bandwidth_gbps / --bandwidth), without overlap."
        ),
    ]
    if offload:
        paragraphs.append(
            "Offload: DDP keeps everything on the device; in the ZeRO rows, cells marked CPU are host memory, and "
            f"host copies are the bytes moved between device and CPU memory per step, at {est.pcie_gbps:g} GB/s "
            "(--pcie-bandwidth); the optimizer step on the CPU is not timed."
        )
    paragraphs += [f"Note: {note}." for note in est.notes]
    paragraphs.append(f"Recommendation: {est.recommendation}.")
    text = [textwrap.fill(p, 100, subsequent_indent="  ") for p in paragraphs]
    out = [head, "", *table, "", *text]
    return "\n".join(out)


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
    cpu: StateBytes  # persistent, in CPU memory (offload_optimizer, offload_params)
    gathered: float | None  # stage 3's transient gathered units (None: not known, 0: no such buffers)
    comm_bytes: float  # sent per rank per optimizer step (intra_node_bytes + inter_node_bytes)
    comm_seconds: float  # network time per step: each level's bytes at its bandwidth
    fits: bool | None  # device_peak <= memory_per_device (None: no memory_per_device given)
    intra_node_bytes: float = 0.0  # of comm_bytes: in collectives whose group stays inside one node
    inter_node_bytes: float = 0.0  # of comm_bytes: in collectives whose group spans nodes
    host_bytes: float = 0.0  # copied between the device and CPU memory per step (offload)
    host_seconds: float = 0.0  # those copies at the host-device bandwidth
    shard_size: int | None = None  # ranks per shard group (None: DDP, nothing sharded)
    offload_optimizer: bool = False
    offload_params: bool = False
    accumulate: str | None = None  # stages 2 and 3 under gradient accumulation: "sharded" or "local"
    activations: float = 0.0  # one micro-batch's, at their peak (the same in every row; 0: not profiled)
    quantize_weights: str | None = None  # stage 3: its gathers for compute are quantized
    quantize_grads: str | None = None  # stages 2 and 3: their reduce-scatters are quantized

    @property
    def stage(self) -> int | None:
        return None if self.strategy == "ddp" else int(self.strategy[-1])

    @property
    def label(self) -> str:
        if self.stage is None:
            return "DDP"
        return f"stage {self.stage}" + (", local accumulation" if self.accumulate == "local" else "")

    @property
    def transfer_seconds(self) -> float:
        """Network and host-device time per step, without overlap (what the recommendation minimises)."""
        return self.comm_seconds + self.host_seconds

    def options(self, world_size: int) -> dict[str, Any]:
        """The strategy's arguments this row assumes beyond the defaults (``ZeRO3Strategy(**options)``)."""
        options: dict[str, Any] = {}
        if self.shard_size is not None and self.shard_size != world_size:
            options["shard_size"] = self.shard_size
        if self.offload_optimizer:
            options["offload_optimizer"] = True
        if self.offload_params:
            options["offload_params"] = True
        if self.accumulate == "local":
            options["accumulate"] = "local"
        if self.quantize_weights:
            options["quantize_weights"] = self.quantize_weights
        if self.quantize_grads:
            options["quantize_grads"] = self.quantize_grads
        return options

    def describe(self, world_size: int) -> str:
        """``stage 3 (ZeRO3Strategy(shard_size=8, offload_optimizer=True))`` or ``DDP (strategy='ddp')``."""
        if self.stage is None:
            return "DDP (strategy='ddp')"
        options = ", ".join(f"{k}={v!r}" for k, v in self.options(world_size).items())
        return (
            f"{self.label} (ZeRO{self.stage}Strategy({options}))"
            if options
            else (f"{self.label} (strategy={self.strategy!r})")
        )

    @property
    def device_peak(self) -> float:
        """Persistent device bytes plus stage 3's gathered units (where known) and the activations (where
        profiled)."""
        return self.device.total + (self.gathered or 0.0) + self.activations


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
    shard_size: int | None = None  # ranks per shard group of the ZeRO rows (None: all)
    offload_params: bool = False
    intra_node_gbps: float = INTRA_NODE_GBPS
    inter_node_gbps: float = INTER_NODE_GBPS
    pcie_gbps: float = PCIE_GBPS
    activations: ActivationProfile | None = None  # one micro-batch's, per unit (estimate_memory(activations=...))

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
            "shard_size": self.shard_size,
            "bandwidth_gbps": self.bandwidth_gbps,
            "bandwidth_source": self.bandwidth_source,
            "intra_node_gbps": self.intra_node_gbps,
            "inter_node_gbps": self.inter_node_gbps,
            "pcie_gbps": self.pcie_gbps,
            "memory_per_device": self.memory_per_device,
            "rows": [
                {
                    "strategy": r.strategy,
                    "stage": r.stage,
                    "accumulate": r.accumulate,
                    "device": {**r.device._asdict(), "total": r.device.total},
                    "cpu": {**r.cpu._asdict(), "total": r.cpu.total},
                    "gathered": r.gathered,
                    "activations": r.activations,
                    "device_peak": r.device_peak,
                    "comm_bytes": r.comm_bytes,
                    "intra_node_bytes": r.intra_node_bytes,
                    "inter_node_bytes": r.inter_node_bytes,
                    "comm_seconds": r.comm_seconds,
                    "host_bytes": r.host_bytes,
                    "host_seconds": r.host_seconds,
                    "fits": r.fits,
                }
                for r in self.rows
            ],
            "recommended": None if self.recommended is None else self.recommended.strategy,
            "recommended_options": None if self.recommended is None else self.recommended.options(self.world_size),
            "recommendation": self.recommendation,
            "notes": list(self.notes),
            "activations": None if self.activations is None else self.activations.as_dict(),
        }
