"""Gradient accumulation: ``accumulate="sharded"`` against ``"local"`` under stages 2 and 3, DDP beside them.

The 25.3M-parameter benchmark GPT through a real ``Trainer`` on 2 CPU ranks over gloo, ``accumulate_grad_batches=4``
(``--accumulate``), fp32 AdamW, the same random token batches for every system. For each system: the reduce-scatter
bytes this rank sent per optimizer step (the engine's counters), the median wall time of an optimizer step (four
micro-batches, from one step's last ``on_train_batch_end`` to the next), and the first and last losses (which must
agree with DDP's). Systems run one after another in the same processes, the order rotated per repeat.

Usage::

    python -m benchmarks.accumulation                          # 6 timed optimizer steps, 2 repeats
    python -m benchmarks.accumulation --steps 4 --repeats 1 --out results/accumulation.json
    python -m benchmarks.accumulation --config tiny --steps 1 --repeats 1      # a smoke test

Prints a markdown table and writes JSON (default ``benchmarks/results/<timestamp>-accumulation.json``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from benchmarks.model import CONFIGS, BenchConfig, BenchGPT
from benchmarks.results import chosen_systems, quiet_rank, write_results
from benchmarks.trainer_mode import BARE_TRAINER

SYSTEMS = ("ddp", "zero2-sharded", "zero2-local", "zero3-sharded", "zero3-local")


class Tokens(Dataset):
    """``length`` batches of random token ids, the same for every system (seeded by index and rank)."""

    def __init__(self, config: BenchConfig, length: int, rank: int) -> None:
        self.config, self.length, self.rank = config, length, rank

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(1000 * index + self.rank)
        shape = (self.config.batch_size, self.config.block_size)
        tokens = torch.randint(self.config.vocab_size, shape, generator=generator)
        return tokens, torch.roll(tokens, -1, dims=1)


class GPT(L.LightningModule):
    def __init__(self, config: BenchConfig, length: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = BenchGPT(config)
        self.config, self.length = config, length

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(*batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Tokens(self.config, self.length, self.global_rank), batch_size=None)


class Meter(L.Callback):
    def __init__(self, accumulate: int, warmup: int) -> None:
        self.accumulate, self.warmup = accumulate, warmup
        self.times: list[float] = []
        self.losses: list[float] = []
        self.reduce_scatter: list[int] = []
        self._last = 0.0
        self._bytes = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, index: int) -> None:
        self.losses.append(float(outputs["loss"]))
        if (index + 1) % self.accumulate:
            return
        now = time.perf_counter()
        sharded = getattr(trainer.strategy, "sharded_model", None)
        sent = sharded.comm.stats.by_kind["reduce_scatter"].bytes_sent if sharded is not None else 0
        if trainer.global_step > self.warmup:
            self.times.append(now - self._last)
            self.reduce_scatter.append(sent - self._bytes)
        self._last, self._bytes = now, sent


def _strategy(system: str) -> Any:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ZeRO2Strategy, ZeRO3Strategy

    if system == "ddp":
        return DDPStrategy()
    stage, mode = system.split("-")
    return (ZeRO2Strategy if stage == "zero2" else ZeRO3Strategy)(accumulate=mode)


def _run(rank: int, world_size: int, config: str, systems: list[str], steps: int, repeats: int, accumulate: int) -> Any:
    quiet_rank()
    warmup = 1
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for repeat in range(repeats):
        for system in systems[repeat % len(systems) :] + systems[: repeat % len(systems)]:
            meter = Meter(accumulate, warmup)
            total = warmup + steps + 1
            dist.barrier()
            L.Trainer(
                devices=world_size,
                strategy=_strategy(system),
                max_steps=total,
                accumulate_grad_batches=accumulate,
                callbacks=[meter],
                **BARE_TRAINER,
            ).fit(GPT(CONFIGS[config], total * accumulate))
            median = torch.tensor(statistics.median(meter.times))
            dist.all_reduce(median, op=dist.ReduceOp.MAX)  # the slower rank's
            results[system].append(
                {
                    "step_seconds": float(median),
                    "reduce_scatter_bytes_per_step": statistics.median(meter.reduce_scatter),
                    "first_loss": meter.losses[0],
                    "last_loss": meter.losses[-1],
                }
            )
    return results


def main(argv: list[str] | None = None) -> int:
    from lightning_zero.tools.processes import run_on_cpu_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="default", help="model size (tiny: smoke tests)")
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per system per repeat")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=4, help="accumulate_grad_batches (default: 4)")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--out", help="JSON file (default benchmarks/results/<timestamp>-accumulation.json)")
    args = parser.parse_args(argv)
    systems = chosen_systems(parser, args.systems, SYSTEMS)
    results = run_on_cpu_ranks(
        _run,
        2,
        timeout=3600,
        config=args.config,
        systems=systems,
        steps=args.steps,
        repeats=args.repeats,
        accumulate=args.accumulate,
    )[0]
    ddp = statistics.median(r["step_seconds"] for r in results["ddp"]) if "ddp" in results else None
    print("| system | reduce-scatter MB per step | step (ms), median | / DDP | first loss | last loss |")
    print("|---|---:|---:|---:|---:|---:|")
    for system, rows in results.items():
        seconds = statistics.median(r["step_seconds"] for r in rows)
        sent = rows[-1]["reduce_scatter_bytes_per_step"] / 1e6
        ratio = f"{seconds / ddp:.2f}" if ddp else "-"
        print(
            f"| {system} | {sent:.1f} | {seconds * 1e3:.0f} | {ratio} | {rows[-1]['first_loss']:.6f} | "
            f"{rows[-1]['last_loss']:.6f} |"
        )
    write_results("accumulation", vars(args), results, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
