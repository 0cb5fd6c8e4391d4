"""What checking a checkpoint costs: save and load times of both formats through a real ``Trainer`` on CPU
ranks, with the checksums of [Note: record checksums] and [Note: shard checksums] and with them switched off.

    python -m benchmarks.checkpoint_cost --repeats 3 --out benchmarks/results/checkpoint-cost.json

Each repeat saves and loads every format once with checksums and once without (in alternating order); the JSON
holds every timing and the medians. Run it on an idle machine: the differences are tens of milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from benchmarks.results import report_json
from benchmarks.trainer_mode import BARE_TRAINER
from lightning_zero import ZeRO3Strategy
from lightning_zero.driver import checkpointing
from lightning_zero.engine.checkpoint import saving
from lightning_zero.engine.checkpoint import sharded as engine_checkpoint
from lightning_zero.engine.io import checksums
from lightning_zero.tools.processes import run_on_cpu_ranks


class Stack(L.LightningModule):
    """16 ``Linear(1024, 1024)`` layers and Adam: 16.8M parameters, a 193 MB checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layers(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> Any:
        data = torch.utils.data.TensorDataset(torch.randn(8, 1024))
        return torch.utils.data.DataLoader(data, batch_size=2)


@contextlib.contextmanager
def checks_off() -> Iterator[None]:
    """The save and load paths with no checksum made or checked (what the writer did before it stored them)."""
    saved = (
        checkpointing.check_file_together,
        engine_checkpoint._check_shards_together,
        saving.write_checksums,
        engine_checkpoint.entry_checksums,
        checksums.bad_records,
    )
    checkpointing.check_file_together = lambda *a, **k: None
    engine_checkpoint._check_shards_together = lambda *a, **k: None
    saving.write_checksums = lambda *a, **k: None
    engine_checkpoint.entry_checksums = lambda directory, entries: {}
    checksums.bad_records = lambda *a, **k: []
    try:
        yield
    finally:
        (
            checkpointing.check_file_together,
            engine_checkpoint._check_shards_together,
            saving.write_checksums,
            engine_checkpoint.entry_checksums,
            checksums.bad_records,
        ) = saved


class _Timer(L.Callback):
    """Saves and loads at the end of training, while the module is still sharded (as ModelCheckpoint saves)."""

    def __init__(self, fmt: str, repeats: int, root: str, times: dict[str, list[float]]) -> None:
        self.fmt, self.repeats, self.root, self.times = fmt, repeats, root, times

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        for repeat in range(self.repeats):
            for checked in (True, False) if repeat % 2 == 0 else (False, True):
                path = Path(self.root) / f"{self.fmt}-{checked}.ckpt"
                with contextlib.nullcontext() if checked else checks_off():
                    strategy.barrier()
                    start = time.perf_counter()
                    trainer.save_checkpoint(path)
                    strategy.barrier()
                    saved_at = time.perf_counter()
                    strategy.load_checkpoint(path)
                    strategy.barrier()
                    loaded_at = time.perf_counter()
                label = "checked" if checked else "unchecked"
                self.times.setdefault(f"{self.fmt} save {label}", []).append(saved_at - start)
                self.times.setdefault(f"{self.fmt} load {label}", []).append(loaded_at - saved_at)


def _measure(rank: int, world_size: int, repeats: int, root: str) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}
    for fmt in ("full", "sharded"):
        torch.manual_seed(0)
        L.Trainer(
            strategy=ZeRO3Strategy(checkpoint_format=fmt),
            devices=world_size,
            max_steps=1,
            callbacks=[_Timer(fmt, repeats, root, times)],
            **BARE_TRAINER,
        ).fit(Stack())
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_on_cpu_ranks(_measure, world_size=args.ranks, timeout=1200, repeats=args.repeats, root=root)
    times = per_rank[0]
    medians = {what: statistics.median(values) for what, values in times.items()}
    result = {"ranks": args.ranks, "repeats": args.repeats, "seconds": times, "median_seconds": medians}
    report_json(result, args.out)


if __name__ == "__main__":
    main()
