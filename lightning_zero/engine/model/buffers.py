"""``BufferBroadcast``: rank 0's buffers on every rank, on DDP's schedule.

[Note: buffer broadcast]
DDP copies rank 0's buffers (BatchNorm statistics) to every rank before a forward through its wrapper, but only when
the previous such forward ran with gradients and synchronised them: not after a no_sync micro-batch of gradient
accumulation, nor after an evaluation forward, and so on the first validation step after training. Lightning routes
training, validation, test and predict steps through the wrapper; ``ShardedModel.begin_step`` follows the same rule,
so every rank ends with DDP's buffers. As DDP (``will_sync_module_buffers``): a module without buffers when it is
wrapped never looks for them again (a walk over every submodule per step saved); one with buffers collects them at
every broadcast, since user code may reassign them.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_zero.engine.comm.comm import Comm


class BufferBroadcast:
    """The buffer broadcasts of one module (see [Note: buffer broadcast]).

    Example::

        buffers = BufferBroadcast(model, comm, enabled=True)
        buffers.before_forward(no_sync=False)   # broadcasts when the previous forward synchronised
    """

    def __init__(self, module: nn.Module, comm: Comm, enabled: bool) -> None:
        self._module = module
        self._comm = comm
        self._active = enabled and comm.world_size > 1 and any(b is not None for b in module.buffers())
        self._forward_syncs = True  # whether the next forward broadcasts (DDP's rule: see the note)

    @property
    def next_forward_broadcasts(self) -> bool:
        """Whether the next ``before_forward`` broadcasts rank 0's buffers."""
        return self._active and self._forward_syncs

    def before_forward(self, no_sync: bool) -> None:
        """At the start of a step: broadcast if the previous forward synchronised, and remember whether this one
        does (it runs with gradients, outside ``no_sync``)."""
        if self._forward_syncs:
            self.broadcast()
        self._forward_syncs = torch.is_grad_enabled() and not no_sync

    def broadcast(self) -> None:
        """Broadcast rank 0's buffers, as DDP's ``broadcast_buffers``: one collective for all of them (their bytes
        side by side, whatever their dtypes; DDP sends one per dtype), so a model with BatchNorm (float statistics,
        an int64 counter) waits at one exchange per step, not two. Exact: bytes are copied, not converted."""
        if not self._active:
            return
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for buf in self._module.buffers():
            if buf is not None:
                by_device.setdefault(buf.device, []).append(buf)
        with torch.no_grad():
            for group in by_device.values():
                flat = torch.cat([b.reshape(-1).view(torch.uint8) for b in group])
                self._comm.broadcast(flat, src=0)
                sizes = [b.numel() * b.element_size() for b in group]
                torch._foreach_copy_(group, [v.view(b.dtype).view_as(b) for v, b in zip(flat.split(sizes), group)])
