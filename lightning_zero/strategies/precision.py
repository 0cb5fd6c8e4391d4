"""The precision plugin our strategies use: Lightning's fp32 ``Precision`` with sharding-aware clipping.

Lightning clips with ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters. Under ZeRO
those are this rank's shards, whose local norm is not the model's norm; this plugin asks the
engine for the global norm instead (one all-reduce). Clipping by value is element-wise, so
Lightning's own implementation is already exact on shards.
"""

from __future__ import annotations

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.engine import ShardedModel


class ZeROPrecision(Precision):
    """Full fp32 precision (``precision="32-true"``) for the ZeRO strategies.

    Example::

        trainer = Trainer(strategy=ZeRO2Strategy(), precision="32-true", gradient_clip_val=1.0)
    """

    def __init__(self) -> None:
        super().__init__()
        self.sharded_model: ShardedModel | None = None
        self.last_grad_norm = None

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self.sharded_model is None:
            raise RuntimeError("ZeROPrecision is not attached to a sharded model; use it through a ZeRO strategy")
        self.last_grad_norm = self.sharded_model.clip_grad_norm_(optimizer, float(clip_val))
