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
of the reduce-scatter output, kept as the ``.grad`` of the parameter's ``shard_param``; later
micro-batches add into it.

[Note: gradient markers]
The user's optimizer holds the module's parameters (see [Note: parameters outside their unit's
use] in ``unit.py``), so ``optimizer.zero_grad()`` only ever sees the module's ``param.grad``. To
keep its meaning exact, a parameter whose sharded gradient exists carries a ``GradMarker`` as its
``.grad``: a tensor subclass with the parameter's shape, dtype and device and no memory, so
``p.grad is not None`` answers as under DDP. ``zero_grad()`` removes it (``set_to_none=True``) or
zeroes it (``set_to_none=False``: the marker records the ``zero_`` instead of doing it); either
tells the next reduction to start the sharded gradient afresh, while an intact marker means
"accumulate" (gradient accumulation, or two backward passes before a step). A tensor hook takes
the marker off before autograd accumulates a new gradient into it. Any other use of a marker
(``grad_norm(module)``, ``clip_grad_norm_(module.parameters())``) raises
``ShardedGradientError``, which says what to call instead: the full gradient does not exist.

[Note: trainable sets that change]
Which parameters require a gradient may change at any time (``BaseFinetuning`` unfreezing a
backbone, ``toggle_optimizer`` in a GAN loop). Hooks are therefore installed on every parameter,
frozen or not, and a unit is complete when every parameter that requires a gradient *now* has
one. Units in which nothing requires a gradient are skipped, on every rank alike.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from lightning_zero.engine.unit import ReducedGrads, ShardedUnit

UnitCallback = Callable[[ShardedUnit], None]
_aten = torch.ops.aten


class ShardedGradientError(RuntimeError):
    """A module parameter's ``.grad`` was read, but under ZeRO the reduced gradient exists only as shards."""


class GradMarker(torch.Tensor):
    """A module parameter's ``.grad`` while its reduced gradient exists as this rank's shard (see
    [Note: gradient markers]): shaped like the parameter, no memory; ``zero_()`` is recorded, anything
    else raises ``ShardedGradientError``.

    Example::

        param.grad = GradMarker(param)
        param.grad.zero_()            # what zero_grad(set_to_none=False) does
        assert param.grad.zeroed
    """

    zeroed: bool

    @staticmethod
    def __new__(cls, param: torch.Tensor) -> GradMarker:
        marker = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device)
        marker.zeroed = False
        return marker

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"GradMarker(shape={tuple(self.shape)}, dtype={self.dtype}, zeroed={self.zeroed})"

    def __deepcopy__(self, memo: dict) -> GradMarker:
        copy = GradMarker(self)
        copy.zeroed = self.zeroed
        return copy

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _aten.zero_.default:
            args[0].zeroed = True
            return args[0]
        if func is _aten._foreach_zero_.default:
            for tensor in args[0]:
                if isinstance(tensor, GradMarker):
                    tensor.zeroed = True
                else:
                    tensor.zero_()
            return None
        raise ShardedGradientError(
            f"{func.__name__} on the .grad of a parameter of shape {tuple(args[0].shape) if args else '?'}: under ZeRO "
            "the reduced gradient exists only as each rank's shard, so the module's .grad is a marker. For the "
            "gradient norm use trainer.strategy.grad_norm(); to clip, Trainer(gradient_clip_val=...) or "
            "self.clip_gradients(...); see docs/troubleshooting.md, 'The module's param.grad is not the reduced "
            "gradient'."
        )


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
        self.order = list(reversed(units))
        self.reduce_every_micro_batch = reduce_every_micro_batch
        self.after_unit_reduced = after_unit_reduced
        self.after_backward = after_backward
        self.max_in_flight = max(1, max_in_flight)
        self.sync_enabled = True
        self.no_sync_requested = False  # inside ``no_sync`` (whether or not this stage still reduces)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._pool: deque[tuple[tuple[int, torch.dtype, torch.device], torch.Tensor]] = deque()
        # Per-backward state.
        self._ready: dict[ShardedUnit, set[int]] = {u: set() for u in self.order}
        self._next = 0
        self._callback_queued = False
        self._in_flight: deque[ReducedGrads] = deque()
        self._pending: list[tuple[ShardedUnit, torch.Tensor, list[bool]]] = []
        self._expected: dict[ShardedUnit, int] = {}  # per backward: parameters that require a gradient now
        # See [Note: gradient markers]: each parameter's marker, and the parameters whose marker was intact
        # when a new gradient arrived (their sharded gradient accumulates).
        self._markers: dict[nn.Parameter, GradMarker] = {}
        self._carry: set[nn.Parameter] = set()

    # ------------------------------------------------------------------ hooks
    def install(self) -> None:
        for unit in self.order:
            for index, param in enumerate(unit.params):
                frozen = not param.requires_grad
                if frozen:  # hooks can only be registered on a tensor that requires grad; they outlive the flag
                    param.requires_grad_(True)
                self._handles.append(param.register_hook(self._make_marker_hook(param)))
                self._handles.append(param.register_post_accumulate_grad_hook(self._make_hook(unit, index)))
                if frozen:
                    param.requires_grad_(False)

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

    def _make_marker_hook(self, param: nn.Parameter) -> Callable[[torch.Tensor], None]:
        def hook(_grad: torch.Tensor) -> None:
            self._take_marker(param)

        return hook

    # ------------------------------------------------------------------ markers (see [Note: gradient markers])
    def _take_marker(self, param: nn.Parameter) -> None:
        """Take ``param``'s marker off (if it has one), remembering whether its sharded gradient accumulates."""
        marker = param.grad
        if isinstance(marker, GradMarker):
            if not marker.zeroed:
                self._carry.add(param)
            param.grad = None

    def put_marker(self, param: nn.Parameter) -> None:
        """Show that ``param`` has a sharded gradient (``param.grad`` becomes its marker)."""
        marker = self._markers.get(param)
        if (
            marker is None
            or marker.shape != param.shape
            or marker.dtype != param.dtype
            or marker.device != param.device
        ):
            marker = self._markers[param] = GradMarker(param)
        marker.zeroed = False
        param.grad = marker

    def is_marker(self, param: nn.Parameter) -> bool:
        """Whether ``param.grad`` is a marker (rather than ``None`` or a full gradient)."""
        return isinstance(param.grad, GradMarker)

    def has_marker(self, param: nn.Parameter) -> bool:
        """Whether ``param``'s sharded gradient is still wanted: its marker was neither removed nor zeroed by
        ``zero_grad()`` (or was taken off intact by this backward pass)."""
        marker = param.grad
        return (isinstance(marker, GradMarker) and not marker.zeroed) or param in self._carry

    def clear_marker(self, param: nn.Parameter) -> None:
        if isinstance(param.grad, GradMarker):
            param.grad = None
        self._carry.discard(param)

    def queue_finish(self) -> None:
        """Make sure ``finish_backward`` runs when the current backward pass ends."""
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self.finish_backward)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Keep gradients local (stage 1 accumulates full gradients; stages 2 and 3 ignore this)."""
        previous = self.sync_enabled, self.no_sync_requested
        self.sync_enabled = self.reduce_every_micro_batch
        self.no_sync_requested = True
        try:
            yield
        finally:
            self.sync_enabled, self.no_sync_requested = previous

    # ------------------------------------------------------------------ reduction
    def _is_complete(self, unit: ShardedUnit) -> bool:
        expected = self._expected.get(unit)
        if expected is None:  # first look in this backward pass (see [Note: trainable sets that change])
            expected = self._expected[unit] = sum(p.requires_grad for p in unit.params)
        return len(self._ready[unit]) == expected

    def _reduce_ready_in_order(self) -> None:
        while self._next < len(self.order) and self._is_complete(self.order[self._next]):
            self._reduce(self.order[self._next])

    def _reduce(self, unit: ShardedUnit) -> None:
        if not any(p.requires_grad for p in unit.params):
            self._next += 1  # nothing to reduce, on any rank
            return
        for param, shard_param in zip(unit.params, unit.shard_params):
            self._take_marker(param)  # of a parameter this backward did not reach
            if param not in self._carry:
                shard_param.grad = None  # zeroed by the user: free it before the new one arrives
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
            self._expected.clear()
            for ready in self._ready.values():
                ready.clear()
        if self.after_backward is not None:
            self.after_backward()

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
        params = [p for unit, _, _ in self._pending for p in unit.params]
        carry = {p: self.has_marker(p) for p in params}
        position = 0
        for (unit, shard_grad, had_grad), bad in zip(self._pending, nonfinite_anywhere):
            for param, shard_param in zip(unit.params, unit.shard_params):
                if not carry[param]:  # zeroed by the user since the last reduction
                    shard_param.grad = None
                self._carry.discard(param)
            fresh = all(sp.grad is None for sp, p in zip(unit.shard_params, unit.params) if p.requires_grad)
            # Known exactly only when these gradients are not added to earlier ones (accumulation).
            unit.grads_finite = not bad if fresh else None
            for index, piece in enumerate(unit.param_shards):
                used_somewhere = bool(used[position + index])
                param = unit.params[index]
                shard_param = unit.shard_params[index]
                if used_somewhere and param.requires_grad:
                    region = shard_grad[piece.shard_offset : piece.shard_offset + piece.numel]
                    if shard_param.grad is None:
                        shard_param.grad = region
                    else:
                        shard_param.grad.add_(region)
                if shard_param.grad is not None:
                    self.put_marker(param)
            position += len(had_grad)
