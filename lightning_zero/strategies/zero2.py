"""ZeRO stage 2: optimizer states and gradients sharded."""

from __future__ import annotations

from typing import ClassVar

from lightning.fabric.strategies import _StrategyRegistry
from typing_extensions import override

from lightning_zero.driver.registry import register_presets
from lightning_zero.strategies.base import ZeROStrategy


class ZeRO2Strategy(ZeROStrategy):
    """ZeRO stage 2: optimizer states and gradients sharded.

    As stage 1, but each unit's gradients are reduce-scattered from a gradient hook as soon as
    they are complete during backward, and the full gradients are freed at once; accumulation
    adds into the sharded gradient. Memory per rank with Adam in fp32: ``4Ψ + 12Ψ/N`` bytes;
    communication ``2Ψ`` per step (a reduce-scatter of ``Ψ`` per micro-batch when accumulating,
    one all-gather of ``Ψ`` per optimizer step).

    Example::

        import lightning as L
        from lightning_zero import ZeRO2Strategy

        trainer = L.Trainer(strategy=ZeRO2Strategy(), accelerator="cpu", devices=2)  # or strategy="zero2"
        trainer.fit(model)

    See ``ZeROStrategy`` for the arguments.
    """

    stage: ClassVar[int] = 2

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_presets(strategy_registry, cls)
