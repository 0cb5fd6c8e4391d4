"""The names under which the strategies are registered with Lightning's ``StrategyRegistry``."""

from __future__ import annotations

import inspect
from typing import Any

from lightning.fabric.strategies import _StrategyRegistry


def register_presets(registry: _StrategyRegistry, cls: type, name: str, description: str) -> None:
    """``name`` and its variants, as Lightning registers ``ddp``, ``ddp_spawn``, ``ddp_fork``, ... (the Trainer's
    registry and Fabric's alike; a variant whose option ``cls`` does not take is left out)."""
    presets: dict[str, tuple[str, dict[str, Any]]] = {
        name: ("", {}),
        f"{name}_spawn": (", processes started with 'spawn'", {"start_method": "spawn"}),
        f"{name}_fork": (", processes forked (notebooks)", {"start_method": "fork"}),
        f"{name}_full_checkpoint": (", one DDP-shaped checkpoint file (the default)", {"checkpoint_format": "full"}),
        f"{name}_sharded_checkpoint": (", sharded checkpoint directories", {"checkpoint_format": "sharded"}),
        f"{name}_stats": (", communication and memory logged every step", {"log_stats": True}),
    }
    options = inspect.signature(cls.__init__).parameters
    for preset, (extra, init_params) in presets.items():
        if preset not in registry and all(option in options for option in init_params):
            registry.register(preset, cls, description=description + extra, **init_params)
