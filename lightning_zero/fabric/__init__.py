"""ZeRO stages 1, 2 and 3 for ``lightning.fabric.Fabric``, on the same engine as the Trainer strategies.

Example::

    from lightning.fabric import Fabric
    import lightning_zero  # registers "zero1", "zero2" and "zero3" with the Trainer and with Fabric

    fabric = Fabric(strategy="zero3", accelerator="cpu", devices=2)
    fabric.launch()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    loss = model(x).sum()
    fabric.backward(loss)
    optimizer.step()
    fabric.save("ckpt", {"model": model, "optimizer": optimizer, "step": 1})

See ``docs/fabric.md``.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning_zero.fabric.stages import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy
from lightning_zero.fabric.strategy import ShardedForward, ZeROFabricStrategy

__all__ = ["ShardedForward", "ZeRO1Strategy", "ZeRO2Strategy", "ZeRO3Strategy", "ZeROFabricStrategy"]

for _strategy in (ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy):
    _strategy.register_strategies(STRATEGY_REGISTRY)  # skips names already registered (a re-import)
