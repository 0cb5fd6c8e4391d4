"""``strategy.memory_report()``: the estimator's prediction for the real model, next to what a rank holds."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_zero.driver.config import ZeROConfig
from lightning_zero.engine.sharded_model import ShardedModel
from lightning_zero.planning.estimate import estimate_memory
from lightning_zero.planning.estimate_report import MemoryEstimate, StrategyEstimate, format_bytes

# Optimizer state entries per parameter element (each in the master dtype), for the usual classes.
_STATES_PER_ELEMENT = {
    "Adam": 2,
    "AdamW": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adamax": 2,
    "Adagrad": 1,
    "Adadelta": 2,
    "Rprop": 2,
}


@dataclass(frozen=True)
class MemoryReport:
    """What ``estimate_memory`` predicts for this model and run, and what this rank holds now.

    ``measured`` is ``ShardedModel.memory_stats()``: parameters (compute copy on the device), master
    shards, gathered parameters, sharded gradients, optimizer states and host parameters
    (``offload_params``), in bytes. Optimizer states exist only after the first optimizer step.

    Example::

        report = trainer.strategy.memory_report()
        print(report)                      # the predicted table, then measured against predicted
        report.row.device.optimizer_states, report.measured["optimizer_states"]
    """

    estimate: MemoryEstimate
    row: StrategyEstimate
    measured: dict[str, int]
    rank: int

    def comparison(self) -> str:
        """One line per kind of state: measured on this rank against predicted."""
        where = self.row.cpu if self.estimate.offload_optimizer else self.row.device
        pairs = [
            ("parameters", self.measured["params"], self.row.device.params),
            ("master shards", self.measured["master_params"], where.master),
            ("sharded gradients", self.measured["grads"], where.grads if self.row.stage != 1 else None),
            ("optimizer states", self.measured["optimizer_states"], where.optimizer_states),
        ]
        if self.estimate.offload_params:  # the compute shards are on the host (the master itself in fp32)
            pairs.insert(1, ("host parameters", self.measured.get("host_params", 0), self.row.cpu.params))
        lines = [f"rank {self.rank} now, measured vs predicted ({self.row.label}):"]
        for name, measured, predicted in pairs:
            expected = "-" if predicted is None else format_bytes(predicted)
            lines.append(f"  {name:<18} {format_bytes(measured):>10}   predicted {expected}")
        if self.row.stage == 1:
            lines.append("  (stage 1 holds full gradients during backward, sharded ones after the reduction)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.estimate.table() + "\n\n" + self.comparison()


def memory_report(
    module: Module,
    sharded: ShardedModel,
    config: ZeROConfig,
    precision: str,
    mixed: bool,
    optimizers: list[Optimizer],
    num_processes: int,
    num_nodes: int,
    rank: int,
) -> MemoryReport:
    """The estimate for ``module`` under ``config`` at this topology, beside what ``sharded`` holds on ``rank``."""
    unit = sharded.units[0]
    # Under hybrid sharding states are divided by the shard group's size, not the world's (engine/comm/mesh.py).
    hybrid = sharded.replicate_comm is not None
    estimate = estimate_memory(
        module,
        devices=sharded.shard_size if hybrid else num_processes,
        nodes=1 if hybrid else num_nodes,
        precision=precision,
        offload_optimizer=config.offload_optimizer,
        offload_params=sharded.policy.offload.params,
        optimizer_state_bytes=_optimizer_state_bytes(optimizers, unit.master_dtype),
        reduce_dtype_bytes=unit.reduce_dtype.itemsize,
        param_dtype_bytes=unit.dtype.itemsize if mixed else None,
        unit_modules=None if config.unit_modules is None else list(config.unit_modules),
    )
    return MemoryReport(estimate, estimate.row(f"zero{sharded.stage}"), sharded.memory_stats(), rank)


def _optimizer_state_bytes(optimizers: list[Optimizer], master_dtype: torch.dtype) -> float | None:
    """Bytes of state per parameter for the run's optimizer (``None``: unknown, the estimator assumes Adam)."""
    if len(optimizers) != 1:
        return None
    optimizer = optimizers[0]
    name = type(optimizer).__name__
    defaults = optimizer.defaults
    if name == "SGD":
        states = 1 if defaults.get("momentum", 0) else 0
    elif name == "RMSprop":
        states = 1 + bool(defaults.get("momentum", 0)) + bool(defaults.get("centered", False))
    elif name in _STATES_PER_ELEMENT:
        states = _STATES_PER_ELEMENT[name] + (1 if defaults.get("amsgrad", False) else 0)
    else:
        return None
    return states * master_dtype.itemsize
