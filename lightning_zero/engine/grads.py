"""Turning full gradients into sharded ones: when, in which order, and where they land.

[Note: reduce order]
Every rank must issue the same collectives in the same order. Units are therefore reduced in
one fixed order, the reverse of registration order (which is the usual order of backward). A
unit is reduced from a gradient hook as soon as all of its trainable parameters have their
gradient *and* every unit before it in that order has been reduced; whatever is left
(parameters unused in this backward, on this rank) is reduced when the backward pass ends.
Stage 1 reduces only on the micro-batch that synchronises: under ``no_sync`` (gradient
accumulation) it keeps accumulating full gradients; stages 2 and 3 reduce every micro-batch.

[Note: overlap]
Each reduce-scatter is issued asynchronously, so that it runs while backward goes on computing
the gradients of the units below. At most ``max_in_flight`` are in flight: issuing one more
first waits for the oldest, which bounds the full-size gradient buffers alive at once. The rest
are waited for when backward ends, before anything reads a sharded gradient. Full-size buffers
are reused from step to step: a pool of at most ``max_in_flight + 1`` buffers in all.

[Note: which gradients exist]
DDP leaves ``grad`` as ``None`` for a parameter that no rank used. To match it, each rank
records which parameters produced a gradient, one all-reduce combines the records when backward
ends, and only parameters some rank used receive a sharded gradient. A sharded gradient is a view
of the reduce-scatter output; later micro-batches add into it, and the user's
``optimizer.zero_grad()`` frees it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.autograd import Variable

from lightning_zero.engine.unit import ReducedGrads, ShardedUnit

UnitCallback = Callable[[ShardedUnit], None]


class GradReducer:
    """Reduce-scatters unit gradients into the ``shard_params``' ``.grad`` (see the notes above).

    Example::

        reducer = GradReducer(units, reduce_every_micro_batch=True)
        reducer.install()               # gradient hooks on every trainable parameter
        loss.backward()                 # units are reduced as their gradients complete
        shard_param.grad                # this rank's slice of the averaged gradient
    """

    def __init__(
        self,
        units: list[ShardedUnit],
        reduce_every_micro_batch: bool,
        after_unit_reduced: UnitCallback | None = None,
        after_backward: Callable[[], None] | None = None,
        max_in_flight: int = 2,
    ) -> None:
        self.units = units
        self.order = [u for u in reversed(units) if u.trainable_indices]
        self.reduce_every_micro_batch = reduce_every_micro_batch
        self.after_unit_reduced = after_unit_reduced
        self.after_backward = after_backward
        self.max_in_flight = max(1, max_in_flight)
        self.sync_enabled = True
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._pool: deque[tuple[tuple[int, torch.dtype, torch.device], torch.Tensor]] = deque()
        # Per-backward state.
        self._ready: dict[ShardedUnit, set[int]] = {u: set() for u in self.order}
        self._next = 0
        self._callback_queued = False
        self._in_flight: deque[ReducedGrads] = deque()
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
            if not self.sync_enabled:
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
        self.sync_enabled = self.reduce_every_micro_batch
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
        _check_frozen(unit)  # before its gradients are packed with the trainable ones
        buffer = self._take_buffer((unit.layout.padded_numel, unit.reduce_dtype, unit.device))
        self._in_flight.append(unit.reduce_grads(async_op=True, buffer=buffer, give_back=self._give_back))
        self._next += 1
        while len(self._in_flight) > self.max_in_flight:
            self._complete_oldest()
        if self.after_unit_reduced is not None:
            self.after_unit_reduced(unit)

    def _take_buffer(self, key: tuple[int, torch.dtype, torch.device]) -> torch.Tensor | None:
        for index, (buffer_key, buffer) in enumerate(self._pool):
            if buffer_key == key:
                del self._pool[index]
                return buffer
        return None

    def _give_back(self, buffer: torch.Tensor) -> None:
        # At most max_in_flight + 1 buffers in all, whatever their sizes: units of many sizes must not add up
        # to a full set of gradients kept between steps. The oldest goes first.
        self._pool.append(((buffer.numel(), buffer.dtype, buffer.device), buffer))
        while len(self._pool) > self.max_in_flight + 1:
            self._pool.popleft()

    def _complete_oldest(self) -> None:
        reduced = self._in_flight.popleft()
        self._pending.append((reduced.unit, reduced.wait(), reduced.had_grad))

    def drop_buffers(self) -> None:
        """Free the reusable gradient buffers (they are reallocated when needed)."""
        self._pool.clear()

    def finish_backward(self) -> None:
        """Reduce what is left, decide which sharded gradients exist, attach them."""
        try:
            self._check_frozen_stay_frozen()
            if self.sync_enabled:
                while self._next < len(self.order):
                    self._reduce(self.order[self._next])
                while self._in_flight:
                    self._complete_oldest()
                self._attach_pending()
        finally:
            while self._in_flight:  # after an error: nothing may still write into freed memory
                self._in_flight.popleft().wait()
            self._next = 0
            self._callback_queued = False
            self._pending.clear()
            for ready in self._ready.values():
                ready.clear()
        if self.after_backward is not None:
            self.after_backward()

    def _check_frozen_stay_frozen(self) -> None:
        for unit in self.units:
            _check_frozen(unit)

    def _attach_pending(self) -> None:
        if not self._pending:
            return
        device = self.order[0].device
        # One small all-reduce (MAX: "on any rank", which cannot overflow at any world size) carries which
        # parameters got a gradient and, per unit, whether its reduced gradients hold an inf or NaN (see
        # [Note: which gradients exist] and ``ShardedUnit.grads_finite``).
        flags = [torch.tensor(had, dtype=torch.uint8) for _, _, had in self._pending]
        # A sum is inf or NaN if any element is (and, rarely, when finite values overflow: that only sends the
        # check down its exact path); one cheap pass, no temporary of the gradient's size.
        sums = torch.stack([shard_grad.sum(dtype=torch.float32).to(device) for _, shard_grad, _ in self._pending])
        nonfinite = (~torch.isfinite(sums)).to(torch.uint8)
        combined = torch.cat([torch.cat(flags).to(device), nonfinite])
        self.order[0].comm.all_reduce(combined, op=dist.ReduceOp.MAX)
        used, nonfinite_anywhere = combined[: -len(self._pending)], combined[-len(self._pending) :].tolist()
        position = 0
        for (unit, shard_grad, had_grad), bad in zip(self._pending, nonfinite_anywhere):
            fresh = all(unit.shard_params[i].grad is None for i in unit.trainable_indices)
            # Known exactly only when these gradients are not added to earlier ones (accumulation).
            unit.grads_finite = not bad if fresh else None
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


def _check_frozen(unit: ShardedUnit) -> None:
    for index in unit.frozen_indices:
        if unit.params[index].grad is not None:
            raise RuntimeError(
                f"parameter {unit.param_names[index]!r} was frozen (requires_grad=False) when training "
                "started and now has a gradient. ZeRO fixes the set of trainable parameters at setup: "
                "unfreeze before trainer.fit (or freeze with requires_grad_ only the parameters that stay "
                "frozen for the whole run, and put the rest in the optimizer with lr=0 until needed)."
            )
