"""Asynchronous saves: how long a save blocks the training loop, in the foreground and in the background.

A GPT through a real ``Trainer`` on 2 CPU ranks over gloo, ``ZeRO3Strategy``, fp32 AdamW, both checkpoint formats.
Each run trains ``--warmup`` steps, saves once with ``trainer.save_checkpoint`` from ``on_train_batch_end``, then
trains ``--after`` more steps and waits for the save (``strategy.finish_saves()``). For each system:

- ``blocked_s``: wall time of the ``save_checkpoint`` call (the slower rank's): what the training loop waits;
- ``committed_s``: from the call to the checkpoint being complete (for a synchronous save, ``blocked_s``);
- ``step_s_before`` / ``step_s_during``: median step time before the save and in the steps after it (the
  background write shares the two cores with training here);
- the checkpoint's size on disk.

Systems: ``sync`` and ``async`` (``async_save=True``) per format, alternated per repeat in the same processes.

Usage::

    python -m benchmarks.async_save                     # the "large" GPT (101M parameters), 2 repeats
    python -m benchmarks.async_save --config default --repeats 3 --out results/async-save.json
    python -m benchmarks.async_save --config tiny --repeats 1 --after 1     # a smoke test

Prints a markdown table and writes JSON (default ``benchmarks/results/<timestamp>-async-save.json``).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from benchmarks.accumulation import GPT
from benchmarks.model import CONFIGS
from benchmarks.results import quiet_rank, write_results
from benchmarks.trainer_mode import BARE_TRAINER

SIZES = {**CONFIGS, "large": replace(CONFIGS["default"], n_embd=1024, n_head=16)}
SYSTEMS = ("sync-full", "async-full", "sync-sharded", "async-sharded")


class SaveOnce(L.Callback):
    """Times the steps, one ``save_checkpoint`` after step ``at`` and, ``after`` steps later, the wait for it."""

    def __init__(self, path: Path, at: int, after: int) -> None:
        self.path, self.at, self.after = path, at, after
        self.steps: list[tuple[int, float]] = []
        self.blocked = self.committed = 0.0
        self._last = 0.0
        self._start = 0.0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        if self._last:
            self.steps.append((trainer.global_step, now - self._last))
        if trainer.global_step == self.at:
            dist.barrier()
            self._start = time.perf_counter()
            trainer.save_checkpoint(self.path)
            self.blocked = time.perf_counter() - self._start
        if trainer.global_step == self.at + self.after:
            trainer.strategy.finish_saves()
            self.committed = time.perf_counter() - self._start
        self._last = time.perf_counter()


def _slowest(value: float) -> float:
    tensor = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _run(rank: int, world_size: int, config: str, repeats: int, warmup: int, after: int, root: str) -> Any:
    from lightning_zero import ZeRO3Strategy

    quiet_rank()
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    for repeat in range(repeats):
        order = list(SYSTEMS) if repeat % 2 == 0 else list(reversed(SYSTEMS))
        for system in order:
            mode, checkpoint_format = system.split("-")
            path = Path(root, f"{system}.ckpt")
            meter = SaveOnce(path, at=warmup, after=after)
            total = warmup + after + 1
            dist.barrier()
            L.Trainer(
                devices=world_size,
                strategy=ZeRO3Strategy(checkpoint_format=checkpoint_format, async_save=mode == "async"),
                max_steps=total,
                callbacks=[meter],
                **BARE_TRAINER,
            ).fit(GPT(SIZES[config], total))
            before = [t for step, t in meter.steps if 1 < step <= warmup]
            during = [t for step, t in meter.steps if warmup + 1 < step <= warmup + after]
            results[system].append(
                {
                    "blocked_s": _slowest(meter.blocked),
                    "committed_s": _slowest(meter.committed),
                    "step_s_before": _slowest(statistics.median(before)) if before else None,
                    "step_s_during": _slowest(statistics.median(during)) if during else None,
                    "checkpoint_bytes": _size(path),
                }
            )
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    return results


def main(argv: list[str] | None = None) -> int:
    from lightning_zero.tools.processes import run_on_cpu_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(SIZES), default="large", help="model size (tiny: smoke tests)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3, help="steps before the save")
    parser.add_argument("--after", type=int, default=4, help="steps after the save, before waiting for it")
    parser.add_argument("--dir", help="where the checkpoints are written (default: a temporary directory)")
    parser.add_argument("--out", help="JSON file (default benchmarks/results/<timestamp>-async-save.json)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        results = run_on_cpu_ranks(
            _run,
            2,
            timeout=3600,
            config=args.config,
            repeats=args.repeats,
            warmup=args.warmup,
            after=args.after,
            root=root,
        )[0]
    print("| system | checkpoint MB | blocked (s) | / sync | committed (s) | step before (ms) | step during (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for system, rows in results.items():
        blocked = statistics.median(r["blocked_s"] for r in rows)
        sync = statistics.median(r["blocked_s"] for r in results[f"sync-{system.split('-')[1]}"])
        committed = statistics.median(r["committed_s"] if system.startswith("async") else r["blocked_s"] for r in rows)
        before = statistics.median(r["step_s_before"] for r in rows) * 1e3
        during = statistics.median(r["step_s_during"] for r in rows) * 1e3
        print(
            f"| {system} | {rows[0]['checkpoint_bytes'] / 1e6:.0f} | {blocked:.2f} | {blocked / sync:.2f} | "
            f"{committed:.2f} | {before:.0f} | {during:.0f} |"
        )
    write_results("async-save", vars(args), results, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
