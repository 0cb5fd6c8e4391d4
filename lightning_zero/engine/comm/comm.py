"""The collectives the engine uses, with byte and time accounting.

Every call into ``torch.distributed`` made by the engine goes through ``Comm``, so that:

- backend differences and renamed APIs are handled in one place (torch 2.13 deprecates
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of ``all_gather_single`` /
  ``reduce_scatter_single``; older releases only have the former);
- the bytes each rank sends are counted with the ring model that the ZeRO paper's 2Ψ / 3Ψ
  figures assume: all-gather and reduce-scatter send ``(N - 1) / N`` of the full buffer, an
  all-reduce twice that, a broadcast the whole buffer from its source only.

A world of one process never calls ``torch.distributed`` at all. Beside the transport, in modules of their own:
the counters (``CommStats``, ``stats.py``), the checks that every rank issues the same collectives
(``CollectiveSequence``, ``sequence.py``, which ``Comm`` extends) and the profiler ranges (``labels.py``).

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
- the seconds a collective takes on NCCL are measured, only while statistics are kept
  (``log_stats``), between two CUDA events on a timing stream that follows the collective's own
  stream: the collective's own time, not the compute it overlapped (see [Note: device timing] in
  ``timing.py``). They are read (one host synchronisation) only when the statistics are
  (``CommStats.resolve``). On gloo the host does block in ``wait()``, and the host time spent there
  is what is counted.
- ``Comm(run_alone=True)`` issues the collectives even in a process group of one rank, so that one
  GPU runs the NCCL path with its streams, events and buffers (``benchmarks/gpu_check.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_zero.engine.comm.control import ControlChannel
from lightning_zero.engine.comm.labels import label
from lightning_zero.engine.comm.sequence import CollectiveChecks, CollectiveSequence
from lightning_zero.engine.comm.stats import CommStats

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# Below this many elements a gloo all-gather or reduce-scatter is one all-to-all: one collective's latency instead
# of one per rank (see [Note: gloo rooted collectives]).
_ONE_ALL_TO_ALL_BELOW = 1 << 16
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# See [Note: profiler labels] in labels.py: a collective's range, and that of a wait for one in flight.
_LABELS = {kind: f"ZeRO::{kind}" for kind in ("all_gather", "reduce_scatter", "all_to_all", "all_reduce", "broadcast")}
_WAIT_LABELS = {kind: f"ZeRO::wait_{kind}" for kind in _LABELS}


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
        device_timed: bool = False,
    ) -> None:
        self._stats = stats
        self._kind = kind
        self._work = work
        self._keep = keep
        self._wait = wait
        self._device_timed = device_timed  # its seconds are counted on the device (see [Note: device timing])
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

    def completed(self) -> bool:
        """Whether the collective has finished, waited for or not (asks the backend; never blocks)."""
        if self._work is None:
            return True
        try:
            return bool(self._work.is_completed())
        except Exception:  # a backend that cannot tell: not known to be complete
            return False

    def wait(self) -> None:
        if self._work is None:
            return
        work, self._work = self._work, None
        start = time.perf_counter()
        try:
            with label(_WAIT_LABELS[self._kind]):
                if self._wait is not None:
                    self._wait(work)
                else:
                    work.wait()
        finally:
            self._keep = ()
        if self._then is not None:
            self._then()
            self._then = None
        if not self._device_timed:  # else counted from its events (see [Note: streams])
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


class Comm(CollectiveSequence):
    """Collectives over one process group, counted in ``stats``, checked against what the other ranks do (see
    [Note: collective checks] in ``sequence.py``, whose checks a ``Comm`` is).

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
        self.group = group
        initialized = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if initialized else 1
        self.rank = dist.get_rank(group) if initialized else 0
        # A world of one skips every collective, unless ``run_alone`` (a process group of one rank must exist):
        # then they run for real, so that one GPU exercises the NCCL path, its streams and its buffers.
        self._skip = self.world_size == 1 and not (run_alone and initialized)
        super().__init__(
            checks,
            control if not self._skip else None,
            stage,
            CommStats(),
            waits_block_host=not self._skip and dist.get_backend(group) != "nccl",
        )
        # See [Note: gloo rooted collectives].
        self.rooted = not self._skip and self.world_size > 1 and dist.get_backend(group) == "gloo"
        self._nccl = not self._skip and dist.get_backend(group) == "nccl"  # collectives on a stream of their own
        self._global_ranks = (
            [dist.get_global_rank(group, r) if group is not None else r for r in range(self.world_size)]
            if initialized
            else [0]
        )
        # The sequence that checks this Comm's collectives: its own, or the world's for a ``subgroup``.
        self._checker: CollectiveSequence = self

    @property
    def skips_collectives(self) -> bool:
        """Whether this is a world of one whose collectives are skipped (then it has no control channel)."""
        return self._skip

    def subgroup(self, group: dist.ProcessGroup) -> Comm:
        """A ``Comm`` over ``group`` (a process group made on every rank of this one, e.g. a shard group of
        hybrid sharding) whose collectives are checked in *this* Comm's sequence (see [Note: collective checks] in
        ``sequence.py``): every rank of this Comm's group issues them at the same positions, whichever subgroup it
        is in, so one sequence and one stall report cover both. Its bytes are counted in its own ``stats``. A
        subgroup of one rank skips its collectives.

        Example::

            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            shard_comm = world_comm.subgroup(mesh.get_group("shard"))
        """
        child = Comm(group, checks=self.checks, control=self.control, stage=self.stage)
        child._checker = self
        return child

    def _timed(
        self, kind: str, bytes_sent: int, describe: Callable[[], str], fn, *args, async_op: bool = False, **kwargs
    ) -> Pending | None:
        """Issue ``fn`` asynchronously and count it; wait for it now unless ``async_op``."""
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        # On NCCL, timed with events while statistics are kept (see [Note: device timing] in timing.py).
        device_timed = self._nccl and self.stats.device_timing is not None and first is not None and first.is_cuda
        start = time.perf_counter()
        if device_timed:
            assert first is not None
            work = self.stats.on_device(kind, first.device, lambda: fn(*args, async_op=True, **kwargs))
        else:
            work = fn(*args, async_op=True, **kwargs)
        self.stats.record(kind, bytes_sent, 0.0 if device_timed else time.perf_counter() - start)
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
            device_timed=device_timed,
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
        with label(_LABELS["all_gather"]):
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
        with label(_LABELS["reduce_scatter"]):
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

            pending = self._timed(
                "reduce_scatter", bytes_sent, describe, fn, *args, group=self.group, async_op=async_op
            )
            if pending is None:
                add_up()
                return None
            return pending.then(add_up)

    def all_to_all(
        self,
        output: torch.Tensor,
        source: torch.Tensor,
        kind: str = "all_to_all",
        name: str = "",
        async_op: bool = False,
    ) -> Pending | None:
        """Row ``q`` of ``source`` (W rows) to rank ``q``, landing in row ``r`` of its ``output``: what a quantized
        reduce-scatter moves (``kind="reduce_scatter"`` counts it as one; see ``quantized.py``). With ``async_op``,
        return a ``Pending`` to wait on before ``output`` is read."""
        if self._skip:
            output.copy_(source)
            return Pending(self.stats, kind, None) if async_op else None
        with label(_LABELS[kind]):
            describe = self._checker._before(kind, name, source.numel(), guard=False)
            return self._timed(
                kind,
                self._ring_bytes(source),
                describe,
                dist.all_to_all_single,
                output,
                source,
                group=self.group,
                async_op=async_op,
            )

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        name: str = "",
        guard: bool = False,
    ) -> None:
        """Reduce ``tensor`` over ranks, in place. ``guard``: agree on it first when it comes outside a step (see
        [Note: collective checks] in ``sequence.py``), as stage-3 gathers are."""
        if self._skip:
            return
        with label(_LABELS["all_reduce"]):
            describe = self._checker._before("all_reduce", name, tensor.numel(), guard=guard)
            self._timed(
                "all_reduce", 2 * self._ring_bytes(tensor), describe, dist.all_reduce, tensor, op=op, group=self.group
            )

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast from group rank ``src``."""
        if self._skip:
            return
        with label(_LABELS["broadcast"]):
            describe = self._checker._before("broadcast", "", tensor.numel(), guard=False)
            sent = tensor.numel() * tensor.element_size() if self.rank == src else 0
            global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
            self._timed("broadcast", sent, describe, dist.broadcast, tensor, src=global_src, group=self.group)
