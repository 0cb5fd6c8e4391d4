"""``log_stats=True``: per-step communication and memory figures, through the Trainer's loggers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_zero.strategies.base import ZeROStrategy


def log_step_stats(strategy: ZeROStrategy) -> None:
    """Log what the last optimizer step cost (this rank's bytes and seconds per collective, the slowest
    rank's seconds, this rank's model-state bytes). The engine's counters keep running: the step's
    figures are the difference from the previous call, so other readers of the counters see totals."""
    module = strategy.lightning_module
    assert module is not None
    trainer = module.trainer
    sharded = strategy.sharded_model
    now = sharded.comm.stats.snapshot()
    stats = now.since(strategy._stats_logged_until) if strategy._stats_logged_until is not None else now
    strategy._stats_logged_until = now
    seconds = torch.tensor([sum(s.seconds for s in stats.by_kind.values())], device=strategy.root_device)
    sharded.comm.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)  # the slowest rank bounds the step
    metrics = {"zero/comm_bytes": float(stats.bytes_sent), "zero/comm_seconds_max": seconds.item()}
    for kind, entry in stats.by_kind.items():
        metrics[f"zero/{kind}_bytes"] = float(entry.bytes_sent)
        metrics[f"zero/{kind}_seconds"] = entry.seconds
        metrics[f"zero/{kind}_calls"] = float(entry.calls)
    metrics.update({f"zero/memory_{k}_bytes": float(v) for k, v in sharded.memory_stats().items()})
    metrics["zero/skipped_steps"] = float(strategy.skipped_steps)
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
