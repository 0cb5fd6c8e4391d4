"""Records and the table: one rank's measurements, one JSON line per system per repeat, a summary.

``RankResult`` is what one rank measured for one system in one repeat; rank 0 merges every rank's
into a record (``merge_ranks``), one JSON line. ``summarize`` folds the records of all repeats into
one row per system, compared with DDP and with the ZeRO theory (``lightning_zero.engine.core.memory``);
``markdown_table`` prints the rows.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_zero.engine.core.memory import theory_bytes, theory_comm_bytes

MB = 2**20


@dataclass
class RankResult:
    """What one rank measured for one system in one repeat (``status`` is the same on every rank)."""

    status: str = "ok"  # "ok", "skipped" (cannot run here) or "failed" (raised while running)
    reason: str = ""
    step_times: list[float] = field(default_factory=list)  # seconds, timed steps only
    losses: list[float] = field(default_factory=list)  # every step, warm-up included
    comm_bytes: int = 0  # sent during the timed steps
    comm_by_kind: dict[str, dict[str, float]] = field(default_factory=dict)  # per timed step
    state_bytes: dict[str, int] = field(default_factory=dict)
    rss_baseline: int = 0  # RSS before the system was built (earlier systems' memory freed)
    peak_rss: int = 0  # high-water mark from when the system was built to its last step
    peak_rss_reset: bool = True  # False: peak_rss is the process's lifetime peak
    restored_globals: list[str] = field(default_factory=list)  # torch attributes the system left replaced

    def set_comm(self, before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], steps: int) -> None:
        """Collectives between two ``{kind: (calls, bytes)}`` readings, over ``steps`` steps."""
        self.comm_by_kind = {}
        for kind, (calls, sent) in after.items():
            calls0, sent0 = before.get(kind, (0, 0))
            if calls > calls0:
                self.comm_by_kind[kind] = {"calls": (calls - calls0) / steps, "bytes": (sent - sent0) / steps}
        self.comm_bytes = sum(sent - before.get(kind, (0, 0))[1] for kind, (_, sent) in after.items())


def merge_ranks(
    results: list[RankResult], *, system: str, label: str, theory_stage: int | None, repeat: int, meta: dict[str, Any]
) -> dict[str, Any]:
    """One JSON-able record of every rank's ``results`` for one system and repeat."""
    first = results[0]
    status = "failed" if any(r.status == "failed" for r in results) else first.status
    reason = next((r.reason for r in results if r.status == status and r.reason), "")
    record: dict[str, Any] = {
        "kind": "run",
        "system": system,
        "label": label,
        "repeat": repeat,
        "status": status,
        "reason": reason,
        "theory_stage": theory_stage,
        "restored_globals": sorted({name for r in results for name in r.restored_globals}),
        **meta,
    }
    if status != "ok":
        return record
    steps = meta["steps"]
    # A step takes as long as its slowest rank.
    record["step_times"] = [max(r.step_times[i] for r in results) for i in range(steps)]
    record["step_time_median"] = statistics.median(record["step_times"])
    record["losses"] = [r.losses for r in results]
    record["comm_bytes_per_step"] = [r.comm_bytes / steps for r in results]
    record["comm_by_kind_per_step"] = [r.comm_by_kind for r in results]
    record["state_bytes"] = [r.state_bytes for r in results]
    record["rss_baseline_bytes"] = [r.rss_baseline for r in results]
    record["peak_rss_bytes"] = [r.peak_rss for r in results]
    record["peak_rss_growth_bytes"] = [r.peak_rss - r.rss_baseline for r in results]
    record["peak_rss_reset"] = all(r.peak_rss_reset for r in results)
    return record


def _max_loss_diff(record: dict[str, Any], reference: dict[str, Any] | None) -> float | None:
    if reference is None or reference.get("status") != "ok":
        return None
    return max(
        abs(a - b) for mine, ref in zip(record["losses"], reference["losses"]) for a, b in zip(mine, ref, strict=True)
    )


def summarize(records: list[dict[str, Any]], reference: str = "ddp") -> list[dict[str, Any]]:
    """One row per system (in first-seen order) over all repeats, compared with ``reference``."""
    by_system: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        if record.get("kind") == "run":
            by_system.setdefault(record["system"], []).append(record)
    ref_by_repeat = {r["repeat"]: r for r in by_system.get(reference, [])}
    ref_runs = [r for r in by_system.get(reference, []) if r["status"] == "ok"]
    ref_time = min((r["step_time_median"] for r in ref_runs), default=None)
    rows = []
    for system, runs in by_system.items():
        ok = [r for r in runs if r["status"] == "ok"]
        first = runs[0]
        row: dict[str, Any] = {
            "system": system,
            "label": first["label"],
            "theory_stage": first["theory_stage"],
            "repeats": len(ok),
            "status": "ok" if ok else runs[-1]["status"],
            "reason": "" if ok else runs[-1]["reason"],
        }
        if ok:
            numel, world_size = first["numel"], first["world_size"]
            stage = first["theory_stage"]
            # On a shared machine a repeat can be slowed by other work: the best repeat's median is the
            # estimate least disturbed by it (the pooled median and every repeat's are kept too).
            time = min(r["step_time_median"] for r in ok)
            state = max(s["total"] for s in ok[-1]["state_bytes"])
            comm = statistics.median(statistics.fmean(r["comm_bytes_per_step"]) for r in ok)
            diffs = [d for d in (_max_loss_diff(r, ref_by_repeat.get(r["repeat"])) for r in ok) if d is not None]
            theory_state = theory_bytes(stage, numel, world_size).total
            theory_comm = theory_comm_bytes(stage, numel, world_size)
            row.update(
                step_time_s=time,
                step_time_per_repeat=[r["step_time_median"] for r in ok],
                step_time_pooled_median_s=_median_time(ok),
                step_time_vs_ddp=time / ref_time if ref_time else None,
                tokens_per_s=first["tokens_per_step"] / time,
                max_loss_diff_vs_ddp=max(diffs) if diffs else None,
                final_loss=statistics.fmean(losses[-1] for losses in ok[-1]["losses"]),
                state_bytes=state,
                state_breakdown=max(ok[-1]["state_bytes"], key=lambda s: s["total"]),
                theory_state_bytes=theory_state,
                state_vs_theory=state / theory_state,
                peak_rss_bytes=statistics.median(max(r["peak_rss_bytes"]) for r in ok),
                peak_rss_growth_bytes=statistics.median(max(r["peak_rss_growth_bytes"]) for r in ok),
                rss_baseline_bytes=statistics.median(max(r["rss_baseline_bytes"]) for r in ok),
                peak_rss_reset=all(r["peak_rss_reset"] for r in ok),
                comm_bytes_per_step=comm,
                comm_by_kind_per_step=ok[-1]["comm_by_kind_per_step"][0],
                theory_comm_bytes=theory_comm,
                comm_vs_theory=comm / theory_comm if theory_comm else None,
            )
        rows.append(row)
    return rows


def _median_time(runs: list[dict[str, Any]]) -> float | None:
    times = [t for r in runs if r["status"] == "ok" for t in r["step_times"]]
    return statistics.median(times) if times else None


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    header = (
        "| system | step time (s, best repeat) | vs DDP | tokens/s | max \\|Δloss\\| vs DDP | model state (MB/rank) "
        "| vs theory | peak RSS (MB/rank) | above baseline | sent (MB/rank/step) | vs theory |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [header]
    for row in rows:
        name = f"`{row['system']}` {row['label']}"
        if row["status"] != "ok":
            lines.append(f"| {name} | {row['status']}: {row['reason'][:160]} |" + " |" * 10)
            continue
        lines.append(
            "| "
            + " | ".join(
                [
                    name,
                    _fmt(row["step_time_s"], ".3f"),
                    _fmt(row["step_time_vs_ddp"], ".2f", "x"),
                    _fmt(row["tokens_per_s"], ",.0f"),
                    _fmt(row["max_loss_diff_vs_ddp"], ".1e"),
                    _fmt(row["state_bytes"] / MB, ".1f"),
                    _fmt(row["state_vs_theory"], ".2f"),
                    _fmt(row["peak_rss_bytes"] / MB, ",.0f"),
                    _fmt(row["peak_rss_growth_bytes"] / MB, ",.0f"),
                    _fmt(row["comm_bytes_per_step"] / MB, ".1f"),
                    _fmt(row["comm_vs_theory"], ".2f"),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def jsonl_writer(path: str) -> Callable[[dict], None]:
    """Append each record to ``path`` as one JSON line, and say on stdout what was measured."""

    def emit(record: dict) -> None:
        with Path(path).open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        what = (
            f"{record['step_time_median']:.3f} s/step, final loss {record['losses'][0][-1]:.4f}"
            if record["status"] == "ok"
            else f"{record['status']}: {record['reason']}"
        )
        print(f"[repeat {record['repeat'] + 1}] {record['system']}: {what}", flush=True)

    return emit


def report_json(result: dict[str, Any], out: Path | None) -> None:
    """Print ``result`` as JSON and, with ``out``, write it there too (the small benchmarks' one output)."""
    text = json.dumps(result, indent=2)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    print(text)


def write_results(name: str, options: dict[str, Any], results: Any, out: str | None) -> Path:
    """``{"options": ..., "results": ...}`` as JSON to ``out``, or to ``benchmarks/results/<timestamp>-<name>.json``;
    the path is printed and returned."""
    import time

    path = (
        Path(out)
        if out
        else Path(__file__).resolve().parent / "results" / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"options": options, "results": results}, indent=2))
    print(f"written: {path}")
    return path


def quiet_rank() -> None:
    """What every benchmark rank does first: no warnings, Lightning's and ours at WARNING, one thread per process
    (two ranks share the two cores)."""
    import logging
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_zero"):
        logging.getLogger(name).setLevel(logging.WARNING)
    torch.set_num_threads(1)


def chosen_systems(parser: Any, text: str, known: tuple[str, ...]) -> list[str]:
    """The comma-separated ``--systems`` of a benchmark, each one of ``known`` (else ``parser.error``)."""
    systems = text.split(",")
    unknown = [s for s in systems if s not in known]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {known}")
    return systems
