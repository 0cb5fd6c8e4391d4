"""Agreements between ranks: before something they must do together, every rank says what it is about to do.

[Note: agreements]
Collectives pair up by order, so ranks that take different paths deadlock, or exchange the wrong
data when the sizes happen to match. A ``ControlChannel`` is a second process group, always gloo
on the CPU, next to the one that carries the tensors. Before something that ranks must do together
(a step, a checkpoint save, a barrier, a collective that leaves the recorded order: see
[Note: collective checks] in ``sequence.py``), each rank all-gathers a row of eight integers that
describes what it is about to do. Equal rows: carry on. Different rows: every rank sees the same
rows, exchanges one line of text saying what it was doing, and raises ``CollectiveMismatchError``
naming every rank, before any rank issued the real collective. The exchange is host memory on a
host group: no device synchronisation, and on CUDA it overlaps the kernels already queued. Every wait
of an agreement is one of the stall report's ([Note: stall reports] in ``stall.py``, which a
``ControlChannel`` extends), so a rank that never joins one is named instead of waited for.

[Note: agreements at scale]
gloo's all-gather is a ring: N - 1 steps, each waiting for the one before, so an agreement over 512
ranks is hundreds of network latencies on the host before the step's first collective. From
``TREE_FROM`` ranks on, an agreement is two collectives instead: every rank's row is gathered on rank
0 (one step: the N - 1 messages travel at once) and rank 0 broadcasts the whole table back (gloo's
broadcast is a binomial tree: log2 N steps). Every rank still receives every row, so the comparison,
the shared values and the error are the same. Rank 0 can only broadcast the table once it holds it:
it issues the gather with the agreement and the broadcast when the agreement is settled (its
``result()``); the other ranks issue both at once and wait for the broadcast, so no rank starts the
step before rank 0 has settled. Each collective is counted in ``issued["side"]`` when it is issued,
so a stall report sees rank 0's broadcast as not yet issued until it is. An agreement dropped by
``forget_pending`` is still completed by rank 0, unchecked (the others wait for its broadcast): the
group's collectives stay in the same order on every rank, as they do with an all-gather that
completes on its own. Measured on this project's 2-core machine (``benchmarks/agreement.py``,
oversubscribed processes, 2026-12-03): the ring takes 0.35 ms at 2 ranks (where it stays: one
collective beats two), 2.6 at 4, 10.7 at 8, 90 at 32; the gather and broadcast 1.3 ms at 4, 2.5 at
8, 13 at 32.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_zero.engine.comm.process_exit import close_at_exit
from lightning_zero.engine.comm.stall import StallReporter
from lightning_zero.engine.errors import CollectiveMismatchError

ROW = 8  # integers per agreement row
TREE_FROM = 3  # ranks from which an agreement is a gather and a broadcast (see [Note: agreements at scale])
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def code_of(text: str) -> int:
    """A number for ``text`` that is the same in every process (``hash()`` is salted per process)."""
    return zlib.crc32(text.encode())


class PendingAgreement:
    """An agreement in flight (``ControlChannel.agree_later``): ``result()`` waits for it, compares the rows and
    returns every rank's shared value, or raises ``CollectiveMismatchError``; later calls return the same values.

    Example::

        pending = control.agree_later([1, step], lambda: f"training step {step}")
        ...                                          # work that issues no collective
        shared = pending.result()
    """

    def __init__(
        self,
        channel: ControlChannel,
        works: list[tuple[dist.Work, int]],
        everyone: torch.Tensor,
        describe: Callable[[], str],
        explain: Callable[[list[str]], str] | None,
        advice: Callable[[list[str]], str] | None,
        relay: bool = False,
        accept: Callable[[list[list[int]]], bool] | None = None,
    ) -> None:
        self.channel = channel
        self.works = works  # each collective in flight, with its number on the side group
        self.everyone = everyone
        self.describe = describe
        self.explain = explain
        self.advice = advice
        # Rank 0 of a gathered agreement: the table is broadcast once the gather is in (see [Note: agreements at
        # scale]); until then this rank owes the others that broadcast.
        self.relay = relay
        # Rows that differ and are still no mismatch (``accept``: see ``ControlChannel.agree``); ``joined`` holds
        # every rank's row once ``accept`` has taken them.
        self.accept = accept
        self.joined: list[list[int]] | None = None
        world = channel.world_size
        table = everyone.numel() * 8
        # Bytes this rank sends, on average over the ranks: an all-gather sends (N - 1)/N of the table; a gather
        # sends one row from each of N - 1 ranks, and the broadcast N - 1 copies of the table.
        self.bytes_sent = (table if world < TREE_FROM else table // world + table) * (world - 1) // world
        self._shared: list[int] | None = None
        self._error: BaseException | None = None

    @property
    def settled(self) -> bool:
        return self._shared is not None or self._error is not None

    def result(self) -> list[int]:
        if self._error is not None:
            raise self._error
        if self._shared is None:
            try:
                self._shared = self.channel._settle(self)
            except BaseException as error:  # settled once: the rows are compared (and the texts exchanged) once
                self._error = error
                raise
        return self._shared


class ControlChannel(StallReporter):
    """A CPU gloo group for agreements (see the notes above), whose waits are stall reports (``StallReporter``).

    Example::

        control = ControlChannel.create()            # on every rank, after init_process_group
        control.agree([1, step], lambda: f"training step {step}")
        control.wait(work, "main", index, lambda: "all_gather of 'blocks.0'")
    """

    def __init__(
        self, group: dist.ProcessGroup, store: dist.Store | None, rank: int, world_size: int, poll_seconds: float
    ) -> None:
        self.group: dist.ProcessGroup | None = group
        self.bytes_sent = 0
        # Every rank's row of the last agreement; reused by the next one, and ``None`` while an agreement is in
        # flight (one that raised may leave its collective running: the next agreement takes a new buffer).
        self._everyone: torch.Tensor | None = None
        self._pending: PendingAgreement | None = None  # see ``agree_later``
        self.closed = False  # see ``close``
        super().__init__(store, rank, world_size, poll_seconds)  # last: it starts the monitor thread

    @classmethod
    def create(cls, poll_seconds: float = 1.0, run_alone: bool = False) -> ControlChannel | None:
        """The channel over all ranks, or ``None`` in a world of one. Creating one is a collective (call it on
        every rank); later calls with the same default process group return the same channel, unless a
        deadlock left it unusable (``broken``). ``run_alone``: a channel even in a world of one (see ``Comm``)."""
        global _current
        if not (dist.is_available() and dist.is_initialized()) or (dist.get_world_size() == 1 and not run_alone):
            return None
        world = dist.group.WORLD
        if _current is not None and _current[0] is world and not (_current[1].broken or _current[1].closed):
            return _current[1]
        number = _current[2] + 1 if _current is not None else 0
        group = dist.new_group(backend="gloo")
        try:
            base = dist.distributed_c10d._get_default_store()
            store: dist.Store | None = dist.PrefixStore(f"lightning_zero/control/{number}/", base)
        except (AttributeError, RuntimeError, ValueError):
            store = None  # agreements still work; stalls are left to the process group's timeout
        channel = cls(group, store, dist.get_rank(), dist.get_world_size(), poll_seconds)
        _current = (world, channel, number)
        close_at_exit(channel)
        return channel

    # ------------------------------------------------------------------ agreements
    def agree(
        self,
        row: Sequence[int],
        describe: Callable[[], str],
        explain: Callable[[list[str]], str] | None = None,
        shared: int = 0,
        advice: Callable[[list[str]], str] | None = None,
        accept: Callable[[list[list[int]]], bool] | None = None,
    ) -> list[int]:
        """Check that every rank passes the same ``row`` (at most eight integers); otherwise raise
        ``CollectiveMismatchError`` on every rank with each rank's ``describe()`` and ``explain``'s advice.
        ``shared`` travels along without being compared: every rank's value is returned (e.g. a flag that rank
        0 announces to the others, so that it needs no exchange of its own). ``advice``: as for ``wait``, should
        the ranks deadlock while this rank waits for the agreement. ``accept``: rows that differ but are no
        mismatch (``accept(rows)`` is true: the same answer on every rank, since every rank holds the same rows);
        then nothing is raised, and the pending agreement's ``joined`` holds the rows (see [Note: joined
        forwards] in ``engine/schedule/joined.py``)."""
        return self.agree_later(row, describe, explain, shared, advice, accept).result()

    def agree_later(
        self,
        row: Sequence[int],
        describe: Callable[[], str],
        explain: Callable[[list[str]], str] | None = None,
        shared: int = 0,
        advice: Callable[[list[str]], str] | None = None,
        accept: Callable[[list[list[int]]], bool] | None = None,
    ) -> PendingAgreement:
        """``agree``, issued now and settled by ``result()`` on the returned object: the exchange travels while
        the caller works on (see [Note: the start of a training batch] in ``strategies/agreement.py``). One
        agreement is pending at a time: the next one, issued here or by ``agree``, settles it first."""
        if len(row) > ROW:
            raise ValueError(f"an agreement row holds at most {ROW} integers, got {len(row)}")
        self.settle_pending()
        # Built and compared as Python lists: a tensor operation costs microseconds of dispatch, and this runs once
        # per step.
        values = [int(v) & 0x7FFFFFFFFFFFFFFF for v in row]
        mine = torch.tensor([*values, *[0] * (ROW - len(values)), int(shared)], dtype=torch.int64)
        everyone, self._everyone = self._everyone, None
        if everyone is None:
            everyone = torch.empty((ROW + 1) * self.world_size, dtype=torch.int64)
        index = self.issued["side"]
        relay = False
        if self.world_size < TREE_FROM:
            self.issued["side"] += 1
            works = [(_all_gather_single(everyone, mine, group=self.group, async_op=True), index)]
        elif self.rank == 0:  # see [Note: agreements at scale]: the broadcast follows in ``_settle``
            self.issued["side"] += 1
            rows = list(everyone.view(self.world_size, ROW + 1).unbind())  # (N views in one call)
            works = [(dist.gather(mine, rows, dst=0, group=self.group, async_op=True), index)]
            relay = True
        else:
            self.issued["side"] += 2
            works = [
                (dist.gather(mine, None, dst=0, group=self.group, async_op=True), index),
                (dist.broadcast(everyone, src=0, group=self.group, async_op=True), index + 1),
            ]
        pending = self._pending = PendingAgreement(self, works, everyone, describe, explain, advice, relay, accept)
        self.bytes_sent += pending.bytes_sent
        return pending

    def settle_pending(self) -> None:
        """Settle the agreement issued by ``agree_later`` and not yet settled, if any (raises what it raises)."""
        if self._pending is not None:
            self._pending.result()

    def forget_pending(self) -> None:
        """Leave the pending agreement unsettled (after an error on this rank: its collective completes, or not,
        on its own, and nothing compares its rows). Rank 0 of a gathered agreement still relays the table the
        others wait for (see [Note: agreements at scale]), giving up if the ranks can no longer meet."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.relay:
            try:
                self._wait_all(pending)
            except Exception:  # a peer that failed or is stuck elsewhere: the group may be out of step now
                self.broken = True

    def _wait_all(self, pending: PendingAgreement) -> None:
        """Wait for ``pending``'s collectives, and on rank 0 of a gathered agreement issue the broadcast of the
        table once the gather is in (and wait for it)."""
        describe = pending.describe
        for work, index in pending.works:
            self.wait(
                work, "side", index, lambda: f"waiting for the other ranks to agree on: {describe()}", pending.advice
            )
        pending.works = []
        if pending.relay:
            pending.relay = False
            index = self.issued["side"]
            self.issued["side"] += 1
            work = dist.broadcast(pending.everyone, src=0, group=self.group, async_op=True)
            self.wait(work, "side", index, lambda: f"sending the agreement on: {describe()}", pending.advice)

    def _settle(self, pending: PendingAgreement) -> list[int]:
        if self._pending is pending:
            self._pending = None
        self._wait_all(pending)
        describe = pending.describe
        everyone = pending.everyone
        self._everyone = everyone
        table = everyone.tolist()
        width = ROW + 1
        rows = [table[q * width : q * width + ROW] for q in range(self.world_size)]
        if all(other == rows[0] for other in rows[1:]):
            return [table[q * width + ROW] for q in range(self.world_size)]
        if pending.accept is not None and pending.accept(rows):
            pending.joined = rows
            return [table[q * width + ROW] for q in range(self.world_size)]
        texts: list[Any] = [None] * self.world_size
        self.issued["side"] += 1
        dist.all_gather_object(texts, describe(), group=self.group)
        lines = "\n  ".join(f"rank {r}: {text}" for r, text in enumerate(texts))
        advice = pending.explain(texts) if pending.explain is not None else ""
        raise CollectiveMismatchError(
            f"the ranks are about to do different things that they must do together, so they would deadlock or "
            f"exchange the wrong data:\n  {lines}" + (f"\n{advice}" if advice else "")
        )

    def close(self, destroy_group: bool = True) -> None:
        """End the monitor thread and, with ``destroy_group``, the channel's process group (every rank, after the
        last agreement: the channel is then unusable, and ``create`` makes a new one). Without it (after a failure,
        when a collective may still be in flight on the group) only the thread ends.

        [Note: nothing outlives teardown]
        A thread that asks for the GIL after the interpreter has finalized is ended by ``pthread_exit``, and when
        its stack holds torch's C++ frames (the monitor in a store read, a gloo worker freeing the tensors of its
        last collective) the forced unwind aborts the process with ``terminate called without an active
        exception``, after the run has succeeded. So a run's end stops the monitor and joins it, destroys the
        channel's group and drops the channel's reference to it (the group's worker threads end with the
        object); the default group is destroyed at exit (see [Note: the process group at exit] in
        ``process_exit.py``)."""
        global _current
        self._pending = None
        self.stop_monitor()
        if destroy_group and dist.is_available() and dist.is_initialized():
            with contextlib.suppress(RuntimeError, ValueError):
                dist.destroy_process_group(self.group)
            self.group = None  # the last reference: the group's worker threads end with it
        self.closed = True  # never handed out again


# The channel of the current default process group, and a number that keeps each channel's store keys apart.
_current: tuple[Any, ControlChannel, int] | None = None


def abort_if_broken(comm: Any) -> None:
    """After a failed check with collectives in flight (``comm.broken``): on NCCL, abort the communicator, which
    may hold a collective that can never complete (it would block the process's exit); gloo needs nothing, its
    pending operations end with the connections.

    [Note: NCCL after a mismatch]
    A rank that stays on the recorded track issues its NCCL collectives without waiting on the host,
    so when another rank leaves the track, kernels may be queued that no peer will join. The error
    is raised from the next agreement on the host; the stream behind it stays blocked. Destroying
    the process group would wait for it, so the communicator is aborted instead, as torch's own
    NCCL watchdog does after a timeout; the process can then exit, and the user restarts from a
    checkpoint (nothing written is lost: saves are agreed before any rank writes)."""
    if not getattr(comm, "broken", False) or not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend(comm.group) != "nccl":
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        abort(comm.group)
