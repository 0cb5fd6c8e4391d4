"""The collectives the engine uses, with byte and time accounting.

Every call into ``torch.distributed`` made by the engine goes through ``Comm``, so that:

- backend differences and renamed APIs are handled in one place (torch 2.13 deprecates
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of ``all_gather_single`` /
  ``reduce_scatter_single``; older releases only have the former);
- the bytes each rank sends are counted with the ring model that the ZeRO paper's 2Ψ / 3Ψ
  figures assume: all-gather and reduce-scatter send ``(N - 1) / N`` of the full buffer, an
  all-reduce twice that, a broadcast the whole buffer from its source only.

A world of one process never calls ``torch.distributed`` at all.

[Note: gloo rooted collectives]
gloo's own all-gather and reduce-scatter are slow, and anything built on a temporary full-size
buffer is too: on a CPU a new 100 MB buffer costs more than the bytes it carries (the pages are
faulted in and zeroed by the kernel on first touch; there is no caching allocator to hand back the
last one). On two CPU processes, for a 100 MB flat buffer (medians, ms):

    all-gather:      gloo's own 158-192, all-to-all of a W-fold copy of the shard 95-114,
                     W broadcasts (one from each rank, into its chunk) 28
    reduce-scatter:  all-to-all into a new buffer, then a sum 132-140,
                     W scatters (each rank sends every rank its chunk), then W - 1 adds 42
    all-reduce of the whole buffer (DDP's bucket): 67-72

(at 1000 elements a collective's latency dominates: 0.15 ms for one all-to-all, 0.22 for two
scatters, 0.2 for either all-gather).

So on gloo, ``all_gather`` is one asynchronous ``broadcast`` per rank, rank ``q``'s from its own
chunk of the output (this rank's shard is copied there first unless it already is that chunk):
every rank sends its shard to every other rank once, the bytes a ring sends, and nothing else is
written or allocated. ``reduce_scatter`` is one asynchronous ``scatter`` per rank, rank ``q``
sending chunk ``r`` of its buffer to rank ``r``; on two ranks the peer's chunk lands in the output
shard itself and this rank's own chunk is added to it, with more ranks the peers' chunks land in
a buffer of ``W - 1`` chunks and are summed in rank order. A buffer under 2^16 elements is
gathered or reduce-scattered by one all-to-all instead (one collective's latency, not W; its
temporary is small): on 4 processes sharing 2 cores, 1000 elements take 0.75 ms to gather that
way against 2.8 ms for four broadcasts. Each is a gloo collective (its work can
be waited for with a timeout and waited for again, which the stall report needs; point-to-point
receives cannot: a timed-out receive is cancelled). NCCL keeps its own collectives, which are the
fast ones there.

[Note: streams]
On NCCL, a collective issued with ``async_op=True`` is queued on NCCL's internal stream after an
event on the current (compute) stream, so it reads its input only once the kernels queued before it
have run; ``work.wait()`` makes the current stream wait for it and returns at once: the host never
blocks, and the kernels queued after the wait run after the collective. The engine's rules:

- a buffer handed to a collective is kept alive (``Pending.keep``) until ``wait()``, and is reused
  or freed only after it: the caching allocator is stream-ordered on the compute stream, and the
  wait puts the collective's end on that stream, so a later allocation cannot be written before the
  collective is done reading;
- nothing on the step path reads a device value on the host (``.item()``, ``bool()``,
  ``.tolist()``), except where a decision must be made on the host once per step (see the
  callers);
- the seconds a collective takes are measured between two CUDA events on the compute stream, one
  recorded before it is issued and one after ``wait()``: the time the compute stream would have
  waited for it, overlap excluded. They are read (one host synchronisation) only when the
  statistics are (``CommStats.resolve``, for ``log_stats`` and the benchmarks). On gloo the host
  does block in ``wait()``, and the host time spent there is what is counted.
- ``Comm(run_alone=True)`` issues the collectives even in a process group of one rank, so that one
  GPU runs the NCCL path with its streams, events and buffers (``benchmarks/gpu_check.py``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from lightning_zero.engine.comm.control import (
    CollectiveMismatchError,
    ControlChannel,
    PeerFailureError,
    code_of,
)
from lightning_zero.engine.comm.control import explain_texts as _explain

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# Below this many elements a gloo all-gather or reduce-scatter is one all-to-all: one collective's latency instead
# of one per rank (see [Note: gloo rooted collectives]).
_ONE_ALL_TO_ALL_BELOW = 1 << 16
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CollectiveStats:
    """Calls, bytes sent by this rank and seconds spent, for one kind of collective."""

    calls: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0


@dataclass
class CommStats:
    """Per-kind accounting; ``reset()`` between steps to read per-step figures."""

    by_kind: dict[str, CollectiveStats] = field(default_factory=lambda: defaultdict(CollectiveStats))
    # CUDA event pairs of collectives not yet read (see [Note: streams]); added to ``seconds`` by ``resolve``.
    timed_on_device: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)

    def record(self, kind: str, bytes_sent: int, seconds: float) -> None:
        entry = self.by_kind[kind]
        entry.calls += 1
        entry.bytes_sent += bytes_sent
        entry.seconds += seconds

    def add_seconds(self, kind: str, seconds: float) -> None:
        """Time spent waiting for an asynchronous collective counted in ``record`` when it was issued."""
        self.by_kind[kind].seconds += seconds

    def resolve(self) -> None:
        """Add the device time of the collectives timed with CUDA events (waits for the last of them: one host
        synchronisation, made only when the figures are read)."""
        for kind, start, end in self.timed_on_device:
            end.synchronize()
            self.by_kind[kind].seconds += start.elapsed_time(end) / 1000.0
        self.timed_on_device.clear()

    @property
    def bytes_sent(self) -> int:
        return sum(s.bytes_sent for s in self.by_kind.values())

    def calls(self, kind: str) -> int:
        return self.by_kind[kind].calls if kind in self.by_kind else 0

    def reset(self) -> None:
        self.by_kind.clear()
        self.timed_on_device.clear()

    def snapshot(self) -> CommStats:
        """A copy of the counters as they are now (``since`` subtracts one)."""
        self.resolve()
        copy = CommStats()
        for kind, entry in self.by_kind.items():
            copy.by_kind[kind] = CollectiveStats(entry.calls, entry.bytes_sent, entry.seconds)
        return copy

    def since(self, earlier: CommStats) -> CommStats:
        """What was counted after ``earlier`` was taken."""
        delta = CommStats()
        for kind, entry in self.by_kind.items():
            before = earlier.by_kind.get(kind, CollectiveStats())
            delta.by_kind[kind] = CollectiveStats(
                entry.calls - before.calls, entry.bytes_sent - before.bytes_sent, entry.seconds - before.seconds
            )
        return delta

    def as_dict(self) -> dict[str, dict[str, float]]:
        self.resolve()
        return {
            k: {"calls": v.calls, "bytes_sent": v.bytes_sent, "seconds": v.seconds} for k, v in self.by_kind.items()
        }


class Pending:
    """An asynchronous collective in flight. ``wait()`` blocks until it is done (idempotent); the time
    spent blocked, not the time it overlapped with other work, counts as time in collectives.

    ``keep`` holds tensors the collective reads or writes, so that they live until it completes.
    """

    def __init__(
        self,
        stats: CommStats,
        kind: str,
        work: dist.Work | None,
        *keep: torch.Tensor,
        wait: Callable[[dist.Work], None] | None = None,
        issued: torch.cuda.Event | None = None,
    ) -> None:
        self._stats = stats
        self._kind = kind
        self._work = work
        self._keep = keep
        self._wait = wait
        self._issued = issued  # on CUDA: an event recorded on the compute stream before the collective was issued
        self._then: Callable[[], None] | None = None

    def then(self, finish: Callable[[], None]) -> Pending:
        """Run ``finish`` once the collective is done (in ``wait``, or now if it already is)."""
        if self._work is None:
            finish()
        else:
            self._then = finish
        return self

    @property
    def done(self) -> bool:
        return self._work is None

    def wait(self) -> None:
        if self._work is None:
            return
        work, self._work = self._work, None
        start = time.perf_counter()
        try:
            if self._wait is not None:
                self._wait(work)
            else:
                work.wait()
        finally:
            self._keep = ()
        if self._then is not None:
            self._then()
            self._then = None
        if self._issued is not None:  # see [Note: streams]
            done = torch.cuda.Event(enable_timing=True)
            done.record()
            self._stats.timed_on_device.append((self._kind, self._issued, done))
        else:
            self._stats.add_seconds(self._kind, time.perf_counter() - start)


class _Works:
    """The works of several collectives that make one (see [Note: gloo rooted collectives]), waited for as one: a
    wait with a timeout that expires can be repeated, as with a single gloo collective."""

    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self._works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout=timeout)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


CollectiveChecks = Literal["auto", "all", "off"]
_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
_OP_ROW, _STEP_ROW, _EVENT_ROW = 1, 2, 3  # the first number of an agreement row (see control.py)


class Comm:
    """Collectives over one process group, counted in ``stats``, checked against what the other ranks do.

    [Note: collective checks]
    Ranks that are about to issue different collectives must get an error, never a deadlock or
    the wrong data (see [Note: agreements] in ``control.py``), without paying for it on every
    collective. A *sequence* is what one rank does from the start of a step to the start of the
    next: the strategies open one per step with ``begin_sequence(key, row, describe)``, an
    agreement in which every rank says which step it is about to run (phase, counters, the hash
    of its trainable set). Every collective of the step is then compared, on the host, with the
    sequence the previous step of the same ``key`` ran:

    - the same kind, unit and size at the same position: issued at once, no check (*on track*);
    - anything else (the first step of each key, a branch taken for the first time, one call more
      or less of a unit): this and every later collective of the step are agreed first.

    The sequence a step ran then becomes the reference for the next. Every rank holds the same
    reference: a step ends without error only if, at every position, either every rank was on
    track (so did the same thing) or every rank agreed it. A rank that leaves the track while
    another does not is caught by the stall report ([Note: stall reports]): one rank waits in an
    agreement, the other in a collective the first will not issue. Outside steps (setup, a
    callback reading ``state_dict()``, a checkpoint) the collectives whose order depends on
    control flow (stage-3 gathers, ``guard=True``) are agreed one by one, as before. So, on the
    step path: one agreement per step, no device synchronisation, nothing per unit.

    A step that needs no collective may run a different number of times on each rank (evaluation
    under stages 1 and 2 with uneven data, as DDP allows): ``defer_sequence`` opens it without an
    agreement, and its first collective, if it issues one, agrees on the step first; one that
    issues none costs nothing and needs nothing of the other ranks.

    ``checks="auto"`` is the above; ``"all"`` agrees every collective (a debugging mode); ``"off"``
    agrees nothing (the stall report still turns a deadlock into an error).

    Example::

        comm = Comm(group=None)             # the default process group (or a world of 1)
        comm.all_gather(full, shard)        # full.numel() == shard.numel() * comm.world_size
        comm.reduce_scatter(shard, full)    # sum over ranks
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        checks: CollectiveChecks = "auto",
        control: ControlChannel | None = None,
        run_alone: bool = False,
        stage: int | None = None,
    ) -> None:
        if checks not in ("auto", "all", "off"):
            raise ValueError(f"checks must be 'auto', 'all' or 'off', got {checks!r}")
        self.group = group
        initialized = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if initialized else 1
        self.rank = dist.get_rank(group) if initialized else 0
        # A world of one skips every collective, unless ``run_alone`` (a process group of one rank must exist):
        # then they run for real, so that one GPU exercises the NCCL path, its streams and its buffers.
        self._skip = self.world_size == 1 and not (run_alone and initialized)
        self.stats = CommStats()
        self.checks = checks
        self.control = control if not self._skip else None
        self.stage = stage  # the ZeRO stage these collectives serve, if known: only the advice in errors depends on it
        self._codes: dict[str, int] = {}  # a unit's name -> its code in agreement rows (computed once)
        # See [Note: gloo rooted collectives].
        self.rooted = not self._skip and self.world_size > 1 and dist.get_backend(group) == "gloo"
        self._global_ranks = (
            [dist.get_global_rank(group, r) if group is not None else r for r in range(self.world_size)]
            if initialized
            else [0]
        )
        # A wait on NCCL orders streams and returns: only host-side waits need the stall report.
        self._waits_block_host = not self._skip and dist.get_backend(group) != "nccl"
        # See [Note: collective checks].
        self._references: dict[str, list[tuple[int, int, int]]] = {}
        self._key: str | None = None
        self._step_text = ""
        self._sequence: list[tuple[int, int, int]] = []
        self._on_track = False
        self._deferred: tuple[str, list[int], Callable[[], str]] | None = None  # see ``defer_sequence``
        self._outstanding = 0
        self.broken = False  # a check failed while collectives were in flight: this group can no longer be used
        # The Comm whose sequence checks this one's collectives: itself, or the world's for a ``subgroup``.
        self._checker: Comm = self

    @property
    def skips_collectives(self) -> bool:
        """Whether this is a world of one whose collectives are skipped (then it has no control channel)."""
        return self._skip

    def subgroup(self, group: dist.ProcessGroup) -> Comm:
        """A ``Comm`` over ``group`` (a process group made on every rank of this one, e.g. a shard group of
        hybrid sharding) whose collectives are checked in *this* Comm's sequence (see [Note: collective checks]):
        every rank of this Comm's group issues them at the same positions, whichever subgroup it is in, so one
        sequence and one stall report cover both. Its bytes are counted in its own ``stats``. A subgroup of one
        rank skips its collectives.

        Example::

            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            shard_comm = world_comm.subgroup(mesh.get_group("shard"))
        """
        child = Comm(group, checks=self.checks, control=self.control, stage=self.stage)
        child._checker = self
        return child

    # ------------------------------------------------------------------ sequences and agreements
    def begin_sequence(self, key: str, row: list[int] | None, describe: Callable[[], str]) -> None:
        """A step starts on every rank (see [Note: collective checks]): agree on ``row`` (at most six
        integers, e.g. phase and step counters; ``None`` when the caller has just agreed on the step with
        ``agree_step``) and compare this step's collectives with the last step of ``key``. ``describe()``
        says, for an error message, which step this rank is starting."""
        if row is not None:
            self.agree_step(row, describe)
        else:
            self.end_sequence()
        if self.control is None or self.checks == "off":
            return
        self._key = key
        self._step_text = describe()
        self._sequence = []
        self._on_track = self.checks == "auto" and key in self._references

    def defer_sequence(self, key: str, row: list[int], describe: Callable[[], str]) -> None:
        """A step that ranks may run different numbers of times, as long as it issues no collective (evaluation under
        stages 1 and 2, whose forward needs none): nothing is agreed now, and the step's first collective, if it
        issues one, first agrees on ``row`` and opens the sequence, as ``begin_sequence(key, row, describe)`` would
        have (so a rank that has finished its batches, and is elsewhere, is named). Ends the current sequence;
        ``end_sequence`` (call it when the step ends) drops a deferred step that issued nothing."""
        self.end_sequence()
        if self.control is None or self.checks == "off":
            return
        self._step_text = describe()
        self._deferred = (key, row, describe)

    def continue_sequence(self, key: str, describe: Callable[[], str]) -> None:
        """Go on with the sequence opened by ``begin_sequence(..., None, ...)`` right after the step's agreement,
        now known to be a step of ``key`` (the collectives issued so far, at the start of a training batch,
        are compared with ``key``'s reference from here on); begin one if nothing is open (something in between
        agreed an event and ended it)."""
        if self._key is None:
            self.begin_sequence(key, None, describe)
            return
        if key == self._key:
            return
        self._key = key
        reference = self._references.get(key)
        issued = len(self._sequence)
        self._on_track = self._on_track and reference is not None and reference[:issued] == self._sequence[:issued]

    def agree_step(self, row: list[int], describe: Callable[[], str], shared: int = 0) -> list[int] | None:
        """Agree that every rank is about to start the step ``row`` describes (ends the current sequence).
        Returns every rank's ``shared`` (carried along, not compared; see ``ControlChannel.agree``), or ``None``
        when checks are off and nothing was exchanged."""
        self.end_sequence()
        if self.control is not None and self.checks != "off":
            return self._agree([_STEP_ROW, *row], lambda: f"start {describe()}", self._advice, shared)
        return None

    def end_sequence(self) -> None:
        """The step is over (the next one, or something outside steps, follows): its collectives become the
        reference for the next step of the same key."""
        if self._key is not None:
            self._references[self._key] = self._sequence
        self._key = None
        self._sequence = []
        self._deferred = None

    def agree_event(
        self,
        name: str,
        describe: Callable[[], str],
        *numbers: int,
        explain: Callable[[list[str]], str] | None = None,
    ) -> None:
        """Every rank is about to do ``name`` (a checkpoint save, a barrier, a teardown): make sure it is so,
        or raise ``CollectiveMismatchError`` naming what each rank was doing (and ``explain``'s advice).
        Ends the current sequence."""
        self.end_sequence()
        if self.control is not None and self.checks != "off":
            self._agree([_EVENT_ROW, code_of(name), *numbers], describe, explain or self._advice)

    def _agree(
        self, row: list[int], describe: Callable[[], str], explain: Callable[[list[str]], str], shared: int = 0
    ) -> list[int]:
        assert self.control is not None
        if self.broken:
            raise CollectiveMismatchError(_BROKEN)
        before = self.control.bytes_sent
        start = time.perf_counter()
        try:
            return self.control.agree(row, describe, explain, shared, advice=self._advice)
        except (CollectiveMismatchError, PeerFailureError):
            self.broken = self.broken or self._outstanding > 0 or self.control.broken
            raise
        finally:
            self.stats.record("check", self.control.bytes_sent - before, time.perf_counter() - start)

    def _advice(self, texts: list[str]) -> str:
        """What to change, from what the ranks were doing (for this Comm's stage)."""
        return _explain(texts, self.stage)

    def _describer(self, kind: str, name: str, numel: int, position: int | None) -> Callable[[], str]:
        """What this collective is, for a report; formatted only if a report is made (not on the step path)."""
        step = self._step_text

        def describe() -> str:
            where = f"collective {position + 1} of {step}" if position is not None else "outside a step"
            if position is None and step:
                where += f", after {step}"
            return f"{kind} of {name!r} ({numel} elements, {where})"

        return describe

    def _before(self, kind: str, name: str, numel: int, guard: bool) -> Callable[[], str]:
        """Track (and, where needed, agree on) the collective about to be issued; returns its description."""
        if self.broken:
            raise CollectiveMismatchError(_BROKEN)
        if self.control is None or self.checks == "off":
            return self._describer(kind, name, numel, None)
        if self._deferred is not None:  # the first collective of a deferred step: agree on the step first
            key, row, describe_step = self._deferred
            self.begin_sequence(key, row, describe_step)
        code = self._codes.get(name)
        if code is None:
            code = self._codes[name] = code_of(name)
        if self._key is None:
            describe = self._describer(kind, name, numel, None)
            if guard or self.checks == "all":
                self._agree([_OP_ROW, _KINDS.index(kind), code, numel], describe, self._advice)
            return describe
        entry = (_KINDS.index(kind), code, numel)
        position = len(self._sequence)
        self._sequence.append(entry)
        describe = self._describer(kind, name, numel, position)
        reference = self._references.get(self._key)
        if self._on_track and reference is not None and position < len(reference) and reference[position] == entry:
            return describe
        self._on_track = False
        self._agree([_OP_ROW, *entry, position], describe, self._advice)
        return describe

    def _wait(self, work: dist.Work, index: int, describe: Callable[[], str]) -> None:
        try:
            if self.control is not None and self._waits_block_host:
                self.control.wait(work, "main", index, describe, self._advice)
            else:
                work.wait()
        except (CollectiveMismatchError, PeerFailureError):
            self.broken = True
            raise
        finally:
            self._outstanding -= 1

    def _timed(
        self, kind: str, bytes_sent: int, describe: Callable[[], str], fn, *args, async_op: bool = False, **kwargs
    ) -> Pending | None:
        """Issue ``fn`` asynchronously and count it; wait for it now unless ``async_op``."""
        issued = None
        if args and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
            issued = torch.cuda.Event(enable_timing=True)
            issued.record()
        start = time.perf_counter()
        work = fn(*args, async_op=True, **kwargs)
        self.stats.record(kind, bytes_sent, time.perf_counter() - start)
        index = -1
        if self.control is not None:
            index = self.control.issued["main"]
            self.control.issued["main"] += 1
        checker = self._checker
        checker._outstanding += 1
        pending = Pending(
            self.stats,
            kind,
            work,
            *(a for a in args if isinstance(a, torch.Tensor)),
            wait=lambda w: checker._wait(w, index, describe),
            issued=issued,
        )
        if async_op:
            return pending
        pending.wait()
        return None

    def _ring_bytes(self, tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size() * (self.world_size - 1) // self.world_size

    def all_gather(
        self, output: torch.Tensor, shard: torch.Tensor, name: str = "", guard: bool = False, async_op: bool = False
    ) -> Pending | None:
        """Concatenate every rank's ``shard`` into ``output`` (``shard`` may alias its own chunk). With
        ``async_op``, return a ``Pending`` to wait on before ``output`` is read."""
        if self._skip:
            if output.data_ptr() != shard.data_ptr():
                output.copy_(shard)
            return Pending(self.stats, "all_gather", None) if async_op else None
        describe = self._checker._before("all_gather", name, output.numel(), guard)
        gather, target, source = _all_gather_single, output, shard
        if self.rooted and output.numel() < _ONE_ALL_TO_ALL_BELOW:  # see [Note: gloo rooted collectives]
            gather = dist.all_to_all_single
            source = shard.unsqueeze(0).expand(self.world_size, shard.numel()).contiguous()
        elif self.rooted:
            gather, target = self._broadcasts, output.view(self.world_size, -1)
            own = target[self.rank]
            if own.data_ptr() != shard.data_ptr():
                own.copy_(shard)
        return self._timed(
            "all_gather",
            self._ring_bytes(output),
            describe,
            gather,
            target,
            source,
            group=self.group,
            async_op=async_op,
        )

    def _broadcasts(self, chunks: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool):
        """Row ``q`` of ``chunks`` from rank ``q``, for every ``q`` (an all-gather on gloo: ``shard`` is only kept
        alive)."""
        return _Works(
            [dist.broadcast(chunks[q], src=src, group=group, async_op=True) for q, src in enumerate(self._global_ranks)]
        )

    def _scatters(
        self, received: list[torch.Tensor], chunks: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool
    ):
        """Rank ``q``'s row ``r`` into ``received[q]`` of rank ``r``, for every ``q`` (this rank's own row is its
        own ``received`` entry: the copy onto itself moves nothing)."""
        rows = list(chunks)
        return _Works(
            [
                dist.scatter(
                    received[q], scatter_list=rows if q == self.rank else None, src=src, group=group, async_op=True
                )
                for q, src in enumerate(self._global_ranks)
            ]
        )

    def reduce_scatter(
        self, shard: torch.Tensor, full: torch.Tensor, name: str = "", async_op: bool = False
    ) -> Pending | None:
        """Sum ``full`` over ranks and keep this rank's chunk in ``shard``. With ``async_op``, return a
        ``Pending`` to wait on before ``shard`` is read (``full`` stays alive until then)."""
        if self._skip:
            shard.copy_(full)
            return Pending(self.stats, "reduce_scatter", None) if async_op else None
        describe = self._checker._before("reduce_scatter", name, full.numel(), guard=False)
        bytes_sent = self._ring_bytes(full)
        if not self.rooted:
            return self._timed(
                "reduce_scatter",
                bytes_sent,
                describe,
                _reduce_scatter_single,
                shard,
                full,
                group=self.group,
                async_op=async_op,
            )
        # See [Note: gloo rooted collectives]: every rank's chunk for this one arrives in ``received``.
        world, rank = self.world_size, self.rank
        chunks = full.view(world, -1)
        if full.numel() < _ONE_ALL_TO_ALL_BELOW:
            everyone = torch.empty_like(full)
            received = list(everyone.view(world, -1))
            fn, args = dist.all_to_all_single, (everyone, full)
        else:
            if world == 2:
                received = [shard, shard]
                received[rank] = chunks[rank]
            else:
                spare = iter(torch.empty((world - 1, shard.numel()), dtype=full.dtype, device=full.device))
                received = [chunks[rank] if q == rank else next(spare) for q in range(world)]
            fn, args = self._scatters, (received, chunks)

        def add_up() -> None:
            if world == 2 and received[1 - rank] is shard:  # two ranks: the peer's chunk is in place
                shard.add_(received[rank])  # plus this rank's: the sum in either order, bit for bit
                return
            torch.add(received[0], received[1], out=shard)
            for row in received[2:]:
                shard.add_(row)

        pending = self._timed("reduce_scatter", bytes_sent, describe, fn, *args, group=self.group, async_op=async_op)
        if pending is None:
            add_up()
            return None
        return pending.then(add_up)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        name: str = "",
        guard: bool = False,
    ) -> None:
        """Reduce ``tensor`` over ranks, in place. ``guard``: agree on it first when it comes outside a step (see
        [Note: collective checks]), as stage-3 gathers are."""
        if self._skip:
            return
        describe = self._checker._before("all_reduce", name, tensor.numel(), guard=guard)
        self._timed(
            "all_reduce", 2 * self._ring_bytes(tensor), describe, dist.all_reduce, tensor, op=op, group=self.group
        )

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast from group rank ``src``."""
        if self._skip:
            return
        describe = self._checker._before("broadcast", "", tensor.numel(), guard=False)
        sent = tensor.numel() * tensor.element_size() if self.rank == src else 0
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        self._timed("broadcast", sent, describe, dist.broadcast, tensor, src=global_src, group=self.group)


_BROKEN = (
    "an earlier collective check failed while collectives were in flight, so this process group can no longer be "
    "used: restart the run (see the first error)."
)
