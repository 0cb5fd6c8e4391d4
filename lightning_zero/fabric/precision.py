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
"""

from __future__ import annotations

import torch
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

from lightning_zero.driver.config import PRECISIONS, NonFinitePolicy
from lightning_zero.engine.core.scaler import ShardedGradScaler
from lightning_zero.engine.errors import NonFiniteGradientError
from lightning_zero.engine.sharded_model import ShardedModel


def check_precision(plugin: Precision, param_dtype: torch.dtype | None) -> torch.dtype | None:
    """Refuse the plugins the strategies do not support and a ``param_dtype`` without mixed precision; return the
    dtype parameters are computed in (``None``: the module's own)."""
    if type(plugin) not in (Precision, MixedPrecision, HalfPrecision):
        raise ValueError(
            f"the ZeRO strategies support precision in {PRECISIONS}; got the plugin {type(plugin).__name__} "
            f"(precision={getattr(plugin, 'precision', '?')!r}). Pass one of those to Fabric(precision=...)."
        )
    if not isinstance(plugin, MixedPrecision):
        if param_dtype is not None:
            raise ValueError(
                f"param_dtype={param_dtype} applies to mixed precision (Fabric(precision='bf16-mixed' or "
                f"'16-mixed')); with precision={plugin.precision!r} parameters keep the module's dtype. Remove "
                "param_dtype or choose a mixed precision."
            )
        return None
    return param_dtype or (torch.bfloat16 if plugin.precision == "bf16-mixed" else torch.float16)


def shard_scaler(plugin: Precision, sharded: ShardedModel, device_type: str) -> None:
    """``"16-mixed"``: replace the plugin's ``GradScaler`` by a ``ShardedGradScaler`` with its settings."""
    if not isinstance(plugin, MixedPrecision) or plugin.scaler is None:
        return
    scaler = ShardedGradScaler.like(plugin.scaler, device_type)
    scaler.all_reduce = sharded.comm.all_reduce
    scaler.comm_device = sharded.units[0].device
    plugin.scaler = scaler


def skip_nonfinite_step(sharded: ShardedModel, optimizer: Optimizer, policy: NonFinitePolicy, skipped: int) -> bool:
    """Before a step: whether any rank's gradients hold ``inf``/``NaN`` (one all-reduce, the same answer on every
    rank). Then ``"raise"`` raises ``NonFiniteGradientError`` and ``"skip"`` drops the gradients (the step changes
    nothing) and returns ``True``; ``skipped`` is the count so far, for the warning."""
    ranks, local = sharded.nonfinite_grads(optimizer)
    if not ranks:
        return False
    where = f"rank(s) {ranks}" + (f" (here: {', '.join(local[:5])})" if local else "")
    if policy == "raise":
        raise NonFiniteGradientError(
            f"non-finite gradients (inf or NaN) on {where}; the step was not applied. Lower the learning rate, "
            "clip gradients (fabric.clip_gradients), check the data, or pass nonfinite_grads='skip' to skip such "
            "steps on all ranks."
        )
    sharded.drop_grads(optimizer)
    rank_zero_warn(f"skipped an optimizer step: non-finite gradients on {where} ({skipped + 1} so far)")
    return True
