"""Fabric's precision plugins under the ZeRO strategies.

Fabric's own plugins are kept (``Precision`` for ``"32-true"``, ``MixedPrecision`` for ``"bf16-mixed"`` /
``"16-mixed"``, ``HalfPrecision`` for ``"bf16-true"`` / ``"16-true"``), with what sharding changes:

- mixed precision gathers and computes in the half type by default (``param_dtype``), over fp32 master
  shards, as the Trainer's ``ZeROPrecision`` does; ``param_dtype=torch.float32`` is Fabric's own
  autocast over fp32 parameters;
- ``"16-mixed"``'s ``GradScaler`` becomes a ``ShardedGradScaler``, so one overflow decision covers every
  rank's shard;
- without a scaler, a non-finite gradient on any rank raises, or skips the step, on every rank together
  (``nonfinite_grads``).

What these mean is shared with the Trainer's door (see [Note: one precision, two plugins] in
``driver/precision.py``); this module translates Fabric's plugins into it.
"""

from __future__ import annotations

import torch
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer

from lightning_zero.driver.config import NonFinitePolicy
from lightning_zero.driver.precision import (
    DoorWords,
    connect_scaler,
    nonfinite_grads_at,
    param_dtype_for,
    refuse_plugin,
    sharded_scaler,
    skip_nonfinite_step,
)
from lightning_zero.engine.sharded_model import ShardedModel

FABRIC_WORDS = DoorWords("Fabric", clip="fabric.clip_gradients")


def check_precision(plugin: Precision, param_dtype: torch.dtype | None) -> torch.dtype | None:
    """Refuse the plugins the strategies do not support and a ``param_dtype`` without mixed precision; return the
    dtype parameters are computed in (``None``: the module's own)."""
    if type(plugin) not in (Precision, MixedPrecision, HalfPrecision):
        refuse_plugin(plugin, FABRIC_WORDS)
    return param_dtype_for(plugin.precision, param_dtype, FABRIC_WORDS)


def has_scaler(plugin: Precision) -> bool:
    """Whether ``plugin`` scales the loss (``"16-mixed"``): then its scaler, not ``nonfinite_grads``, decides."""
    return getattr(plugin, "scaler", None) is not None


def shard_scaler(plugin: Precision, sharded: ShardedModel, device_type: str) -> None:
    """``"16-mixed"``: replace the plugin's ``GradScaler`` by a ``ShardedGradScaler`` with its settings, connected
    to ``sharded``'s ranks."""
    if not isinstance(plugin, MixedPrecision) or plugin.scaler is None:
        return
    scaler = sharded_scaler(plugin.scaler, device_type)
    connect_scaler(scaler, sharded)
    plugin.scaler = scaler


def skip_nonfinite(sharded: ShardedModel, optimizer: Optimizer, policy: NonFinitePolicy, skipped: int) -> bool:
    """Before a step: whether any rank's gradients hold ``inf``/``NaN`` (one all-reduce, the same answer on every
    rank). Then ``"raise"`` raises ``NonFiniteGradientError`` and ``"skip"`` drops the gradients (the step changes
    nothing) and returns ``True``; ``skipped`` is the count so far, for the warning."""
    where = nonfinite_grads_at(sharded, optimizer)
    if where is None:
        return False
    skip_nonfinite_step(sharded, optimizer, where, policy, skipped, FABRIC_WORDS)
    return True
