"""Turning full gradients into sharded ones: when, in which order, and where they land. The order is
``reduce_order.py``'s ([Note: reduce order]); what each reduction's flags say, and when they are read,
``grad_flags.py``'s; the module's ``.grad`` meanwhile, ``markers.py``'s.

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

[Note: trainable sets that change]
Which parameters require a gradient may change at any time (``BaseFinetuning`` unfreezing a
backbone, ``toggle_optimizer`` in a GAN loop). Hooks are therefore installed on every parameter,
frozen or not, and a unit is complete when every parameter that requires a gradient *now* has
one. Units in which nothing requires a gradient are skipped, on every rank alike.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from lightning_zero.engine.comm.comm import Comm
from lightning_zero.engine.comm.device_wait import DeviceEvent, read_on_host, record_event, wait_for_device
from lightning_zero.engine.comm.labels import label
from lightning_zero.engine.core.pinned import PinnedPool
from lightning_zero.engine.core.placeholder import passthrough
from lightning_zero.engine.core.unit import ShardedUnit
from lightning_zero.engine.schedule.grad_flags import (
    MAX_UNCHECKED,
    FinishedReduction,
    UncheckedPass,
    attach_exact,
    attach_unchecked,
    exact_flags,
    replay,
)
from lightning_zero.engine.schedule.markers import GradMarker, GradMarkers
from lightning_zero.engine.schedule.reduce import ReducedGrads, host_copies_event, reduce_grads, reduce_numel
from lightning_zero.engine.schedule.reduce_order import order_hash, proposed_order, same_everywhere

UnitCallback = Callable[[ShardedUnit], None]
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class GradReducer(GradMarkers):
    """Reduce-scatters unit gradients into the ``shard_params``' ``.grad`` (see the notes above), and shows which
    exist on the module's parameters (``GradMarkers``: [Note: gradient markers] in ``markers.py``).

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
        super().__init__()
        self.units = units
        # Where the flags of ``_attach_pending`` are combined: every rank (the units' own Comm is the shard group
        # under hybrid sharding; see [Note: hybrid sharding] in mesh.py).
        self.comm = comm if comm is not None or not units else units[0].comm
        self.order = list(reversed(units))  # the reduce order (see [Note: reduce order] in ``reduce_order.py``)
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
        self._pending: list[FinishedReduction] = []
        # Backward passes attached before their flags were read (see [Note: flags read at the step]), and the pinned
        # host buffers their flags are copied into on CUDA (one per pass until the step: accumulation keeps several).
        self._unchecked: list[UncheckedPass] = []
        self._flag_buffers = PinnedPool(keep=8)
        self._expected: dict[ShardedUnit, int] = {}  # per backward: parameters that require a gradient now

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
                self.take_marker(param)

        return hook

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
        carry = self.carry
        for param, shard_param in zip(unit.params, unit.shard_params):
            if isinstance(param.grad, GradMarker):
                self.take_marker(param)  # of a parameter this backward did not reach
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
        self._pending.append(
            FinishedReduction(reduced.unit, shard, reduced.had_grad, reduced.total, reduced.unused_anywhere)
        )

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
            self._unchecked.append(attach_unchecked(pending, device, self.check_finite, self, self._flag_buffers))
            if len(self._unchecked) >= MAX_UNCHECKED:  # (the same count on every rank: each ran these passes)
                self.settle()
            return
        # The first reducing backward pass: the recorded order is settled now, in one small all-reduce (MAX: "on
        # any rank", which cannot overflow at any world size) that also carries which parameters got a gradient
        # and, per unit, whether its reduced gradients hold an inf or NaN (see ``ShardedUnit.grads_finite``; only
        # when ``check_finite``). Its read is this pass's one read on the host.
        self.settle()
        proposal = proposed_order(self._completed, self.units)
        had = [flag for reduced in pending for flag in reduced.had_grad]
        parts = [torch.tensor(had, dtype=torch.uint8).to(device, non_blocking=True)]
        if self.check_finite:
            # A sum is inf or NaN if any element is (and, rarely, when finite values overflow: that only sends the
            # check down its exact path); summed on the device before any copy to the host.
            totals = torch.stack([r.total.to(device) for r in pending])
            parts.append((~torch.isfinite(totals)).to(torch.uint8))
        parts.append(torch.tensor(order_hash(self.units, proposal), dtype=torch.uint8).to(device))
        combined = torch.cat(parts)
        self.comm.all_reduce(combined, op=dist.ReduceOp.MAX)
        flags = read_on_host(self.comm, combined, "which gradients exist, settling the reduce order")
        self._synchronize_copies(pending, device)
        used, flags = flags[: len(had)], flags[len(had) :]
        nonfinite_anywhere = None
        if self.check_finite:
            nonfinite_anywhere, flags = flags[: len(pending)], flags[len(pending) :]
        self._settle_order(proposal, flags)
        with passthrough():  # stage 3 has freed most units by now: their parameters' ``.grad`` is read directly
            attach_exact(pending, used, nonfinite_anywhere, self)

    def _synchronize_copies(self, pending: list[FinishedReduction], device: torch.device) -> None:
        """Wait for the copies of this pass's sharded gradients to the host, if any (see [Note: offload copies] in
        ``core/compute_shard.py``: the host adds into them), through the stall report."""
        copies = _event_after_host_copies(pending, device)
        wait_for_device(self.comm, copies, "the sharded gradients' copies to the host")

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
            exact = exact_flags(records, values, self.comm, self.order[0].device)
            with passthrough():
                replay(records, values, exact, self)

    def discard_unchecked(self) -> None:
        """Forget the flags not read yet (the module is made plain: its sharded gradients go with it)."""
        self._unchecked = []

    def _settle_order(self, proposal: list[ShardedUnit], hash_max: list[int]) -> None:
        """Adopt ``proposal`` if every rank proposed the same (the all-reduced bytes and complements agree),
        else keep the reverse registration order; either way on every rank alike, from now on (see [Note: reduce
        order] in ``reduce_order.py``)."""
        if same_everywhere(hash_max):
            self.order = proposal
        self.order_agreed = True
        self._completed = []


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


def _event_after_host_copies(pending: list[FinishedReduction], device: torch.device) -> DeviceEvent | None:
    """A CUDA event recorded behind the copies of sharded gradients to the host, or ``None`` when there are none
    (see [Note: offload copies] in ``core/compute_shard.py``): the side streams' (see [Note: copies off the compute
    stream] in ``core/streams.py``), else one on the current stream."""
    copies = host_copies_event(r.unit for r in pending)
    if copies is not None:
        return copies
    if device.type != "cuda" or all(r.shard.device == device for r in pending):
        return None
    return record_event(device)
