"""The three stages as Fabric strategies: thin subclasses that fix ``stage`` and register their names."""

from __future__ import annotations

from typing import ClassVar

from lightning.fabric.strategies import _StrategyRegistry
from typing_extensions import override

from lightning_zero.driver.registry import register_presets
from lightning_zero.fabric.strategy import ZeROFabricStrategy


class ZeRO1Strategy(ZeROFabricStrategy):
    """ZeRO stage 1 for ``lightning.fabric.Fabric``: optimizer states sharded (see ``lightning_zero.ZeRO1Strategy``).

    Example::

        from lightning.fabric import Fabric
        from lightning_zero.fabric import ZeRO1Strategy

        fabric = Fabric(strategy=ZeRO1Strategy(), accelerator="cpu", devices=2)    # or strategy="zero1"
        fabric.launch()
        model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    """

    stage: ClassVar[int] = 1

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_presets(strategy_registry, cls)


class ZeRO2Strategy(ZeROFabricStrategy):
    """ZeRO stage 2 for ``lightning.fabric.Fabric``: optimizer states and gradients sharded (see
    ``lightning_zero.ZeRO2Strategy``).

    Example::

        fabric = Fabric(strategy="zero2", accelerator="cpu", devices=2)
        fabric.launch()
        model, optimizer = fabric.setup(model, optimizer)
    """

    stage: ClassVar[int] = 2

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_presets(strategy_registry, cls)


class ZeRO3Strategy(ZeROFabricStrategy):
    """ZeRO stage 3 for ``lightning.fabric.Fabric``: optimizer states, gradients and parameters sharded (see
    ``lightning_zero.ZeRO3Strategy``). ``fabric.init_module()`` builds the model on the meta device and
    ``fabric.setup`` creates it already sharded.

    Example::

        fabric = Fabric(strategy=ZeRO3Strategy(unit_modules=["Block"]), accelerator="cpu", devices=2)
        fabric.launch()
        with fabric.init_module():
            model = GPT(config)                          # no memory yet
        model = fabric.setup_module(model)               # created one unit at a time, sharded
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    """

    stage: ClassVar[int] = 3

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_presets(strategy_registry, cls)
