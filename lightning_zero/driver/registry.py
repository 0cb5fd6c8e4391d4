"""The names under which the strategies are registered with Lightning's ``StrategyRegistry``."""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies import _StrategyRegistry

from lightning_zero.driver.options import option_names

STAGES = {
    1: ("zero1", "ZeRO stage 1: optimizer states sharded"),
    2: ("zero2", "ZeRO stage 2: optimizer states and gradients sharded"),
    3: ("zero3", "ZeRO stage 3: optimizer states, gradients and parameters sharded"),
}


def register_presets(registry: _StrategyRegistry, cls: Any) -> None:
    """``zero<stage>`` and its variants for ``cls`` (a stage's class), as Lightning registers ``ddp``, ``ddp_spawn``,
    ``ddp_fork``, ... (the Trainer's registry and Fabric's alike; a variant whose option ``cls`` does not take is
    left out)."""
    name, description = STAGES[cls.stage]
    presets: dict[str, tuple[str, dict[str, Any]]] = {
        name: ("", {}),
        f"{name}_spawn": (", processes started with 'spawn'", {"start_method": "spawn"}),
        f"{name}_fork": (", processes forked (notebooks)", {"start_method": "fork"}),
        f"{name}_full_checkpoint": (", one DDP-shaped checkpoint file (the default)", {"checkpoint_format": "full"}),
        f"{name}_sharded_checkpoint": (", sharded checkpoint directories", {"checkpoint_format": "sharded"}),
        f"{name}_stats": (", communication and memory logged every step", {"log_stats": True}),
    }
    options = option_names(cls)
    for preset, (extra, init_params) in presets.items():
        if preset not in registry and all(option in options for option in init_params):
            registry.register(preset, cls, description=description + extra, **init_params)
