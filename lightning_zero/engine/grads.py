"""Turning full gradients into sharded ones: when, in which order, and where they land.

[Note: reduce order]
Every rank must issue the same collectives in the same order. Units are therefore reduced in
one fixed order, the reverse of registration order (which is the usual order of backward). With
``reduce_in_backward`` (stages 2 and 3), a unit is reduced from a gradient hook as soon as all
of its trainable parameters have their gradient *and* every unit before it in that order has been
reduced; whatever is left (parameters unused in this backward, on this rank) is reduced when
the backward pass ends. Without it (stage 1), all units are reduced when the backward ends,
unless gradient synchronisation is switched off (``no_sync``, gradient accumulation).

[Note: which gradients exist]
DDP leaves ``grad`` as ``None`` for a parameter that no rank used. To match it, each rank
records which parameters produced a gradient, one all-reduce combines the records when backward
ends, and only parameters some rank used receive a sharded gradient. A sharded gradient is a view
of the reduce-scatter output; later micro-batches add into it, and the user's
``optimizer.zero_grad()`` frees it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.autograd import Variable

from lightning_zero.engine.unit import ShardedUnit

UnitCallback = Callable[[ShardedUnit], None]


class GradReducer:
    """Reduce-scatters unit gradients into the ``shard_params``' ``.grad`` (see the notes above).

    Example::

        reducer = GradReducer(units, reduce_in_backward=True)
        reducer.install()               # gradient hooks on every trainable parameter
        loss.backward()                 # units are reduced as their gradients complete
        shard_param.grad                # this rank's slice of the averaged gradient
    """

    def __init__(
        self,
        units: list[ShardedUnit],
        reduce_in_backward: bool,
        after_unit_reduced: UnitCallback | None = None,
        after_backward: Callable[[], None] | None = None,
    ) -> None:
        self.units = units
        self.order = [u for u in reversed(units) if u.trainable_indices]
        self.reduce_in_backward = reduce_in_backward
        self.after_unit_reduced = after_unit_reduced
        self.after_backward = after_backward
        self.sync_enabled = True
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        # Per-backward state.
        self._ready: dict[ShardedUnit, set[int]] = {u: set() for u in self.order}
        self._next = 0
        self._callback_queued = False
        self._pending: list[tuple[ShardedUnit, torch.Tensor, list[bool]]] = []

    # ------------------------------------------------------------------ hooks
    def install(self) -> None:
        for unit in self.order:
            for index in unit.trainable_indices:
                hook = self._make_hook(unit, index)
                self._handles.append(unit.params[index].register_post_accumulate_grad_hook(hook))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _make_hook(self, unit: ShardedUnit, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            self.queue_finish()
            if not (self.reduce_in_backward and self.sync_enabled):
                return
            self._ready[unit].add(index)
            self._reduce_ready_in_order()

        return hook

    def queue_finish(self) -> None:
        """Make sure ``finish_backward`` runs when the current backward pass ends."""
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self.finish_backward)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Keep gradients local (stage 1 accumulates full gradients; stages 2 and 3 ignore this)."""
        previous = self.sync_enabled
        self.sync_enabled = self.reduce_in_backward
        try:
            yield
        finally:
            self.sync_enabled = previous

    # ------------------------------------------------------------------ reduction
    def _is_complete(self, unit: ShardedUnit) -> bool:
        return len(self._ready[unit]) == len(unit.trainable_indices)

    def _reduce_ready_in_order(self) -> None:
        while self._next < len(self.order) and self._is_complete(self.order[self._next]):
            self._reduce(self.order[self._next])

    def _reduce(self, unit: ShardedUnit) -> None:
        shard_grad, had_grad = unit.reduce_grads()
        self._pending.append((unit, shard_grad, had_grad))
        self._next += 1
        if self.after_unit_reduced is not None:
            self.after_unit_reduced(unit)

    def finish_backward(self) -> None:
        """Reduce what is left, decide which sharded gradients exist, attach them."""
        try:
            self._check_frozen_stay_frozen()
            if self.sync_enabled:
                while self._next < len(self.order):
                    self._reduce(self.order[self._next])
                self._attach_pending()
        finally:
            self._next = 0
            self._callback_queued = False
            self._pending.clear()
            for ready in self._ready.values():
                ready.clear()
        if self.after_backward is not None:
            self.after_backward()

    def _check_frozen_stay_frozen(self) -> None:
        for unit in self.units:
            for index in unit.frozen_indices:
                if unit.params[index].grad is not None:
                    raise RuntimeError(
                        f"parameter {unit.param_names[index]!r} was frozen (requires_grad=False) when training "
                        "started and now has a gradient. ZeRO fixes the set of trainable parameters at setup: "
                        "unfreeze before trainer.fit (or freeze with requires_grad_ only the parameters that stay "
                        "frozen for the whole run, and put the rest in the optimizer with lr=0 until needed)."
                    )

    def _attach_pending(self) -> None:
        if not self._pending:
            return
        flags = [torch.tensor(had, dtype=torch.uint8) for _, _, had in self._pending]
        used = torch.cat(flags).to(self.order[0].device)
        self.order[0].comm.all_reduce(used)
        position = 0
        for unit, shard_grad, had_grad in self._pending:
            for index, piece in enumerate(unit.param_shards):
                used_somewhere = bool(used[position + index])
                if not used_somewhere or not unit.params[index].requires_grad:
                    continue
                region = shard_grad[piece.shard_offset : piece.shard_offset + piece.numel]
                shard_param = unit.shard_params[index]
                if shard_param.grad is None:
                    shard_param.grad = region
                else:
                    shard_param.grad.add_(region)
            position += len(had_grad)
