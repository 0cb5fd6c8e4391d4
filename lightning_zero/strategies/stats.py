"""``log_stats=True``: per-step communication and memory figures, through the Trainer's loggers."""

from __future__ import annotations

from typing import Any

import torch

from lightning_zero.engine.comm.stats import CommStats
from lightning_zero.engine.sharded_model import ShardedModel


class StepStats:
    """Logs, after each optimizer step, what it cost: this rank's bytes and seconds per collective, the slowest
    rank's seconds, this rank's model-state bytes. The engine's counters keep running: the step's figures are the
    difference from the previous call, so other readers of the counters see totals.

    Example::

        stats = StepStats()
        stats.start(strategy.sharded_model)  # once the model is sharded
        # after each optimizer step, on every rank:
        stats.log(trainer, strategy.sharded_model, strategy.root_device, skipped_steps=0)
    """

    def __init__(self) -> None:
        self.logged_until: dict[str, CommStats] = {}

    def start(self, sharded: ShardedModel) -> None:
        """Time the model's collectives on the device from now on (CUDA events, only while statistics are logged:
        see [Note: device timing] in ``engine/comm/timing.py``)."""
        for comm in sharded.comms().values():
            comm.stats.time_on_device()

    def log(self, trainer: Any, sharded: ShardedModel, device: torch.device, skipped_steps: int) -> None:
        _log_step_stats(self, trainer, sharded, device, skipped_steps)


def _log_step_stats(
    stats_state: StepStats, trainer: Any, sharded: ShardedModel, device: torch.device, skipped_steps: int
) -> None:
    # Under hybrid sharding the bytes inside and across shard groups are counted apart (see [Note: hybrid sharding]
    # in engine/comm/mesh.py): "zero/shard_group/..." and "zero/replicate_group/..." beside the world's "zero/...".
    previous = stats_state.logged_until
    now = {name: comm.stats.snapshot() for name, comm in sharded.comms().items()}
    by_group = {name: stats.since(previous[name]) if name in previous else stats for name, stats in now.items()}
    stats_state.logged_until = now
    total = sum(s.seconds for stats in by_group.values() for s in stats.by_kind.values())
    seconds = torch.tensor([total], device=device)
    sharded.comm.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX)  # the slowest rank bounds the step
    metrics = {
        "zero/comm_bytes": float(sum(stats.bytes_sent for stats in by_group.values())),
        "zero/comm_seconds_max": seconds.item(),
    }
    for name, stats in by_group.items():
        prefix = "zero/" if name == "world" else f"zero/{name}_group/"
        if name != "world":
            metrics[f"{prefix}bytes"] = float(stats.bytes_sent)
        for kind, entry in stats.by_kind.items():
            metrics[f"{prefix}{kind}_bytes"] = float(entry.bytes_sent)
            metrics[f"{prefix}{kind}_seconds"] = entry.seconds
            metrics[f"{prefix}{kind}_calls"] = float(entry.calls)
    metrics.update({f"zero/memory_{k}_bytes": float(v) for k, v in sharded.memory_stats().items()})
    metrics["zero/skipped_steps"] = float(skipped_steps)
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
