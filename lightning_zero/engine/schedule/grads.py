"""Turning full gradients into sharded ones: when, in which order, and where they land.

[Note: reduce order]
Every rank must issue the same collectives in the same order, and a unit should be reduced (and its
full gradients freed) as soon as its gradients are complete. The two meet in an order that every
rank knows in advance, as DDP rebuilds its buckets after the first iteration:

- on the first backward pass that reduces, units are reduced in the reverse of registration order
  (the usual order of backward), and each rank records the order in which its units *completed*
  (all of their trainable parameters have their gradient); units that never completed follow, in
  reverse registration order;
- when that backward pass ends, a hash of the recorded order travels in the all-reduce that the first
  backward pass issues (see [Note: which gradients exist]): if every rank recorded the same
  order, it becomes the reduce order from the next backward on; if not (control flow that differs
  between ranks), every rank keeps the reverse registration order. Either way all ranks agree,
  without a collective per unit.

A unit is reduced from a gradient hook as soon as it is complete *and* every unit before it in the
order has been reduced; whatever is left (parameters unused in this backward, on this rank) is
reduced when the backward pass ends. The order cannot skip a unit that is incomplete on this rank:
whether another rank uses that unit is not known here, and if it does, that rank reduces it now
while this one would move on to the next, pairing different collectives. Skipping needs a rule
that reads only what every rank knows, and the recorded order is that rule: a unit unused on the
first step (or registered where it does not run) sits at its end, so it blocks nothing; one that
stops being used later, on one rank, delays the units after it on that rank to the end of backward
(correct, only later). Stage 1 reduces only on the micro-batch that synchronises: under ``no_sync``
(gradient accumulation) it keeps accumulating full gradients; stages 2 and 3 reduce every
micro-batch.

[Note: one end of backward]
``finish_backward`` must run once per backward pass. It is queued on the autograd engine from the
first hook of a pass; under reentrant activation checkpointing (``checkpoint(use_reentrant=True)``)
that hook may fire inside the *nested* backward the checkpoint runs, whose queued callbacks run when
the nested pass ends, while the outer one still has work to do. A callback therefore checks whether
it runs inside a node of an outer pass (``torch._C._current_autograd_node()`` is that node, and
``None`` at the end of the outermost pass); if so it hands itself to that node, whose post-hook
queues it again on the outer pass.

[Note: overlap]
Each reduce-scatter is issued asynchronously, so that it runs while backward goes on computing
the gradients of the units below. The full-size buffers that reductions read are bounded in bytes,
not in count: those in flight plus those kept for reuse hold at most ``max_in_flight_bytes`` (by
default, the buffers of the two largest units), so many small units may be in flight at once and
two large ones at most; issuing one more first waits for the oldest. The rest are waited for when
backward ends, before anything reads a sharded gradient. A buffer is reused within a backward pass
only: when the pass ends none is kept, so nothing full-size outlives the collectives that needed
it (the memory between steps is the sharded state alone).

[Note: which gradients exist]
DDP leaves ``grad`` as ``None`` for a parameter that no rank used. To match it, only parameters
some rank used receive a sharded gradient, and every rank must know which those are without a
collective of its own on every step (on a small model, that exchange's latency is a fifth of the
step). The reduce-scatter carries the answer in the common case: each rank's chunk of the buffer
ends with one slot, which every rank sets to 1 if it left a parameter that requires a gradient
without one, so after the reduction the slot is positive, on every rank alike, exactly when some
rank did (a sum of non-negative numbers is positive iff one of them is, in any dtype and order).

The same slot answers the other question every step asks by default (``nonfinite_grads``): does
any rank's gradient hold an inf or NaN? With ``check_finite`` each rank adds ``0 * m`` to its
slot, ``m`` the sum of its gradients in the buffer: 0 when they are finite, NaN when one is not
(or when their sum overflows, which only sends the step down the exact path below); NaN
survives the sum, so after the reduction the slot is NaN when some rank's gradients were not
finite. The price is one read of the buffer on the device, queued with the copies into it and
never waited for by the host: on a GPU a few microseconds per hundred MB, against an
all-reduce's latency and a host synchronisation after it; on a CPU about 7 ms per 100 MB (a
sum; a largest magnitude would take 80 ms there, measured).

One case escapes the slot: finite gradients whose sum overflows in the reduce dtype (fp32 values
near 1e38 summed before dividing, or fp16 rounding at its limit). Each rank checks its own
reduced shard (its sum, on the device, read with the slots; its elements if the sum is not
finite) and raises if the shard holds an inf or NaN that the slot did not announce; the other
ranks, which cannot know, stop at their next collective with its error (``PeerFailureError``):
an error everywhere, never a step silently applied with an inf.

So the host reads the slots (and the shards' sums) once per optimizer step, not once per backward
pass (see [Note: flags read at the step]). When every slot is 0, every parameter that requires a
gradient was used everywhere and all are finite: no other collective. Otherwise (parameters unused
on some rank, non-finite gradients), and on the first backward pass (which settles the reduce
order), one small all-reduce of per-parameter records and per-unit finiteness follows. A sharded
gradient is a view of the reduce-scatter output, kept as the ``.grad`` of the parameter's
``shard_param``; later micro-batches add into it.

[Note: flags read at the step]
DDP and FSDP2 end backward without waiting for the device; reading the slots there would make the host
wait for every kernel of backward, once per micro-batch under stages 2 and 3. Nothing on the host needs
them before the optimizer step, so from the second reducing backward pass on, ``_attach_pending``
attaches every reduced shard as if every slot were 0 (the common case), and queues the slots and each
unit's gradient sum for the host (``HostValues``: a copy into pinned memory, an event behind it). The
flags of every backward pass since the last step are read together by ``settle``, which every path
that acts on the sharded gradients calls first, on every rank at the same point: the optimizer step
(``ShardedModel.settle_grads``, from the step's pre-hook, ``on_shards`` and the precision plugins),
``nonfinite_grads``, ``grad_norm``, ``drop_grads``; and the end of a backward pass that leaves
``MAX_UNCHECKED`` passes unread. ``settle`` then does what the end of backward used to do, in the
order of the passes: where a pass's slots were all 0 nothing changes, and each unit's ``grads_finite``
is known; where one was not, one all-reduce (for all such passes together) says which parameters some
rank used and which units hold an inf or NaN, and the sharded gradients that no rank made since they
were last started afresh are dropped again (with their markers). An added shard of zeros leaves the
sum it is added to as it was (bitwise, but for the sign of a zero). The sum that ``check_finite``
reads is, for a unit whose gradients accumulate over micro-batches, the sum of what it holds after
the addition: so the finiteness of an accumulated gradient is known from the same read (finite
values whose addition overflows are this rank's overflow, as below). Until ``settle``, a parameter
that no rank used shows a marker as its ``.grad``, and ``grads_finite`` keeps its last value: the
engine's readers settle first. The one host read that is left is the step's, where the
``nonfinite_grads`` policy decides on the host whether the step runs anyway (DDP's ``GradScaler``
reads its found-inf flag in ``step()`` for the same reason); on a CUDA device it waits through the
stall report (see [Note: waits for the device] in ``device_wait.py``).

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

import hashlib
import math
import operator
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from lightning_zero.engine.comm.comm import Comm
from lightning_zero.engine.comm.device_wait import DeviceEvent, HostValues, read_on_host, record_event, wait_for_device
from lightning_zero.engine.comm.labels import label
from lightning_zero.engine.core.pinned import PinnedPool
from lightning_zero.engine.core.placeholder import check_conversion, passthrough
from lightning_zero.engine.core.unit import ShardedUnit
from lightning_zero.engine.errors import ShardedGradientError
from lightning_zero.engine.schedule.reduce import ReducedGrads, host_copies_event, reduce_grads, reduce_numel

UnitCallback = Callable[[ShardedUnit], None]
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_aten = torch.ops.aten
MAX_UNCHECKED = 64  # backward passes whose flags may wait for ``settle`` (see [Note: flags read at the step])


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
        if func is _aten._to_copy.default:  # ``module.to(...)`` converts every .grad after its parameter
            marker, kwargs = args[0], kwargs or {}
            where = f"the .grad of a parameter of shape {tuple(marker.shape)}"
            check_conversion(where, marker, kwargs.get("dtype") or marker.dtype, kwargs.get("device") or marker.device)
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
        max_in_flight_bytes: int | None = None,
        comm: Comm | None = None,
    ) -> None:
        self.units = units
        # Where the flags of ``_attach_pending`` are combined: every rank (the units' own Comm is the shard group
        # under hybrid sharding; see [Note: hybrid sharding] in mesh.py).
        self.comm = comm if comm is not None or not units else units[0].comm
        self.order = list(reversed(units))  # the reduce order (see [Note: reduce order])
        self.order_agreed = False  # True once the order recorded on the first backward is settled
        self._completed: list[ShardedUnit] = []  # this backward's completion order, while recording
        self.reduce_every_micro_batch = reduce_every_micro_batch
        self.after_unit_reduced = after_unit_reduced
        self.after_backward = after_backward
        sizes = sorted((_buffer_bytes(u) for u in units), reverse=True)
        self.max_in_flight_bytes = max_in_flight_bytes if max_in_flight_bytes is not None else sum(sizes[:2])
        # Whether each backward pass finds out, on every rank alike, if any rank's reduced gradients hold an inf
        # or NaN (``ShardedUnit.grads_finite``): set by those who read it (a ``nonfinite_grads`` policy).
        self.check_finite = False
        self.sync_enabled = True
        self.no_sync_requested = False  # inside ``no_sync`` (whether or not this stage still reduces)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        # Full-size buffers whose reduction is done, for reuse within this backward pass (see [Note: overlap]).
        self._pool: deque[tuple[tuple[int, torch.dtype, torch.device], torch.Tensor]] = deque()
        # Per-backward state.
        self._ready: dict[ShardedUnit, set[int]] = {u: set() for u in self.order}
        self._next = 0
        self._callback_queued = False
        self._in_flight: deque[ReducedGrads] = deque()
        self._pending: list[_Reduced] = []
        # Backward passes attached before their flags were read (see [Note: flags read at the step]), and the pinned
        # host buffers their flags are copied into on CUDA (one per pass until the step: accumulation keeps several).
        self._unchecked: list[_Unchecked] = []
        self._flag_buffers = PinnedPool(keep=8)
        self._expected: dict[ShardedUnit, int] = {}  # per backward: parameters that require a gradient now
        # See [Note: gradient markers]: each parameter's marker, and the parameters whose marker was intact
        # when a new gradient arrived (their sharded gradient accumulates).
        # Keyed by ``id(param)``: a tensor's own ``__hash__`` is a Python call, and these are looked up per
        # parameter per step. Every key is a parameter of ``units``, alive as long as this reducer.
        self._markers: dict[int, GradMarker] = {}
        self._carry: set[int] = set()

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
        ready = self._ready[unit]

        def hook(_param: torch.Tensor) -> None:
            # Runs once per parameter per backward pass: the common case (the unit is not complete yet) returns
            # after a few attribute reads, with no call of its own.
            if not self._callback_queued:
                self.queue_finish()
            if not self.sync_enabled:
                # See [Note: local accumulation]: nothing is reduced, but a unit done with is done with.
                if self.after_unit_reduced is not None:
                    ready.add(index)
                    if self._is_complete(unit):
                        self.after_unit_reduced(unit)
                return
            ready.add(index)
            expected = self._expected.get(unit)  # (``_is_complete``, inline once it is known)
            if not (len(ready) == expected if expected is not None else self._is_complete(unit)):
                return  # neither this unit nor any after it in the order can be reduced yet
            if not self.order_agreed and unit not in self._completed:
                self._completed.append(unit)
            self._reduce_ready_in_order()

        return hook

    def _make_marker_hook(self, param: nn.Parameter) -> Callable[[torch.Tensor], None]:
        def hook(_grad: torch.Tensor) -> None:
            if param.grad is not None:  # (None in the common case: zero_grad() removed the marker)
                self._take_marker(param)

        return hook

    # ------------------------------------------------------------------ markers (see [Note: gradient markers])
    def _take_marker(self, param: nn.Parameter) -> None:
        """Take ``param``'s marker off (if it has one), remembering whether its sharded gradient accumulates."""
        marker = param.grad
        if isinstance(marker, GradMarker):
            if not marker.zeroed:
                self._carry.add(id(param))
            param.grad = None

    def put_markers(self, params: list[nn.Parameter], shard_params: list[nn.Parameter]) -> None:
        """Show, for each parameter whose ``shard_param`` holds a sharded gradient, that it has one (``param.grad``
        becomes its marker). One call per unit: this runs on the step path, the marker's lookup inline."""
        markers = self._markers
        for param, shard_param in zip(params, shard_params):
            if shard_param.grad is None:
                continue
            marker = markers.get(id(param))
            if marker is not None:
                marker.zeroed = False
                try:
                    param.grad = marker  # autograd checks shape, dtype and device: a marker that no longer fits
                    continue  # is refused, and made again below
                except RuntimeError:
                    pass
            marker = markers[id(param)] = GradMarker(param)
            param.grad = marker

    def drop_unwanted(self, params: list[nn.Parameter], shard_params: list[nn.Parameter]) -> bool:
        """Forget the sharded gradients whose marker ``zero_grad()`` removed or zeroed since they were made (see
        ``has_marker``), and what this backward pass carried; ``True`` when no trainable parameter keeps one (the
        next ones are fresh, not added to earlier ones). One call per unit: ``has_marker`` inline."""
        carry = self._carry
        fresh = True
        for param, shard_param in zip(params, shard_params):
            marker = param.grad
            if not ((isinstance(marker, GradMarker) and not marker.zeroed) or id(param) in carry):
                shard_param.grad = None
            elif fresh and shard_param.grad is not None and param.requires_grad:
                fresh = False
            carry.discard(id(param))
        return fresh

    def is_marker(self, param: nn.Parameter) -> bool:
        """Whether ``param.grad`` is a marker (rather than ``None`` or a full gradient)."""
        return isinstance(param.grad, GradMarker)

    def has_marker(self, param: nn.Parameter) -> bool:
        """Whether ``param``'s sharded gradient is still wanted: its marker was neither removed nor zeroed by
        ``zero_grad()`` (or was taken off intact by this backward pass)."""
        marker = param.grad
        return (isinstance(marker, GradMarker) and not marker.zeroed) or id(param) in self._carry

    def clear_marker(self, param: nn.Parameter) -> None:
        if isinstance(param.grad, GradMarker):
            param.grad = None
        self._carry.discard(id(param))

    def queue_finish(self) -> None:
        """Make sure ``finish_backward`` runs once, when the current (outermost) backward pass ends."""
        if not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_pass)

    def _end_of_pass(self) -> None:
        node = torch._C._current_autograd_node()
        if node is not None:  # a nested pass ended (see [Note: one end of backward]): wait for the outer one
            node.register_hook(_once(lambda: Variable._execution_engine.queue_callback(self._end_of_pass)))
            return
        self.finish_backward()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Keep gradients local: the backward passes inside add up full gradients on each rank (stage 1, and stages
        2 and 3 with ``accumulate="local"``); with ``reduce_every_micro_batch`` (stages 2 and 3 by default) they are
        reduced anyway.

        [Note: local accumulation]
        Under gradient accumulation, stages 2 and 3 reduce-scatter every micro-batch into the sharded gradient
        (``accumulate="sharded"``): k reductions per optimizer step, and the full gradients of a unit live only
        until its reduction. ``accumulate="local"`` trades that memory for the traffic, as DDP and stage 1 do:
        inside ``no_sync`` (Lightning's ``block_backward_sync`` on every micro-batch but the last, Fabric's
        ``no_backward_sync``), autograd adds each micro-batch's gradients into the parameters' full ``.grad``, and
        the first backward outside it reduces the sum once; the same order of sums as DDP's, so DDP's bits. The
        full gradients of every trainable parameter then live on each rank from the first micro-batch to that
        reduction (``4Ψ`` bytes in fp32). Under stage 3 they are tensors of their own, not views of a unit's
        buffer, so a unit is still freed as soon as its gradients are in: the gradient hooks count each unit's
        parameters as in a reducing backward and call ``after_unit_reduced`` (which frees it) without reducing
        anything; the parameters stay sharded between uses. Nothing here waits for the device."""
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
            with passthrough():  # (the unit may be sharded now: its parameters are placeholders)
                expected = self._expected[unit] = sum(map(_REQUIRES_GRAD, unit.params))
        return len(self._ready[unit]) == expected

    def _reduce_ready_in_order(self) -> None:
        while self._next < len(self.order) and self._is_complete(self.order[self._next]):
            self._reduce(self.order[self._next])

    def _reduce(self, unit: ShardedUnit) -> None:
        if not any(map(_REQUIRES_GRAD, unit.params)):
            self._next += 1  # nothing to reduce, on any rank
            return
        carry = self._carry
        for param, shard_param in zip(unit.params, unit.shard_params):
            if isinstance(param.grad, GradMarker):
                self._take_marker(param)  # of a parameter this backward did not reach
            if id(param) not in carry:
                shard_param.grad = None  # zeroed by the user: free it before the new one arrives
        size = _buffer_bytes(unit)
        while self._in_flight and self._in_flight_bytes() + size > self.max_in_flight_bytes:
            self._complete_oldest()
        buffer = self._take_buffer((reduce_numel(unit), unit.reduce_dtype, unit.device), size)
        self._in_flight.append(
            reduce_grads(unit, async_op=True, buffer=buffer, give_back=self._give_back, check_finite=self.check_finite)
        )
        self._next += 1
        if self.after_unit_reduced is not None:
            self.after_unit_reduced(unit)

    def _in_flight_bytes(self) -> int:
        return sum(_buffer_bytes(r.unit) for r in self._in_flight if r.in_flight)

    def _pool_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for _, b in self._pool)

    def _take_buffer(self, key: tuple[int, torch.dtype, torch.device], size: int) -> torch.Tensor | None:
        """A kept buffer of this shape, else ``None`` (a new one is made): kept ones that do not fit go first, so
        that in flight and kept stay within ``max_in_flight_bytes`` (see [Note: overlap])."""
        for index, (buffer_key, buffer) in enumerate(self._pool):
            if buffer_key == key:
                del self._pool[index]
                return buffer
        while self._pool and self._in_flight_bytes() + self._pool_bytes() + size > self.max_in_flight_bytes:
            self._pool.popleft()
        return None

    def _give_back(self, buffer: torch.Tensor) -> None:
        self._pool.append(((buffer.numel(), buffer.dtype, buffer.device), buffer))
        while self._pool and self._in_flight_bytes() + self._pool_bytes() > self.max_in_flight_bytes:
            self._pool.popleft()

    def _complete_oldest(self) -> None:
        reduced = self._in_flight.popleft()
        shard = reduced.wait()
        assert reduced.total is not None
        self._pending.append(_Reduced(reduced.unit, shard, reduced.had_grad, reduced.total, reduced.unused_anywhere))

    def drop_buffers(self) -> None:
        """Free the reusable gradient buffers (each backward pass drops them when it ends) and the flags' pinned
        ones."""
        self._pool.clear()
        self._flag_buffers.clear()

    def finish_backward(self) -> None:
        """Reduce what is left, decide which sharded gradients exist, attach them."""
        with label("ZeRO::finish_backward"):
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
                self._pool.clear()  # nothing full-size outlives the backward pass (see [Note: overlap])
                self._completed = []
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
        pending = self._pending
        device = self.order[0].device
        if self.order_agreed:
            # See [Note: flags read at the step]: attached as if every slot were 0, the flags read by ``settle``.
            self._synchronize_copies(pending, device)
            self._unchecked.append(self._attach_unchecked(pending, device))
            if len(self._unchecked) >= MAX_UNCHECKED:  # (the same count on every rank: each ran these passes)
                self.settle()
            return
        # The first reducing backward pass: the recorded order is settled now, in one small all-reduce (MAX: "on
        # any rank", which cannot overflow at any world size) that also carries which parameters got a gradient
        # and, per unit, whether its reduced gradients hold an inf or NaN (see ``ShardedUnit.grads_finite``; only
        # when ``check_finite``). Its read is this pass's one read on the host.
        self.settle()
        proposal = self._proposed_order()
        had = [flag for reduced in pending for flag in reduced.had_grad]
        parts = [torch.tensor(had, dtype=torch.uint8).to(device, non_blocking=True)]
        if self.check_finite:
            # A sum is inf or NaN if any element is (and, rarely, when finite values overflow: that only sends the
            # check down its exact path); summed on the device before any copy to the host.
            totals = torch.stack([r.total.to(device) for r in pending])
            parts.append((~torch.isfinite(totals)).to(torch.uint8))
        parts.append(torch.tensor(_order_hash(self.units, proposal), dtype=torch.uint8).to(device))
        combined = torch.cat(parts)
        self.comm.all_reduce(combined, op=dist.ReduceOp.MAX)
        flags = read_on_host(self.comm, combined, "which gradients exist, settling the reduce order")
        self._synchronize_copies(pending, device)
        used, flags = flags[: len(had)], flags[len(had) :]
        nonfinite_anywhere = None
        if self.check_finite:
            nonfinite_anywhere, flags = flags[: len(pending)], flags[len(pending) :]
        self._settle_order(proposal, flags)
        self._attach(pending, used, nonfinite_anywhere)

    def _synchronize_copies(self, pending: list[_Reduced], device: torch.device) -> None:
        """Wait for the copies of this pass's sharded gradients to the host, if any (see [Note: offload copies] in
        ``unit.py``: the host adds into them), through the stall report."""
        copies = _event_after_host_copies(pending, device)
        wait_for_device(self.comm, copies, "the sharded gradients' copies to the host")

    def _attach_unchecked(self, pending: list[_Reduced], device: torch.device) -> _Unchecked:
        """Attach every reduced shard as if no rank had left a parameter unused (see [Note: flags read at the
        step]); queue this pass's flags for the host; return what ``settle`` needs to undo that where it was
        wrong."""
        started: list[list[bool | None]] = []
        fresh_units: list[bool] = []
        sums: list[torch.Tensor] = []
        with passthrough():  # stage 3 has freed most units by now: their parameters' ``.grad`` is read directly
            for reduced in pending:
                unit = reduced.unit
                params, shard_params = unit.params, unit.shard_params
                fresh = self.drop_unwanted(params, shard_params)  # (zeroed by the user since the last reduction)
                made: list[bool | None] = []
                for param, shard_param, region in zip(params, shard_params, unit.piece_views(reduced.shard)):
                    if not param.requires_grad:
                        made.append(None)
                    elif shard_param.grad is None:
                        shard_param.grad = region
                        made.append(True)
                    else:
                        shard_param.grad.add_(region)
                        made.append(False)
                self.put_markers(params, shard_params)
                started.append(made)
                fresh_units.append(fresh)
                if self.check_finite:
                    # What the unit's sharded gradients hold now: this shard, or the sum it was added to.
                    sums.append(reduced.total if fresh else _grad_sum(shard_params, device))
        parts = [r.unused_anywhere.float() for r in pending]
        if sums:
            parts.append(torch.stack([total.to(device) for total in sums]))
        return _Unchecked(
            [r.unit for r in pending],
            [r.had_grad for r in pending],
            fresh_units,
            started,
            HostValues(torch.cat(parts), self._flag_buffers.take),
            self.check_finite,
        )

    def settle(self) -> None:
        """Read the flags of the backward passes attached since the last call and act on them (see [Note: flags
        read at the step]): drop the sharded gradients that no rank made, set each unit's ``grads_finite``, raise
        if this rank's reduced gradients overflowed. Call on every rank at the same point (one all-reduce when some
        pass had a parameter unused on some rank, or an inf or NaN); nothing when there is nothing to read."""
        records, self._unchecked = self._unchecked, []
        if not records:
            return
        with label("ZeRO::settle_grads"):
            for record in records:  # (each waited for; after the first one, normally at once)
                record.flags.wait(self.comm, "reading the gradients' flags")
            flat = torch.cat([r.flags.values for r in records]).tolist()  # host memory: one read for all
            values, start = [], 0
            for record in records:
                values.append(flat[start : start + record.flags.values.numel()])
                start += record.flags.values.numel()
            exact = self._exact_flags(records, values)
            with passthrough():
                self._replay(records, values, exact)

    def discard_unchecked(self) -> None:
        """Forget the flags not read yet (the module is made plain: its sharded gradients go with it)."""
        self._unchecked = []

    def _exact_flags(self, records: list[_Unchecked], values: list[list[Any]]) -> dict[int, tuple[list, list]]:
        """For each pass whose slots were not all 0 (the same passes on every rank: the slots are reduced values),
        which parameters some rank used and which units hold an inf or NaN on some rank: one all-reduce (MAX) for
        all of them."""
        suspects = [j for j, (r, v) in enumerate(zip(records, values)) if any(slot != 0 for slot in v[: len(r.units)])]
        if not suspects:
            return {}
        flat: list[int] = []
        for j in suspects:
            record, sums = records[j], values[j][len(records[j].units) :]
            flat += [int(flag) for had in record.had_grad for flag in had]
            flat += [int(not math.isfinite(total)) for total in sums]
        combined = torch.tensor(flat, dtype=torch.uint8).to(self.order[0].device)
        self.comm.all_reduce(combined, op=dist.ReduceOp.MAX)
        anywhere = read_on_host(self.comm, combined, "which gradients exist")
        exact: dict[int, tuple[list, list]] = {}
        position = 0
        for j in suspects:
            record = records[j]
            count = sum(map(len, record.had_grad))
            used = anywhere[position : position + count]
            position += count
            sums = len(values[j]) - len(record.units)
            exact[j] = (used, anywhere[position : position + sums])
            position += sums
        return exact

    def _replay(self, records: list[_Unchecked], values: list[list[Any]], exact: dict[int, tuple[list, list]]) -> None:
        """Redo what the end of each backward pass would have done had it read its flags, in order (see [Note:
        flags read at the step])."""
        exists: dict[int, tuple[nn.Parameter, nn.Parameter, bool]] = {}  # by id(shard_param)
        finite: dict[int, tuple[ShardedUnit, bool | None, float]] = {}  # by id(unit): grads_finite so far, its sum
        for j, record in enumerate(records):
            count = len(record.units)
            sums = values[j][count:]
            used, nonfinite = exact.get(j, (None, None))
            position = 0
            for i, unit in enumerate(record.units):
                for k, (param, shard_param, made) in enumerate(zip(unit.params, unit.shard_params, record.started[i])):
                    if made is None:
                        continue
                    here = used is None or bool(used[position + k])
                    earlier = exists.get(id(shard_param), (param, shard_param, True))[2]
                    exists[id(shard_param)] = (param, shard_param, here if made else earlier or here)
                position += len(record.had_grad[i])
                if not record.check_finite:
                    finite[id(unit)] = (unit, None, 0.0)
                    continue
                bad = nonfinite is not None and bool(nonfinite[i])
                if record.fresh[i]:
                    known: bool | None = not bad
                else:  # added to what the unit held: finite if that was and this is
                    before = finite[id(unit)][1] if id(unit) in finite else unit.grads_finite
                    known = False if bad or before is False else (True if before else None)
                finite[id(unit)] = (unit, known, sums[i])
        for param, shard_param, kept in exists.values():
            if not kept:  # no rank made it since it was started afresh: as if it had never been attached
                shard_param.grad = None
                if isinstance(param.grad, GradMarker):
                    param.grad = None
                self._carry.discard(id(param))
        overflowed = []
        for unit, known, total in finite.values():
            # Finite everywhere as far as the slots say, but this rank's sum is not: look at its elements (a sum of
            # finite values can overflow; rare, and only this rank reads them).
            if known and not math.isfinite(total) and not _grads_finite_here(unit.shard_params):
                overflowed.append(unit.name)
            unit.grads_finite = known
        if overflowed:
            raise _overflow_error(overflowed)

    def _attach(self, pending: list[_Reduced], used: list[Any], nonfinite_anywhere: list[Any] | None) -> None:
        """Hand each reduced shard to the ``shard_params`` whose parameter some rank used (``used``, one entry
        per parameter of ``pending``'s units, in order); record ``grads_finite`` where it is known."""
        with passthrough():  # stage 3 has freed most units by now: their parameters' ``.grad`` is read directly
            self._attach_shards(pending, used, nonfinite_anywhere)

    def _attach_shards(self, pending: list[_Reduced], used: list[Any], nonfinite_anywhere: list[Any] | None) -> None:
        position = 0
        for number, reduced in enumerate(pending):
            unit, shard_grad = reduced.unit, reduced.shard
            params, shard_params = unit.params, unit.shard_params
            fresh = self.drop_unwanted(params, shard_params)  # (zeroed by the user since the last reduction)
            # Known exactly only when checked and these gradients are not added to earlier ones (accumulation).
            unit.grads_finite = not nonfinite_anywhere[number] if fresh and nonfinite_anywhere is not None else None
            regions = unit.piece_views(shard_grad)
            for index, (param, shard_param, region) in enumerate(zip(params, shard_params, regions)):
                if used[position + index] and param.requires_grad:
                    if shard_param.grad is None:
                        shard_param.grad = region
                    else:
                        shard_param.grad.add_(region)
            self.put_markers(params, shard_params)
            position += len(reduced.had_grad)

    # ------------------------------------------------------------------ the recorded order (see [Note: reduce order])
    def _proposed_order(self) -> list[ShardedUnit]:
        """The units in the order they completed in this backward pass, then the rest in reverse registration."""
        done = set(self._completed)
        return self._completed + [u for u in reversed(self.units) if u not in done]

    def _settle_order(self, proposal: list[ShardedUnit], hash_max: list[int]) -> None:
        """Adopt ``proposal`` if every rank proposed the same (the all-reduced bytes and complements agree),
        else keep the reverse registration order; either way on every rank alike, from now on."""
        half = len(hash_max) // 2
        same_everywhere = all(a == 255 - b for a, b in zip(hash_max[:half], hash_max[half:]))
        if same_everywhere:
            self.order = proposal
        self.order_agreed = True
        self._completed = []


class _Reduced(NamedTuple):
    """One unit's finished reduction, waiting for ``_attach_pending``."""

    unit: ShardedUnit
    shard: torch.Tensor  # this rank's shard of the averaged gradient (master dtype and device)
    had_grad: list[bool]  # per parameter: whether this rank produced a gradient
    total: torch.Tensor  # the shard's sum in fp32, on the compute device
    unused_anywhere: torch.Tensor  # the reduced unused-parameter slot: positive if some rank left one unused


class _Unchecked(NamedTuple):
    """One backward pass's reductions, attached before their flags were read (see [Note: flags read at the step])."""

    units: list[ShardedUnit]
    had_grad: list[list[bool]]  # per unit, per parameter: whether this rank produced a gradient
    fresh: list[bool]  # per unit: whether its sharded gradients started afresh (``drop_unwanted``)
    started: list[list[bool | None]]  # per unit, per parameter: gradient made here (True), added to (False), neither
    flags: HostValues  # the units' slots, then (``check_finite``) the sums of what their sharded gradients hold
    check_finite: bool


def _grad_sum(shard_params: list[nn.Parameter], device: torch.device) -> torch.Tensor:
    """The sum, in fp32 on ``device``, of the sharded gradients of ``shard_params`` (queued, never read here)."""
    grads = [p.grad for p in shard_params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=device)
    return torch.stack([g.sum(dtype=torch.float32).to(device) for g in grads]).sum()


def _grads_finite_here(shard_params: list[nn.Parameter]) -> bool:
    """Whether every element of this rank's sharded gradients is finite (a host read: only on the rare path)."""
    return all(bool(torch.isfinite(p.grad).all()) for p in shard_params if p.grad is not None)


def _overflow_error(units: list[str]) -> FloatingPointError:
    """This rank's reduced gradients hold an inf or NaN although no rank's gradients did: the sum overflowed in
    the reduce dtype here. The other ranks cannot know it (see [Note: which gradients exist]): this rank stops,
    and they stop at their next collective with its error (``PeerFailureError``)."""
    return FloatingPointError(
        f"the reduced gradients of {', '.join(repr(u) for u in units[:5])} overflowed on this rank: every rank's "
        "gradients were finite, but their sum is not representable in the reduce dtype. Lower the learning rate or "
        "the loss scale, clip gradients, or reduce in float32 (reduce_dtype=torch.float32)."
    )


def _once(action: Callable[[], None]) -> Callable[..., None]:
    """A node post-hook that runs ``action`` the first time only (a graph kept with ``retain_graph=True`` may run
    the node again in a later backward pass)."""
    done = False

    def hook(*_: Any) -> None:
        nonlocal done
        if not done:
            done = True
            action()

    return hook


def _buffer_bytes(unit: ShardedUnit) -> int:
    """Bytes of the full-size buffer a reduction of ``unit`` reads."""
    return reduce_numel(unit) * torch.empty((), dtype=unit.reduce_dtype).element_size()


def _order_hash(units: list[ShardedUnit], order: list[ShardedUnit]) -> list[int]:
    """Eight bytes of a hash of ``order`` (as positions in ``units``), then their complements (255 - b): after a
    MAX over ranks, every byte equals 255 minus its complement's maximum exactly when all ranks sent the same."""
    position = {id(u): i for i, u in enumerate(units)}
    data = list(hashlib.blake2b(repr([position[id(u)] for u in order]).encode(), digest_size=8).digest())
    return data + [255 - b for b in data]


def _event_after_host_copies(pending: list[_Reduced], device: torch.device) -> DeviceEvent | None:
    """A CUDA event recorded behind the copies of sharded gradients to the host, or ``None`` when there are none
    (see [Note: offload copies] in ``unit.py``): the side streams' (see [Note: copies off the compute stream] in
    ``core/streams.py``), else one on the current stream."""
    copies = host_copies_event(r.unit for r in pending)
    if copies is not None:
        return copies
    if device.type != "cuda" or all(r.shard.device == device for r in pending):
        return None
    return record_event(device)
