"""``DryRunReport``: what one rank of a dry run holds and sends, beside the theory and the estimator (see
[Note: dry run] in ``dry_run.py``).

Example::

    report = dry_run("examples/dry_run_gpt.py:GPT1B", world_size=8)
    write_json(report, "dry_run.json")
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from lightning_zero.driver.config import ZeROConfig
from lightning_zero.engine.core.memory import theory_bytes
from lightning_zero.engine.sharded_model import ShardedModel
from lightning_zero.planning.activations import ActivationProfile
from lightning_zero.planning.counts import WIRE_BYTES_PER_ELEMENT
from lightning_zero.planning.estimate import estimate_memory
from lightning_zero.planning.estimate_report import format_bytes

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


def build_report(
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
    """The report of the last of ``steps`` steps: the model state ``state`` at its end, the bytes sent between the
    ``before`` and ``after`` snapshots of each ``Comm``'s stats, the theory for the configuration, and the
    estimator's row for it (with ``activations`` where they were profiled)."""
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
