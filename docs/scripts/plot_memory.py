"""Draw docs/img/memory_per_stage.png: model-state memory per device for DDP and each ZeRO stage.

Run from the repository root (needs matplotlib): ``python docs/scripts/plot_memory.py``.
The numbers come from ``lightning_zero.engine.core.memory.theory_bytes`` (fp32 Adam: 4 + 4 + 8 bytes
per parameter), the same table the tests check measured storage sizes against.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from lightning_zero.engine.core.memory import theory_bytes

OUT = Path(__file__).resolve().parents[1] / "img" / "memory_per_stage.png"
PARAMS = 7_000_000_000
DEVICES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def main() -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for stage, label in ((None, "DDP"), (1, "ZeRO-1"), (2, "ZeRO-2"), (3, "ZeRO-3")):
        gb = [theory_bytes(stage, PARAMS, n).total / 1e9 for n in DEVICES]
        ax.plot(DEVICES, gb, marker="o", label=label)
    ax.axhline(80, color="grey", linestyle="--", linewidth=1)
    ax.text(128, 88, "80 GB device", color="grey", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices (N)")
    ax.set_ylabel("model state per device (GB)")
    ax.set_title("7B parameters, fp32 Adam: parameters + gradients + optimizer states")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
