"""Resident memory at the end of a run: what each rank holds after its last step, the peak of its teardown, and
what it holds once ``fit`` has returned (see "After fit returns" in docs/checkpoints.md).

    python -m benchmarks.teardown_memory --width 2048 --depth 111 --out benchmarks/results/teardown.json

The model is ``depth`` blocks of two ``Linear(width, width)`` built in ``configure_model`` (so under stage 3 it is
created already sharded), fp32 Adam, two optimizer steps on batches of one row. The peak of the teardown is read
from ``VmHWM`` after resetting it at ``on_train_end`` (``/proc/self/clear_refs``): Linux only.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

import lightning_zero  # noqa: F401 (registers the strategies)
from benchmarks.results import report_json
from benchmarks.trainer_mode import BARE_TRAINER
from lightning_zero.tools.processes import run_on_cpu_ranks

MIB = 2**20


def _resident() -> dict[str, float]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024, "peak_mib": int(fields["VmHWM"].split()[0]) / 1024}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.f = nn.Linear(width, width)
        self.g = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.g(torch.relu(self.f(x)))


class Stack(L.LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.width, self.depth = width, depth

    def configure_model(self) -> None:
        self.blocks = nn.Sequential(*[Block(self.width) for _ in range(self.depth)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.blocks(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())

    def train_dataloader(self) -> Any:
        data = torch.utils.data.TensorDataset(torch.randn(8, self.width))
        return torch.utils.data.DataLoader(data, batch_size=1)


class _AtTrainEnd(L.Callback):
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.reading = _resident()
        Path("/proc/self/clear_refs").write_text("5")  # the peak from here on is the teardown's


def _measure(rank: int, world_size: int, strategy: str, width: int, depth: int) -> dict[str, Any]:
    probe = _AtTrainEnd()
    trainer = L.Trainer(strategy=strategy, devices=world_size, max_steps=2, callbacks=[probe], **BARE_TRAINER)
    trainer.fit(Stack(width, depth))
    after = _resident()
    return {
        "train_end_rss_mib": probe.reading["rss_mib"],
        "teardown_peak_mib": after["peak_mib"],
        "after_fit_rss_mib": after["rss_mib"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=111)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    ranks = run_on_cpu_ranks(
        _measure, args.ranks, timeout=3600, strategy=args.strategy, width=args.width, depth=args.depth
    )
    params = args.depth * 2 * (args.width * args.width + args.width)
    result = {"strategy": args.strategy, "parameters": params, "ranks": ranks}
    report_json(result, args.out)


if __name__ == "__main__":
    main()
