"""The flags every reduction carries (which gradients exist, whether they are finite), and how they are read: at
once on the first reducing backward pass, then once per optimizer step for every pass since the last one.

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
them before the optimizer step, so from the second reducing backward pass on, ``GradReducer._attach_pending``
attaches every reduced shard as if every slot were 0 (the common case), and queues the slots and each
unit's gradient sum for the host (``HostValues``: a copy into pinned memory, an event behind it). The
flags of every backward pass since the last step are read together by ``GradReducer.settle``, which every path
that acts on the sharded gradients calls first, on every rank at the same point: the optimizer step
(``ShardedModel.settle_grads``, from the step's pre-hook, ``on_shards`` and the precision plugins),
``nonfinite_grads``, ``grad_norm``, ``drop_grads``; and the end of a backward pass that leaves
``MAX_UNCHECKED`` passes unread. ``settle`` then does what the end of each pass would have done had
it read its flags, in the order of the passes: where a pass's slots were all 0 nothing changes, and
each unit's ``grads_finite`` is known; where one was not, one all-reduce (for all such passes
together) says which parameters some rank used and which units hold an inf or NaN, and the sharded
gradients that no rank made since they were last started afresh are dropped again (with their
markers). An added shard of zeros leaves the sum it is added to as it was (bitwise, but for the sign
of a zero). The sum that ``check_finite``
reads is, for a unit whose gradients accumulate over micro-batches, the sum of what it holds after
the addition: so the finiteness of an accumulated gradient is known from the same read (finite
values whose addition overflows are this rank's overflow, as below). Until ``settle``, a parameter
that no rank used shows a marker as its ``.grad``, and ``grads_finite`` keeps its last value: the
engine's readers settle first. The one host read that is left is the step's, where the
``nonfinite_grads`` policy decides on the host whether the step runs anyway (DDP's ``GradScaler``
reads its found-inf flag in ``step()`` for the same reason); on a CUDA device it waits through the
stall report (see [Note: waits for the device] in ``device_wait.py``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.engine.comm.comm import Comm
from lightning_zero.engine.comm.device_wait import HostValues, read_on_host
from lightning_zero.engine.core.pinned import PinnedPool
from lightning_zero.engine.core.placeholder import passthrough
from lightning_zero.engine.core.unit import ShardedUnit
from lightning_zero.engine.schedule.markers import GradMarkers

MAX_UNCHECKED = 64  # backward passes whose flags may wait for ``settle`` (see [Note: flags read at the step])


class FinishedReduction(NamedTuple):
    """One unit's finished reduction, waiting to be attached (``GradReducer._attach_pending``)."""

    unit: ShardedUnit
    shard: torch.Tensor  # this rank's shard of the averaged gradient (master dtype and device)
    had_grad: list[bool]  # per parameter: whether this rank produced a gradient
    total: torch.Tensor  # the shard's sum in fp32, on the compute device
    unused_anywhere: torch.Tensor  # the reduced unused-parameter slot: positive if some rank left one unused


class UncheckedPass(NamedTuple):
    """One backward pass's reductions, attached before their flags were read (see [Note: flags read at the step])."""

    units: list[ShardedUnit]
    had_grad: list[list[bool]]  # per unit, per parameter: whether this rank produced a gradient
    fresh: list[bool]  # per unit: whether its sharded gradients started afresh (``drop_unwanted``)
    started: list[list[bool | None]]  # per unit, per parameter: gradient made here (True), added to (False), neither
    flags: HostValues  # the units' slots, then (``check_finite``) the sums of what their sharded gradients hold
    check_finite: bool


def attach_unchecked(
    pending: list[FinishedReduction],
    device: torch.device,
    check_finite: bool,
    markers: GradMarkers,
    flag_buffers: PinnedPool,
) -> UncheckedPass:
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
            fresh = markers.drop_unwanted(params, shard_params)  # (zeroed by the user since the last reduction)
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
            markers.put_markers(params, shard_params)
            started.append(made)
            fresh_units.append(fresh)
            if check_finite:
                # What the unit's sharded gradients hold now: this shard, or the sum it was added to.
                sums.append(reduced.total if fresh else _grad_sum(shard_params, device))
    parts = [r.unused_anywhere.float() for r in pending]
    if sums:
        parts.append(torch.stack([total.to(device) for total in sums]))
    return UncheckedPass(
        [r.unit for r in pending],
        [r.had_grad for r in pending],
        fresh_units,
        started,
        HostValues(torch.cat(parts), flag_buffers.take),
        check_finite,
    )


def exact_flags(
    records: list[UncheckedPass], values: list[list[Any]], comm: Comm, device: torch.device
) -> dict[int, tuple[list, list]]:
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
    combined = torch.tensor(flat, dtype=torch.uint8).to(device)
    comm.all_reduce(combined, op=dist.ReduceOp.MAX)
    anywhere = read_on_host(comm, combined, "which gradients exist")
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


def replay(
    records: list[UncheckedPass], values: list[list[Any]], exact: dict[int, tuple[list, list]], markers: GradMarkers
) -> None:
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
            markers.clear_marker(param)
    overflowed = []
    for unit, known, total in finite.values():
        # Finite everywhere as far as the slots say, but this rank's sum is not: look at its elements (a sum of
        # finite values can overflow; rare, and only this rank reads them).
        if known and not math.isfinite(total) and not _grads_finite_here(unit.shard_params):
            overflowed.append(unit.name)
        unit.grads_finite = known
    if overflowed:
        raise _overflow_error(overflowed)


def attach_exact(
    pending: list[FinishedReduction], used: list[Any], nonfinite_anywhere: list[Any] | None, markers: GradMarkers
) -> None:
    """Hand each reduced shard to the ``shard_params`` whose parameter some rank used (``used``, one entry per
    parameter of ``pending``'s units, in order); record ``grads_finite`` where it is known. For the first reducing
    backward pass, whose flags are read at once; under ``passthrough()`` (stage 3 has freed most units by now)."""
    position = 0
    for number, reduced in enumerate(pending):
        unit, shard_grad = reduced.unit, reduced.shard
        params, shard_params = unit.params, unit.shard_params
        fresh = markers.drop_unwanted(params, shard_params)  # (zeroed by the user since the last reduction)
        # Known exactly only when checked and these gradients are not added to earlier ones (accumulation).
        unit.grads_finite = not nonfinite_anywhere[number] if fresh and nonfinite_anywhere is not None else None
        regions = unit.piece_views(shard_grad)
        for index, (param, shard_param, region) in enumerate(zip(params, shard_params, regions)):
            if used[position + index] and param.requires_grad:
                if shard_param.grad is None:
                    shard_param.grad = region
                else:
                    shard_param.grad.add_(region)
        markers.put_markers(params, shard_params)
        position += len(reduced.had_grad)


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
