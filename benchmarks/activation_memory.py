"""Peak memory in a training step with and without activation checkpointing, on the benchmark GPT, at 2 ranks.

One rank of a 2-rank job of each stage, with the real engine (``lightning_zero.tools.dry_run``: the collectives are
simulated, every tensor a step allocates is counted, as a real 2-rank run of the same model counts it: see
``tests/test_dry_run.py``), once without and once with ``activation_checkpointing_policy={Block}``. Also counts
each block's forward calls in the measured step (the recomputation runs each once more). Runs in one process, in
seconds; the numbers do not depend on the machine.

Usage::

    python -m benchmarks.activation_memory                     # the 25.3M benchmark GPT, batch 2 x 64 tokens
    python -m benchmarks.activation_memory --batch-shape 8,64 --out results/ac.json

Prints a markdown table (peak bytes in the step by category, the ratio with / without) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch

from benchmarks.model import DEFAULT, BenchGPT, Block


class BenchLightning(L.LightningModule):
    """The benchmark GPT as a ``LightningModule`` built with no arguments (what ``dry_run`` takes)."""

    def __init__(self) -> None:
        super().__init__()
        self.model: BenchGPT | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = BenchGPT(DEFAULT)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        return self.model(*batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def measure(stage: int, checkpointed: bool, batch_shape: tuple[int, int]) -> dict[str, Any]:
    """One dry run; the peak of its last step and the block forwards counted in it."""
    from lightning_zero.tools.dry_run import dry_run

    calls = {"forward": 0}

    def count(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if not args[0].is_meta:  # not the estimator's profile, which runs a copy on the meta device
            calls["forward"] += 1

    def build() -> BenchLightning:
        module = BenchLightning()
        module.configure_model()
        assert module.model is not None
        for block in module.model.blocks:
            block.register_forward_pre_hook(count)
        return module

    steps = 2
    report = dry_run(
        build,
        world_size=2,
        stage=stage,
        steps=steps,
        batch_shape=batch_shape,
        activation_checkpointing=[Block] if checkpointed else None,
    )
    return {
        "stage": stage,
        "activation_checkpointing": checkpointed,
        "peak_step_bytes": report.peak_step_bytes,
        "model_state_bytes": report.model_state_total,
        "estimated_peak_bytes": report.estimate["device_peak"],
        "estimated_activation_bytes": report.estimate["activations"],
        "block_forwards_per_step": calls["forward"] // steps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-shape", default=f"{DEFAULT.batch_size},{DEFAULT.block_size}", help="B,T tokens")
    parser.add_argument("--stages", default="1,2,3", help="comma-separated stages (default: 1,2,3)")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    b, t = (int(n) for n in args.batch_shape.split(","))
    rows = []
    for stage in (int(s) for s in args.stages.split(",")):
        for checkpointed in (False, True):
            rows.append(measure(stage, checkpointed, (b, t)))
    print(
        "| stage | checkpointing | step allocations (MB) | peak in step, all (MB) | estimator's peak (MB) | "
        "block forwards per step |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for row in rows:
        peak = row["peak_step_bytes"]
        print(
            f"| {row['stage']} | {'Block' if row['activation_checkpointing'] else 'none'} | "
            f"{peak['step_allocations'] / 1e6:.1f} | {peak['total'] / 1e6:.1f} | "
            f"{row['estimated_peak_bytes'] / 1e6:.1f} | {row['block_forwards_per_step']} |"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"batch_shape": [b, t], "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
