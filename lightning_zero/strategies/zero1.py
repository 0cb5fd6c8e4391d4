"""ZeRO stage 1: optimizer states sharded."""

from __future__ import annotations

from typing import ClassVar

from lightning.fabric.strategies import _StrategyRegistry
from typing_extensions import override

from lightning_zero.driver.registry import register_presets
from lightning_zero.strategies.base import ZeROStrategy


class ZeRO1Strategy(ZeROStrategy):
    """ZeRO stage 1: each rank keeps the optimizer states of its 1/N shard of the parameters.

    Forward and backward run on full parameters. When backward ends, gradients are
    reduce-scattered (each rank receives the average of its shard only), the user's optimizer
    steps that shard, and the updated shards are all-gathered. With gradient accumulation the
    reduction waits for the last micro-batch. Memory per rank with Adam in fp32:
    ``8Ψ + 8Ψ/N`` bytes instead of DDP's ``16Ψ``; communication ``2Ψ`` per step, as DDP.

    Example::

        import lightning as L
        from lightning_zero import ZeRO1Strategy

        trainer = L.Trainer(strategy=ZeRO1Strategy(), accelerator="cpu", devices=2)  # or strategy="zero1"
        trainer.fit(model)

    See ``ZeROStrategy`` for the arguments.
    """

    stage: ClassVar[int] = 1

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_presets(strategy_registry, cls)
