"""How ``estimate_memory``'s results read as text: byte and time formats, and the table with its notes."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_zero.estimate import MemoryEstimate


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
    header = ["strategy", "params", "grads", "master", "optimizer states", "gathered", "device total"]
    header += ["CPU total"] if offload else []
    header += ["sent per step"] + (["of which across nodes"] if levels else []) + ["comm time"]
    header += ["host copies"] if offload else []
    header += ["fits"] if est.memory_per_device is not None else []
    lines = []
    for r in est.rows:
        gathered = "-" if r.stage != 3 else "not counted" if r.gathered is None else format_bytes(r.gathered)
        cells = [r.label] + [_cell(a, b) for a, b in zip(r.device, r.cpu)] + [gathered, format_bytes(r.device_peak)]
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
    )
    table = [fmt(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(fmt(cells) for cells in lines)]
    paragraphs = [
        "Per rank: model states (no activations, no allocator or framework overhead); the device total adds "
        "stage 3's gathered units to the persistent bytes.",
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
