"""ZeRO stage 3: optimizer states, gradients and parameters sharded."""

from __future__ import annotations

from typing import ClassVar

from lightning.fabric.strategies import _StrategyRegistry
from typing_extensions import override

from lightning_zero.driver.registry import register_presets
from lightning_zero.strategies.base import ZeROStrategy


class ZeRO3Strategy(ZeROStrategy):
    """ZeRO stage 3: optimizer states, gradients and parameters sharded.

    Parameters live as 1/N shards. Each unit (see ``unit_modules``) is all-gathered just before
    its forward and freed right after; in backward it is gathered again, its gradients are
    reduce-scattered, and it is freed. Parameters the ``LightningModule`` uses directly (its own
    ``nn.Parameter``s, weights tied across submodules) form the root unit, gathered for the
    whole step. Evaluation and prediction gather the same way under ``no_grad``. Memory per rank
    with Adam in fp32: ``16Ψ/N`` bytes plus the gathered units; communication ``3Ψ`` per step.
    ``offload_params=True`` (this stage only) keeps the shards in CPU memory as well, with the optimizer
    (``offload_optimizer`` is implied): the device then holds only the units being gathered.

    Example::

        import lightning as L
        from lightning_zero import ZeRO3Strategy

        trainer = L.Trainer(strategy=ZeRO3Strategy(unit_modules=["Block"]), accelerator="cpu", devices=2)
        trainer.fit(model)                                    # or strategy="zero3"

        ZeRO3Strategy(offload_params=True)                    # parameters and optimizer in CPU memory

    See ``ZeROStrategy`` for the arguments.
    """

    stage: ClassVar[int] = 3

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_presets(strategy_registry, cls)
