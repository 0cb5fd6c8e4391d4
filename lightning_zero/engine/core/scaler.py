"""``ShardedGradScaler``: loss scaling whose overflow check covers every rank's gradient shards.

Shared by the Trainer's ``ZeROPrecision`` and the Fabric strategies (``"16-mixed"``). A
``GradScaler`` per rank would see only its own shard and let ranks diverge; this one all-reduces
the ``inf``/``NaN`` flag, so every rank skips (or applies) the step together. Pure torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override


class ShardedGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` whose ``inf``/``NaN`` check covers every rank's gradient shards.

    Example::

        scaler = ShardedGradScaler("cuda")
        scaler.all_reduce = sharded_model.comm.all_reduce    # the strategy sets this
        scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()
    """

    def __init__(self, device: str = "cuda", **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self.all_reduce: Callable[[Tensor], None] | None = None
        self.comm_device: torch.device | None = None

    @override
    def _unscale_grads_(
        self, optimizer: Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool
    ) -> dict[torch.device, Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if self.all_reduce is None:
            return per_device
        device = self.comm_device or found_inf.device
        anywhere = torch.zeros((), dtype=torch.float32, device=device)
        for flag in per_device.values():
            anywhere += flag.to(device)
        self.all_reduce(anywhere)
        for flag in per_device.values():
            flag.copy_(anywhere.to(flag.device))
        if not per_device:  # no gradient on this rank: still take part in the decision
            per_device[found_inf.device] = anywhere.to(found_inf.device)
        return per_device

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler, device: str) -> ShardedGradScaler:
        """A sharded scaler with ``scaler``'s settings and current scale."""
        if isinstance(scaler, ShardedGradScaler):
            return scaler
        sharded = cls(device, enabled=scaler.is_enabled())
        sharded.load_state_dict(scaler.state_dict())
        return sharded
