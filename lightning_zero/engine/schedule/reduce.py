"""The reduce wire protocol: how a unit's full gradients are packed into one buffer, reduce-scattered, and read
back as this rank's shard of the mean (see [Note: which gradients exist] in ``grad_flags.py`` for what the slots say).

Rank ``r``'s chunk of the buffer is range ``r`` of the unit's flat layout followed by one slot, then zeros up to a
16-byte multiple (``reduce_width``: see [Note: aligned chunks] in ``core/layout.py``). Every rank writes
its gradients into the ranges (``_chunk_plan``: at most three copies per parameter whatever the world size) and
the slot (unused parameters, non-finite gradients), divides where the mean needs it, and issues one
reduce-scatter through ``Comm``. ``ReducedGrads`` is that reduction in flight; ``GradReducer`` (``grads.py``)
decides when each unit's reduction is issued and waited for.

Example::

    reduced = reduce_grads(unit, async_op=True)   # the full gradients are dropped
    shard = reduced.wait()                         # this rank's shard of the mean, in the master dtype

[Note: the slot outlives out]
A reduction's output ``out`` is this rank's chunk: its shard of the mean, then its slot. ``wait()`` hands the
shard on, while the slot (``unused_anywhere``) is read only at the end of backward, by
``GradReducer._attach_pending``, with every unit's. Where the shard stays in ``out`` (the master dtype is the
reduce dtype and the master is on the compute device), the slot as a view of ``out`` costs nothing: the sharded
gradient holds ``out`` anyway. Where it leaves ``out`` (copied to the host under ``offload_optimizer``, or cast
to a master dtype of its own), a view would hold all of ``out``'s storage to the end of backward: with offload,
every unit's device gradient would outlive its copy to the host, and the device would end backward holding all
of this rank's sharded gradients. There ``wait()`` clones the slot into a one-element tensor and drops ``out``.

On CUDA the clone is queued on the current stream after the collective's wait (which made that stream wait for
the collective), the copy to the host on the ``"reduce"`` side stream after it waited for the current stream (see
[Note: copies off the compute stream] in ``core/streams.py``), and ``out``'s block goes back to the caching allocator
after them, marked for the side stream (``record_stream``): it is handed to work queued later on the current stream
only once the copy has read it, so nothing reads freed memory. Nothing else keeps
``out``: ``Pending`` lets go of the tensors it held at its wait, and ProcessGroupNCCL releases its stash of them
when a stream waits for the work. The cost: one one-element copy per unit and backward, only where the shard
leaves ``out``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable
from itertools import repeat
from typing import Any

import torch

from lightning_zero.engine.comm.comm import Pending
from lightning_zero.engine.comm.labels import label
from lightning_zero.engine.comm.quantized import reduce_scatter_quantized
from lightning_zero.engine.core.layout import ShardLayout, aligned_numel
from lightning_zero.engine.core.policy import HALF_DTYPES
from lightning_zero.engine.core.streams import AllEvents
from lightning_zero.engine.core.unit import ShardedUnit


def reduce_width(layout: ShardLayout, dtype: torch.dtype) -> int:
    """Elements of each rank's chunk of a reduction of ``layout`` in ``dtype``: its shard of the gradients, one slot
    for the unused-parameter flag (see [Note: which gradients exist] in ``grad_flags.py``), and zeros up to a multiple
    of 16 bytes, so that every chunk starts 16-byte aligned (see [Note: aligned chunks] in ``core/layout.py``).

    Example::

        >>> reduce_width(ShardLayout.from_shapes([torch.Size([10])], world_size=2), torch.float32)  # 5 + 1, then 2
        8
    """
    return aligned_numel(layout.shard_numel + 1, dtype.itemsize)


def reduce_numel(unit: ShardedUnit) -> int:
    """Elements of the buffer a reduction reads: one chunk of ``reduce_width`` per rank."""
    return unit.layout.world_size * reduce_width(unit.layout, unit.reduce_dtype)


def reduce_grads(
    unit: ShardedUnit,
    async_op: bool = False,
    buffer: torch.Tensor | None = None,
    give_back: Callable[[torch.Tensor], None] | None = None,
    check_finite: bool = False,
) -> ReducedGrads:
    """Reduce-scatter the mean of the full gradients in ``reduce_dtype`` (see ``ReducedGrads``); the
    full gradients are dropped. ``buffer`` (``reduce_numel`` elements of ``reduce_dtype``, any content)
    is used instead of a new one and handed to ``give_back`` once the collective is done. With
    ``async_op`` the reduction is in flight on return: ``ReducedGrads.wait()`` before reading it.

    Rank ``r``'s chunk of the buffer is the range ``r`` of the flat layout followed by one slot (then zeros to
    ``reduce_width``), which every rank sets to 1 if it did not produce a gradient for a parameter that requires
    one (else 0): after the reduction each rank's slot is positive exactly when some rank left a parameter unused. With
    ``check_finite`` a rank whose gradients hold an inf or NaN makes the slot NaN, so after the reduction it is
    NaN (on every rank) exactly when some rank's are (see [Note: which gradients exist] in ``grad_flags.py``)."""
    with label("ZeRO::reduce_grads", unit.name):
        numel = unit.layout.shard_numel
        width = reduce_width(unit.layout, unit.reduce_dtype)
        flat_grad = (
            buffer
            if buffer is not None
            else torch.empty(reduce_numel(unit), dtype=unit.reduce_dtype, device=unit.device)
        )
        chunks = flat_grad.view(unit.layout.world_size, width)
        if width > numel + 1:
            chunks[:, numel + 1 :].zero_()  # the alignment padding (summed, and read by ``check_finite``'s sum)
        plan = _reduce_plan(unit.layout)  # where each parameter (and the padding) lands in the chunks
        grads = [p.grad for p in unit.params]
        if unit.layout.padded_numel <= _CONCATENATED_UP_TO and all(map(operator.is_not, grads, repeat(None))):
            # A small unit with every gradient: one concatenation and one copy into the chunks, two dispatches in
            # place of a few per parameter (on a small model, the Python around them is most of the cost).
            everything = [True] * len(grads)
            padding = unit.layout.padded_numel - unit.layout.numel
            if padding:
                grads.append(grads[0].new_zeros(padding))
            # (torch's own flatten: the reshapes and the concatenation in C++, not one Python call per gradient)
            flat = torch._C._nn.flatten_dense_tensors(grads)
            chunks[:, :numel].copy_(flat.view(unit.layout.world_size, numel))
            for param in unit.params:
                param.grad = None
            return _issue_reduction(unit, flat_grad, chunks, everything, False, check_finite, async_op, give_back)
        had_grad = []
        unused_here = False
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        zeroed = [_region(chunks, place) for place in plan[-1]]  # the padding
        for param, grad, places in zip(unit.params, grads, plan):
            had_grad.append(grad is not None)
            if grad is not None:
                source = grad.reshape(-1)
                for place in places:
                    region = _region(chunks, place)
                    targets.append(region)
                    sources.append(source[place[0] : place[0] + region.numel()].view(region.shape))
                param.grad = None
            else:
                unused_here = unused_here or param.requires_grad
                zeroed.extend(_region(chunks, place) for place in places)
        if targets:
            torch._foreach_copy_(targets, sources)  # one dispatch for all the copies
        if zeroed:
            torch._foreach_zero_(zeroed)
        return _issue_reduction(unit, flat_grad, chunks, had_grad, unused_here, check_finite, async_op, give_back)


def _issue_reduction(
    unit: ShardedUnit,
    flat_grad: torch.Tensor,
    chunks: torch.Tensor,
    had_grad: list[bool],
    unused_here: bool,
    check_finite: bool,
    async_op: bool,
    give_back: Callable[[torch.Tensor], None] | None,
) -> ReducedGrads:
    """``reduce_grads`` once the gradients are in ``chunks``: the slots, the division, the reduce-scatter."""
    width = chunks.shape[1]
    numel = unit.layout.shard_numel
    slots = chunks[:, numel]  # each chunk's slot: after its range, before the alignment padding
    slots.fill_(1.0 if unused_here else 0.0)
    if check_finite:
        # The slot becomes NaN if this rank's gradients hold an inf or NaN: their sum is then inf or NaN, and so
        # is the sum times 0 (a sum of finite values that overflows does too, which only sends the step down
        # the exact path). A sum, not a largest magnitude: on a CPU it reads the buffer ten times faster; of
        # the whole buffer, slots included (0 or 1, finite), as one contiguous read.
        slots.add_(flat_grad.sum(dtype=torch.float32).mul_(0))
    # The mean over ranks. Dividing the shard after summing costs 1/N of dividing the full buffer before,
    # and gives DDP's bits whenever N is a power of two (scaling by 2^-k commutes with rounding). In a
    # half-precision reduction, dividing first keeps the sum from overflowing, as DDP does. (A positive
    # slot stays positive either way.)
    world = unit.comm.world_size * (unit.replicate.world_size if unit.replicate is not None else 1)
    divide_first = world > 1 and (unit.reduce_dtype in HALF_DTYPES or world & (world - 1) != 0)
    if divide_first:
        flat_grad.div_(world)
    out = torch.empty(width, dtype=unit.reduce_dtype, device=unit.device)
    if unit.quantize_grads and unit.block_plan is not None:  # see [Note: quantized collectives] in comm/quantized.py
        # (on the wire as int8, the padding left out: each rank's range and slot, as the int8 protocol lays them)
        pending = reduce_scatter_quantized(
            unit.comm, out[: numel + 1], chunks[:, : numel + 1], unit.block_plan, name=unit.name, async_op=async_op
        )
    else:
        pending = unit.comm.reduce_scatter(out, flat_grad, name=unit.name, async_op=async_op)
    divisor = world if world > 1 and not divide_first else None
    return ReducedGrads(unit, out, had_grad, pending, flat_grad, give_back, divisor)


class ReducedGrads:
    """One unit's reduce-scatter, possibly in flight. ``wait()`` returns this rank's shard of the averaged
    gradient, in the master dtype and on the master device, and hands the full-size buffer back for reuse;
    ``total`` is then the shard's sum in fp32, on the compute device (read on the host only with the flags: see
    [Note: offload copies])."""

    def __init__(
        self,
        unit: ShardedUnit,
        out: torch.Tensor,
        had_grad: list[bool],
        pending: Pending | None,
        buffer: torch.Tensor,
        give_back: Callable[[torch.Tensor], None] | None,
        divisor: int | None = None,
    ) -> None:
        self.unit = unit
        self._numel = unit.layout.shard_numel  # of the shard in ``out`` (then the slot, then padding)
        self._divisor = divisor
        self.had_grad = had_grad
        self._out = out
        self._pending = pending
        self._buffer: torch.Tensor | None = buffer
        self._give_back = give_back
        self.total: torch.Tensor | None = None
        # The reduced unused-parameter slot (see ``reduce_grads``), on the compute device: a view of ``out`` until
        # ``wait()``, then a tensor of its own wherever the shard leaves ``out`` (see [Note: the slot outlives out]).
        self.unused_anywhere = out[self._numel : self._numel + 1]
        if pending is None:
            self._release_buffer()

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def _release_buffer(self) -> None:
        if self._buffer is not None and self._give_back is not None:
            self._give_back(self._buffer)
        self._buffer = None

    def wait(self) -> torch.Tensor:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
            self._release_buffer()
        replicate = self.unit.replicate
        if replicate is not None and self.total is None:
            # The shard group's sum, summed across replicas (the unused-parameter slot too: every rank's then).
            replicate.all_reduce(self._out[: self._numel + 1], name=self.unit.name)  # (not the padding)
        if self.total is None:
            shard = self._out[: self._numel]
            if self._divisor is not None:
                shard.div_(self._divisor)
            # Inf or NaN if an element is (or, rarely, when finite values overflow: the reader checks again);
            # summed on the device, before any copy to the host.
            self.total = shard.sum(dtype=torch.float32)
            master = to_master(shard, self.unit)
            if master is not shard:  # see [Note: the slot outlives out]
                self.unused_anywhere = self.unused_anywhere.clone()
            self._out = master
        return self._out


def to_master(shard: torch.Tensor, unit: ShardedUnit) -> torch.Tensor:
    """``shard`` in the unit's master dtype, on its master device (see [Note: offload copies] in
    ``compute_shard.py``). With side streams (offload on CUDA) the copy to the host is queued on the ``"reduce"``
    side stream, behind the compute stream's wait for the reduce-scatter and its division, and an event behind it is
    kept in ``unit.copied_to_host`` (see [Note: copies off the compute stream] in ``core/streams.py``)."""
    shard = shard.to(dtype=unit.master_dtype)
    streams = unit.streams
    if shard.device == unit.master_device and streams is None:
        return shard
    if unit.host_grads is not None:  # pinned, exact, reused (see [Note: exact pinned memory] in core/pinned.py)
        host = unit.host_grads.take(shard.shape, shard.dtype)
    else:
        host = torch.empty(shard.shape, dtype=shard.dtype, device=unit.master_device)
    if streams is None:
        host.copy_(shard, non_blocking=True)
        return host
    side = streams.side_stream("reduce")
    side.wait_stream(streams.current_stream())  # the reduce-scatter's end and the division, as the compute stream has
    with streams.on(side):
        host.copy_(shard, non_blocking=True)
        copied = streams.new_event()
        copied.record(side)
    streams.keep_for(shard, side)  # its block (the compute stream's) is not handed out before the copy has read it
    unit.copied_to_host = copied
    return host


def host_copies_event(units: Iterable[ShardedUnit]) -> Any:
    """An event behind every copy of these units' sharded gradients to the host queued on side streams (``units`` in
    the order their reductions were waited for: the last copy on each stream follows the others), or ``None`` when
    there are none (see [Note: copies off the compute stream] in ``core/streams.py``)."""
    last: dict[int, Any] = {}
    for unit in units:
        if unit.streams is not None and unit.copied_to_host is not None:
            last[id(unit.streams)] = unit.copied_to_host
    if not last:
        return None
    events = list(last.values())
    return events[0] if len(events) == 1 else AllEvents(events)


_Place = tuple[int, int, int, int, int]  # (start in the range, row, column, count, rows): see ``_chunk_plan``

# Units of at most this many elements are packed for their reduction with one concatenation (see ``reduce_grads``).
_CONCATENATED_UP_TO = 1 << 16


def _chunk_plan(width: int, offset: int, numel: int) -> list[_Place]:
    """Where the flat range ``[offset, offset + numel)`` lies in a reduction's chunks (one row per rank: its
    ``width - 1`` elements of the flat layout, then a slot, then any alignment padding, which no place reaches): at
    most three places whatever the world size (a
    partial first row, the full rows between as one 2-D block, a partial last row). Each place is ``(start in
    the range, row, column, count, rows)``: ``count`` elements of one row from ``column`` on when ``rows`` is
    0, else ``rows`` whole rows from ``row`` on."""
    width -= 1
    places: list[_Place] = []
    if numel == 0:  # nothing to place (and in a unit of 0-element parameters, rows of width 0)
        return places
    position, end = offset, offset + numel
    row, column = divmod(position, width)
    if column and position < end:
        count = min(width - column, end - position)
        places.append((position - offset, row, column, count, 0))
        position += count
        row += 1
    full_rows = (end - position) // width
    if full_rows:
        places.append((position - offset, row, 0, width, full_rows))
        position += full_rows * width
        row += full_rows
    if position < end:
        places.append((position - offset, row, 0, end - position, 0))
    return places


def _region(chunks: torch.Tensor, place: _Place) -> torch.Tensor:
    """The view of ``chunks`` a ``_chunk_plan`` place describes."""
    _, row, column, count, rows = place
    if rows:
        return chunks[row : row + rows, :count]
    return chunks[row, column : column + count]


@functools.cache
def _reduce_plan(layout: ShardLayout) -> list[list[_Place]]:
    """Where each parameter of ``layout`` lands in a reduction's chunks, and, last, where the padding does."""
    width = layout.shard_numel + 1
    plan = [_chunk_plan(width, o, n) for o, n in zip(layout.offsets, layout.numels)]
    plan.append(_chunk_plan(width, layout.numel, layout.padded_numel - layout.numel))
    return plan
