"""Quantized collectives: ``quantize_weights="int8"`` and ``quantize_grads="int8"`` against the exact run.

The 25.3M-parameter benchmark GPT through a real ``Trainer`` on 2 CPU ranks over gloo, block units
(``unit_modules=[Block]``), fp32 AdamW, the same random token batches for every system. For each system: the
all-gather and reduce-scatter bytes this rank sent per optimizer step (the engine's counters), the median wall time
of a step, the time spent quantizing and dequantizing per step (the codec's own functions, timed), and every step's
loss, so the drift from the exact run of the same stage shows step by step. Systems run one after another in the
same processes; a repeat rotates their order.

Usage::

    python -m benchmarks.quantized                               # 12 steps (the issue's proof), 1 repeat
    python -m benchmarks.quantized --steps 100 --systems zero3-exact,zero3-both --out results/quantized-100.json
    python -m benchmarks.quantized --config tiny --steps 2       # a smoke test

Prints a markdown table and the drift at a few steps, and writes JSON (default
``benchmarks/results/<timestamp>-quantized.json``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from benchmarks.accumulation import GPT
from benchmarks.model import CONFIGS, Block
from benchmarks.results import chosen_systems, quiet_rank, write_results
from benchmarks.trainer_mode import BARE_TRAINER

SYSTEMS = ("ddp", "zero3-exact", "zero3-weights", "zero3-grads", "zero3-both", "zero2-exact", "zero2-grads")
_OPTIONS = {
    "exact": {},
    "weights": {"quantize_weights": "int8"},
    "grads": {"quantize_grads": "int8"},
    "both": {"quantize_weights": "int8", "quantize_grads": "int8"},
}


class Codec:
    """Seconds spent in the codec's ``quantize`` and ``dequantize`` (patched in for the run)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> Codec:
        from lightning_zero.engine.comm import quantized

        self._module = quantized
        self._saved = quantized.quantize, quantized.dequantize
        quantized.quantize, quantized.dequantize = self._timed(quantized.quantize), self._timed(quantized.dequantize)
        return self

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    def __exit__(self, *_: Any) -> None:
        self._module.quantize, self._module.dequantize = self._saved


class Meter(L.Callback):
    def __init__(self, warmup: int, codec: Codec) -> None:
        self.warmup, self.codec = warmup, codec
        self.times: list[float] = []
        self.codec_seconds: list[float] = []
        self.losses: list[float] = []
        self.sent: dict[str, list[int]] = {"all_gather": [], "reduce_scatter": []}
        self._last, self._codec = 0.0, 0.0
        self._bytes = {"all_gather": 0, "reduce_scatter": 0}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, index: int) -> None:
        self.losses.append(float(outputs["loss"]))
        now = time.perf_counter()
        sharded = getattr(trainer.strategy, "sharded_model", None)
        for kind in self.sent:
            total = sharded.comm.stats.by_kind[kind].bytes_sent if sharded is not None else 0
            if trainer.global_step > self.warmup:
                self.sent[kind].append(total - self._bytes[kind])
            self._bytes[kind] = total
        if trainer.global_step > self.warmup:
            self.times.append(now - self._last)
            self.codec_seconds.append(self.codec.seconds - self._codec)
        self._last, self._codec = now, self.codec.seconds


def _strategy(system: str) -> Any:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_zero import ZeRO2Strategy, ZeRO3Strategy

    if system == "ddp":
        return DDPStrategy()
    stage, mode = system.split("-")
    if stage == "zero2":
        return ZeRO2Strategy(**_OPTIONS[mode])
    return ZeRO3Strategy(unit_modules=[Block], **_OPTIONS[mode])


def _run(rank: int, world_size: int, config: str, systems: list[str], steps: int, repeats: int) -> Any:
    quiet_rank()
    warmup = 1
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for repeat in range(repeats):
        for system in systems[repeat % len(systems) :] + systems[: repeat % len(systems)]:
            total = warmup + steps
            dist.barrier()
            with Codec() as codec:
                meter = Meter(warmup, codec)
                L.Trainer(
                    devices=world_size, strategy=_strategy(system), max_steps=total, callbacks=[meter], **BARE_TRAINER
                ).fit(GPT(CONFIGS[config], total))
            median = torch.tensor(statistics.median(meter.times))
            dist.all_reduce(median, op=dist.ReduceOp.MAX)  # the slower rank's
            results[system].append(
                {
                    "step_seconds": float(median),
                    "codec_seconds_per_step": statistics.median(meter.codec_seconds),
                    "all_gather_bytes_per_step": statistics.median(meter.sent["all_gather"]),
                    "reduce_scatter_bytes_per_step": statistics.median(meter.sent["reduce_scatter"]),
                    "losses": meter.losses,
                }
            )
    return results


def _exact_of(system: str) -> str:
    return "ddp" if system == "ddp" else f"{system.split('-')[0]}-exact"


def main(argv: list[str] | None = None) -> int:
    from lightning_zero.tools.processes import run_on_cpu_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="default", help="model size (tiny: smoke tests)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps measured per system (default: 12)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--out", help="JSON file (default benchmarks/results/<timestamp>-quantized.json)")
    args = parser.parse_args(argv)
    systems = chosen_systems(parser, args.systems, SYSTEMS)
    results = run_on_cpu_ranks(
        _run, 2, timeout=7200, config=args.config, systems=systems, steps=args.steps, repeats=args.repeats
    )[0]
    ddp = statistics.median(r["step_seconds"] for r in results["ddp"]) if "ddp" in results else None
    print(
        "| system | all-gather MB/step | / exact | reduce-scatter MB/step | / exact | step (ms) | / DDP | "
        "codec (ms/step) | final loss | / exact - 1 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    summary: dict[str, dict[str, float]] = {}
    for system, rows in results.items():
        exact = results.get(_exact_of(system), rows)[-1]
        row = rows[-1]
        seconds = statistics.median(r["step_seconds"] for r in rows)
        ratios = {}
        for kind in ("all_gather", "reduce_scatter"):
            key = f"{kind}_bytes_per_step"
            ratios[kind] = row[key] / exact[key] if exact[key] else float("nan")
        drift = row["losses"][-1] / exact["losses"][-1] - 1
        summary[system] = {"all_gather_ratio": ratios["all_gather"], "reduce_scatter_ratio": ratios["reduce_scatter"]}
        summary[system]["final_loss_drift"] = drift
        print(
            f"| {system} | {row['all_gather_bytes_per_step'] / 1e6:.1f} | {ratios['all_gather']:.3f} | "
            f"{row['reduce_scatter_bytes_per_step'] / 1e6:.1f} | {ratios['reduce_scatter']:.3f} | "
            f"{seconds * 1e3:.0f} | {f'{seconds / ddp:.2f}' if ddp else '-'} | "
            f"{row['codec_seconds_per_step'] * 1e3:.1f} | {row['losses'][-1]:.5f} | {drift:+.2e} |"
        )
    marks = sorted({m for m in (1, 10, 25, 50, 100, args.steps) if m <= args.steps + 1})
    print("\nloss, relative to the exact run of the same stage, at step:", ", ".join(map(str, marks)))
    for system, rows in results.items():
        exact = results.get(_exact_of(system), rows)[-1]["losses"]
        losses = rows[-1]["losses"]
        cells = [f"{losses[m - 1] / exact[m - 1] - 1:+.2e}" for m in marks if m - 1 < len(losses)]
        print(f"| {system} | " + " | ".join(cells) + " |")
    write_results("quantized", vars(args), {"runs": results, "summary": summary}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
