"""The precision plugin our strategies use: Lightning's fp32 ``Precision`` made sharding-aware.

- Clipping by norm: Lightning clips with ``torch.nn.utils.clip_grad_norm_`` over the optimizer's
  parameters. Under ZeRO those are this rank's shards, whose local norm is not the model's norm;
  this plugin asks the engine for the global norm instead (one all-reduce). Clipping by value is
  element-wise, so Lightning's own implementation is already exact on shards.
- Non-finite gradients: before the step, every rank learns whether any rank's shard holds an
  ``inf`` or ``NaN`` (one all-reduce), and all ranks then raise, or all skip the step, together
  (``nonfinite_grads``). A step is never applied with such a gradient unless asked
  (``"ignore"``, what DDP does).
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.engine import ShardedModel

NonFinitePolicy = Literal["raise", "skip", "ignore"]


class NonFiniteGradientError(FloatingPointError):
    """A gradient held ``inf`` or ``NaN``; raised on every rank together, before the step."""


class ZeROPrecision(Precision):
    """Full fp32 precision (``precision="32-true"``) for the ZeRO strategies.

    Example::

        trainer = Trainer(strategy=ZeRO2Strategy(nonfinite_grads="skip"), precision="32-true", gradient_clip_val=1.0)
    """

    def __init__(self) -> None:
        super().__init__()
        self.sharded_model: ShardedModel | None = None
        self.nonfinite_grads: NonFinitePolicy = "raise"
        self.skipped_steps = 0
        self.last_grad_norm = None

    def _engine(self) -> ShardedModel:
        if self.sharded_model is None:
            raise RuntimeError("ZeROPrecision is not attached to a sharded model; use it through a ZeRO strategy")
        return self.sharded_model

    @override
    def _after_closure(self, model: pl.LightningModule, optimizer: Any) -> None:
        if self.nonfinite_grads != "ignore":
            self._check_finite(model, optimizer)
        super()._after_closure(model, optimizer)

    def _check_finite(self, model: pl.LightningModule, optimizer: Optimizer) -> None:
        ranks, local = self._engine().nonfinite_grads(optimizer)
        if not ranks:
            return
        step = model.trainer.global_step
        where = f"rank(s) {ranks}" + (f" (here: {', '.join(local[:5])})" if local else "")
        if self.nonfinite_grads == "raise":
            raise NonFiniteGradientError(
                f"non-finite gradients (inf or NaN) at step {step} on {where}; the step was not applied. "
                "Lower the learning rate, clip gradients (gradient_clip_val), check the data, or pass "
                "nonfinite_grads='skip' to skip such steps on all ranks."
            )
        self._engine().drop_grads(optimizer)
        self.skipped_steps += 1
        rank_zero_warn(f"skipped optimizer step {step}: non-finite gradients on {where} ({self.skipped_steps} so far)")

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.last_grad_norm = self._engine().clip_grad_norm_(optimizer, float(clip_val))
