"""Draw docs/img/benchmark_cpu.png from a benchmark run: step time and model state per rank, against DDP.

Run from the repository root (needs matplotlib), on the JSON lines ``python -m benchmarks.run`` wrote::

    python docs/scripts/plot_benchmark.py benchmarks/results/engine-final.jsonl

The last line of the file (the summary) is read: per system, the step time relative to DDP and the
model-state bytes per rank relative to DDP's, as the markdown table next to it reports them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

OUT = Path(__file__).resolve().parents[1] / "img" / "benchmark_cpu.png"


def main(results: str) -> None:
    summary = json.loads(Path(results).read_text().strip().splitlines()[-1])
    rows = [r for r in summary["rows"] if r["status"] == "ok"]
    ddp = next(r for r in rows if r["system"] == "ddp")
    names = [r["system"] for r in rows]
    time_ratio = [r["step_time_vs_ddp"] for r in rows]
    state_ratio = [r["state_bytes"] / ddp["state_bytes"] for r in rows]
    colors = ["tab:green" if r["system"].startswith("zero") else "tab:grey" for r in rows]

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=120, sharey=True)
    positions = range(len(rows))
    left.barh(positions, time_ratio, color=colors)
    left.axvline(1.0, color="black", linewidth=1)
    left.set_xlabel("step time / DDP's (lower is faster)")
    right.barh(positions, state_ratio, color=colors)
    right.axvline(1.0, color="black", linewidth=1)
    right.set_xlabel("model state per rank / DDP's")
    left.set_yticks(list(positions), names)
    left.invert_yaxis()
    for axis, values in ((left, time_ratio), (right, state_ratio)):
        for y, value in zip(positions, values):
            axis.text(value, y, f" {value:.2f}", va="center", fontsize=8)
        axis.grid(axis="x", alpha=0.3)
    params = summary.get("options", {}).get("config", "default")
    fig.suptitle(f"2 CPU processes over gloo, GPT ({params} config), fp32 AdamW; green: lightning_zero", fontsize=10)
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/engine-final.jsonl")
