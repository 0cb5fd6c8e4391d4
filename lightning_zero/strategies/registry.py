"""The names under which the strategies are registered with Lightning's ``StrategyRegistry``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.fabric.strategies import _StrategyRegistry

if TYPE_CHECKING:
    from lightning_zero.strategies.base import ZeROStrategy


def register_presets(registry: _StrategyRegistry, cls: type[ZeROStrategy], name: str, description: str) -> None:
    """``name`` and its variants, as Lightning registers ``ddp``, ``ddp_spawn``, ``ddp_fork``, ..."""
    presets: dict[str, tuple[str, dict[str, Any]]] = {
        name: ("", {}),
        f"{name}_spawn": (", processes started with 'spawn'", {"start_method": "spawn"}),
        f"{name}_fork": (", processes forked (notebooks)", {"start_method": "fork"}),
        f"{name}_full_checkpoint": (", one DDP-shaped checkpoint file (the default)", {"checkpoint_format": "full"}),
        f"{name}_sharded_checkpoint": (", sharded checkpoint directories", {"checkpoint_format": "sharded"}),
        f"{name}_stats": (", communication and memory logged every step", {"log_stats": True}),
    }
    for preset, (extra, init_params) in presets.items():
        if preset not in registry:
            registry.register(preset, cls, description=description + extra, **init_params)
