"""Agreements between ranks, and the stall report that turns a hang into an error.

[Note: agreements]
Collectives pair up by order, so ranks that take different paths deadlock, or exchange the wrong
data when the sizes happen to match. A ``ControlChannel`` is a second process group, always gloo
on the CPU, next to the one that carries the tensors. Before something that ranks must do together
(a step, a checkpoint save, a barrier, a collective that leaves the recorded order: see
[Note: collective checks] in ``sequence.py``), each rank all-gathers a row of eight integers that
describes what it is about to do. Equal rows: carry on. Different rows: every rank sees the same
rows, exchanges one line of text saying what it was doing, and raises ``CollectiveMismatchError``
naming every rank, before any rank issued the real collective. The exchange is host memory on a
host group: no device synchronisation, and on CUDA it overlaps the kernels already queued.

[Note: stall reports]
An agreement cannot help when one rank waits in a real collective that another rank will never
issue (it took another path without knowing the first one had not). So every wait on a collective
is made with a time limit, ``poll_seconds``; a wait that runs out publishes this rank's state in
the rendezvous store (the ``TCPStore`` that ``init_process_group`` set up: waiting, on which
collective of which group, what that collective is, how many collectives of each group it has
issued) and reads every other rank's. The ranks are deadlocked when every rank waits and no rank's
collective has been issued by all the others (none can be issued any more: everyone is blocked),
seen the same way on two reads in a row (a state left over by a rank that has just moved on is
replaced before the second read). Then every rank raises ``CollectiveMismatchError`` with what
each was doing. A rank that fails publishes ``failed`` and its error, and the ranks waiting for it
raise ``PeerFailureError`` within ``poll_seconds`` instead of waiting for the process group's
timeout. Nothing is published while collectives complete in time: the cost is one store write and
one read per rank and per ``poll_seconds`` of a wait that is already slow.

On NCCL a wait does not block the host (it orders streams), so the host runs on to the next
agreement, which is where ranks that diverged meet and fail; the NCCL communicator, which may hold
a collective that will never complete, is then aborted (see ``abort_if_broken``). Where the host
must wait for the device itself (to read a value), it polls an event and reports that wait the
same way, as a wait behind the last collective it issued (``wait_for_device``; see [Note: waits
for the device] in ``device_wait.py``).

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
import json
import sys
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_zero.engine.comm.advice import explain_texts
from lightning_zero.engine.comm.process_exit import close_at_exit
from lightning_zero.engine.errors import CollectiveMismatchError, PeerFailureError

ROW = 8  # integers per agreement row
TREE_FROM = 3  # ranks from which an agreement is a gather and a broadcast (see [Note: agreements at scale])
LINGER_POLLS = 4  # how long rank 0 waits for the others to read a verdict, in polls (see [Note: every rank is told])
# Between two polls of the device in ``wait_for_device``: from 20 us, doubling, to 1 ms.
_FIRST_PAUSE, _LONGEST_PAUSE = 2e-5, 1e-3
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def code_of(text: str) -> int:
    """A number for ``text`` that is the same in every process (``hash()`` is salted per process)."""
    return zlib.crc32(text.encode())


@dataclass
class _State:
    # "running", "waiting", "failed" (``what`` is the error), "lost" (``what`` is the error of a peer gone: see
    # ``report_failure``) or "mismatch" (``what`` is the message)
    status: str
    token: int
    group: str = ""
    index: int = -1
    issued: dict[str, int] | None = None
    what: str = ""


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


class ControlChannel:
    """A CPU gloo group for agreements, and the store for stall reports (see the notes above).

    Example::

        control = ControlChannel.create()            # on every rank, after init_process_group
        control.agree([1, step], lambda: f"training step {step}")
        control.wait(work, "main", index, lambda: "all_gather of 'blocks.0'")
    """

    def __init__(
        self, group: dist.ProcessGroup, store: dist.Store | None, rank: int, world_size: int, poll_seconds: float
    ) -> None:
        self.group: dist.ProcessGroup | None = group
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.poll_seconds = poll_seconds
        self.issued: dict[str, int] = {"main": 0, "side": 0}
        self._token = 0
        self.broken = False  # a deadlock was found: collectives may be left in flight on this group
        self.bytes_sent = 0
        # Every rank's row of the last agreement; reused by the next one, and ``None`` while an agreement is in
        # flight (one that raised may leave its collective running: the next agreement takes a new buffer).
        self._everyone: torch.Tensor | None = None
        self._pending: PendingAgreement | None = None  # see ``agree_later``
        self.verdict: str | None = None  # a deadlock or failure the monitor found while the main thread was blocked
        self._lock = threading.Lock()  # the store client is shared with the monitor thread
        self._in_wait = False
        self.closed = False  # see ``close``
        self._stop = threading.Event()  # set by ``close``: the monitor ends
        self._monitor: threading.Thread | None = None
        # Where this rank is, when its caller knows better than the open step's counters (a Trainer hook after the
        # training loop, whose collectives the last step's sequence still counts), for reports (``where``).
        self.context: Callable[[], str | None] | None = None
        if store is not None:
            self._publish(_State("running", 0))
            self._monitor = threading.Thread(
                target=self._watch_direct_collectives,
                args=(threading.main_thread().ident,),
                name="lightning_zero stall monitor",
                daemon=True,
            )
            self._monitor.start()

    def where(self) -> str | None:
        """What ``context`` says of where this rank is now (``"in on_train_end, after the training loop"``), or
        ``None``; asked only when a report is made (by the monitor thread too), and never raises."""
        try:
            return self.context() if self.context is not None else None
        except Exception:  # a report must not fail for its decoration
            return None

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

    # ------------------------------------------------------------------ waits (see [Note: stall reports])
    def wait(
        self,
        work: dist.Work,
        group: str,
        index: int,
        describe: Callable[[], str],
        advice: Callable[[list[str]], str] | None = None,
    ) -> None:
        """Wait for ``work`` (collective number ``index`` issued on ``group``, "main" or "side"); raise instead
        of waiting forever when the ranks can no longer meet, with ``advice`` (default: ``explain_texts``) for
        what every rank was waiting in."""
        if self.store is None:
            work.wait()
            return
        limit = timedelta(seconds=self.poll_seconds)
        self._wait_guarded(lambda: _wait_for(work, limit), group, index, describe, advice)

    def wait_for_device(
        self,
        ready: Callable[[], bool],
        index: int,
        describe: Callable[[], str],
        advice: Callable[[list[str]], str] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Wait until ``ready()`` (a CUDA event's ``query``) is true, polling it and sleeping briefly in between,
        where the device must first finish collective ``index`` of the main group (the last one this rank issued):
        reported as a wait for that collective is, so that a peer that will never issue it is named within
        seconds (see [Note: waits for the device] in ``device_wait.py``). ``sleep`` is replaceable for tests."""
        if self.store is None:
            while not ready():
                sleep(_LONGEST_PAUSE)
            return
        self._wait_guarded(lambda: _poll(ready, self.poll_seconds, sleep), "main", index, describe, advice)

    def _wait_guarded(
        self,
        done: Callable[[], bool],
        group: str,
        index: int,
        describe: Callable[[], str],
        advice: Callable[[list[str]], str] | None,
    ) -> None:
        """``_wait_reporting``, with the backend's own error explained by what the other ranks published."""
        try:
            self._wait_reporting(done, group, index, describe, advice)
        except (CollectiveMismatchError, PeerFailureError):
            raise
        except RuntimeError as err:  # the backend's own error, e.g. a peer that found the deadlock first and left
            try:
                found = self._verdict(self._read_all(), None)
            except PeerFailureError as gone:  # no verdict to read: the store went with rank 0
                self.broken = True
                raise PeerFailureError(f"{gone} This rank was waiting in: {describe()} ({err})") from err
            if found is None:
                raise
            self.broken = True
            self._hand_on(found)
            raise found from err

    def _published_verdict(self) -> BaseException | None:
        """A mismatch or failure another rank has published, if the store still answers."""
        try:
            return self._verdict(self._read_all(), None)
        except PeerFailureError:
            return None

    def _wait_reporting(
        self,
        done: Callable[[], bool],
        group: str,
        index: int,
        describe: Callable[[], str],
        advice: Callable[[list[str]], str] | None,
    ) -> None:
        """Wait until ``done()`` (which waits at most ``poll_seconds`` itself) says so; from the second poll on,
        with this rank's state published and every rank's read at each poll (see [Note: stall reports])."""
        if done():
            return
        self._in_wait = True
        self._publish(_State("waiting", 0, group, index, dict(self.issued), describe()))
        previous: list[_State] | None = None
        verdict: BaseException | None = None
        try:
            while not done():
                states = self._read_all()
                verdict = self._verdict(states, previous, advice)
                if verdict is not None:
                    self.broken = True
                    break
                previous = states
        finally:
            self._in_wait = False
            if verdict is None:  # (a verdict is published by _hand_on instead)
                with contextlib.suppress(RuntimeError, OSError):  # the store may be gone with rank 0
                    self._publish(_State("running", 0))
        if verdict is not None:
            self._hand_on(verdict)
            raise verdict

    def _hand_on(self, verdict: BaseException) -> None:
        """Make sure every rank learns ``verdict`` before this one leaves (see [Note: every rank is told]).

        [Note: every rank is told]
        The rank that finds a deadlock, or that fails, is often not the one at fault, and the others learn why
        only from the store: a deadlock is published as ``mismatch`` with its whole text (every rank then raises
        the same ``CollectiveMismatchError``), a failure as ``failed``. Each rank that holds a verdict, raised
        in its own wait or found by its monitor thread while it was blocked in a collective of someone else's,
        writes ``read/<rank>``. Rank 0 hosts the ``TCPStore`` that ``init_process_group`` set up, so it stays,
        before it raises, until every other rank has written that key, at most ``LINGER_POLLS`` polls: a rank
        busy elsewhere cannot read it, and then rank 0 goes, and that rank is told that the store stopped
        answering, with what it was waiting in. The Fabric strategies meet the same code: it runs where the
        verdict is found, not in a Lightning hook."""
        if self.store is None:
            return
        with contextlib.suppress(RuntimeError, OSError):  # best effort: the store may be gone already
            if isinstance(verdict, CollectiveMismatchError):
                self._publish(_State("mismatch", 0, what=str(verdict)))
            self._acknowledge()
            if self.rank == 0:
                self._linger()

    def _acknowledge(self) -> None:
        assert self.store is not None
        with self._lock:
            self.store.set(f"read/{self.rank}", "1")

    def _linger(self) -> None:
        """Rank 0: wait until every other rank has read the verdict, or ``LINGER_POLLS`` polls have passed."""
        assert self.store is not None
        deadline = time.monotonic() + LINGER_POLLS * self.poll_seconds
        unread = list(range(1, self.world_size))
        while unread and time.monotonic() < deadline:
            with self._lock:
                unread = [r for r in unread if not self.store.check([f"read/{r}"])]
            if unread:
                time.sleep(min(0.05, self.poll_seconds))

    def _watch_direct_collectives(self, main: int | None) -> None:
        """The monitor thread: publish a state for the main thread while it is blocked in a collective that
        does not go through this library (``torch.distributed`` called by Lightning, torchmetrics or user code),
        so that the ranks waiting in this library's collectives can see the deadlock; and keep the verdict, to
        explain the error that the blocked call raises once the other ranks have stopped."""
        seen: tuple[int, int] | None = None
        published = False
        previous: list[_State] | None = None
        while not self._stop.wait(self.poll_seconds):
            try:
                frame = sys._current_frames().get(main) if main is not None else None
                blocked = None if self._in_wait or frame is None else _direct_collective(frame)
                if blocked is None:
                    if published and not self._in_wait:
                        self._publish(_State("running", 0))
                    seen, published, previous = None, False, None
                    continue
                where, text = blocked
                if (context := self.where()) is not None:
                    text += f", {context}"
                if where != seen:
                    seen, published, previous = where, False, None
                    continue  # blocked for one poll: may still complete on its own
                if not published:
                    self._publish(_State("waiting", 0, "direct", -1, dict(self.issued), text))
                    published = True
                    continue
                states = self._read_all()
                error = self._verdict(states, previous)
                if error is not None:
                    self.verdict = str(error)
                    self._acknowledge()  # see [Note: every rank is told]
                previous = states
            except Exception:  # the store or the process is going away: nothing left to report
                return

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
        self._stop.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=self.poll_seconds + 5)
        self._monitor = None
        if destroy_group and dist.is_available() and dist.is_initialized():
            with contextlib.suppress(RuntimeError, ValueError):
                dist.destroy_process_group(self.group)
            self.group = None  # the last reference: the group's worker threads end with it
        self.closed = True  # never handed out again

    def explain(self, error: BaseException) -> None:
        """Add what the monitor found (a deadlock), or which rank failed and how, to ``error``'s message (in
        place): a rank that fails and exits shows up here as a closed connection."""
        verdict = self.verdict
        if verdict is None and self.store is not None and not isinstance(error, CollectiveMismatchError):
            found = self._published_verdict()  # a failed rank, or a mismatch it published
            verdict = str(found) if found is not None else None
        if verdict and verdict not in str(error):
            error.args = (f"{error}\nlightning_zero: {verdict}", *error.args[1:])

    def report_failure(self, error: BaseException, secondary: bool = False) -> None:
        """Tell the other ranks, through the store, that this rank failed and why (best effort). A deadlock this
        rank found is passed on as it is, so that every rank raises the same ``CollectiveMismatchError``.
        ``secondary``: a failure that another rank caused (a peer that went away, or one whose failure this rank
        read), published as ``lost``, which names no culprit (see [Note: a failure another rank caused]); otherwise,
        on rank 0, stay until the others have read it (see [Note: every rank is told]).

        [Note: a failure another rank caused]
        A rank that is killed (SIGKILL, the out-of-memory killer, a lost host) publishes nothing. Its neighbours in
        gloo's ring or NCCL's communicator see their connection to it close and fail with the backend's error
        ("Connection closed by peer"), often before the ranks that were not talking to it find anything. Were they
        to publish that as their own failure, the others would name a surviving rank as the one that failed. So
        such a failure is ``lost``: it tells the ranks still waiting to stop (another rank is gone), it names the
        ranks that saw the loss, and a real failure published by any rank is named before it."""
        if self.store is None:
            return
        if isinstance(error, CollectiveMismatchError):
            state = _State("mismatch", 0, what=str(error))
        else:
            state = _State("lost" if secondary else "failed", 0, what=_first_line(error))
        try:
            self._publish(state)
            self._acknowledge()
            if self.rank == 0 and not secondary:  # the others learn it from the store this rank hosts
                self._linger()
        except (RuntimeError, OSError):  # the store's host (rank 0) may be gone already
            pass

    def _publish(self, state: _State) -> None:
        assert self.store is not None
        with self._lock:
            self._token += 1
            state.token = self._token
            self.store.set(f"state/{self.rank}", json.dumps(state.__dict__))

    def _read_all(self) -> list[_State]:
        assert self.store is not None
        keys = [f"state/{r}" for r in range(self.world_size)]
        try:
            with self._lock:
                raw = self.store.multi_get(keys)
        except (RuntimeError, OSError) as err:
            raise PeerFailureError(
                "the rendezvous store stopped answering while this rank waited in a collective: rank 0, which hosts "
                f"it, has probably exited or failed ({err}). Its log says why."
            ) from err
        return [_State(**json.loads(bytes(value).decode())) for value in raw]

    def _verdict(
        self,
        states: list[_State],
        previous: list[_State] | None,
        advice: Callable[[list[str]], str] | None = None,
    ) -> BaseException | None:
        for r, state in enumerate(states):
            if state.status == "mismatch" and r != self.rank:
                return CollectiveMismatchError(state.what)  # found by rank r first: the same error everywhere
        failed = [(r, s) for r, s in enumerate(states) if s.status == "failed" and r != self.rank]
        mine = states[self.rank].what if states[self.rank].status == "waiting" else ""
        waited = f"; rank {self.rank} was waiting for it in: {mine}" if mine else ""
        if failed:
            lines = "; ".join(f"rank {r} failed with {s.what}" for r, s in failed)
            return PeerFailureError(f"{lines}{waited}. The cause is in the failed rank's traceback.")
        lost = [r for r, s in enumerate(states) if s.status == "lost" and r != self.rank]
        if lost:  # see [Note: a failure another rank caused]
            return PeerFailureError(
                f"another rank exited or was killed without reporting an error (rank(s) {', '.join(map(str, lost))} "
                f"lost the connection to it){waited}. Its exit code or the job's log says which and why (SIGKILL, "
                "the out-of-memory killer, a lost host)."
            )
        if previous is None or [(s.status, s.token) for s in states] != [(s.status, s.token) for s in previous]:
            return None
        if any(s.status != "waiting" for s in states):
            return None  # a rank is still working: it may yet issue what the others wait for
        direct = [s.what for s in states if s.group == "direct"]
        if len(direct) == len(states) or len(direct) != len(set(direct)):
            return None  # ranks in the same collective this library does not see: it may just be slow
        for state in states:
            if state.group != "direct" and all((o.issued or {}).get(state.group, 0) > state.index for o in states):
                return None  # every rank has issued this collective: it will complete
        lines = "\n  ".join(f"rank {r}: {s.what}" for r, s in enumerate(states))
        told = (advice or explain_texts)([s.what for s in states]) or (
            "Every rank must run the same collectives in the same order: the same number of steps and batches, the "
            "same submodules in the same order under stage 3, and checkpoint saves, barriers and synced logging on "
            "every rank."
        )
        return CollectiveMismatchError(
            f"the ranks are waiting for each other in different collectives and none can complete (a deadlock), "
            f"found after {2 * self.poll_seconds:.0f} s of waiting:\n  {lines}\n{told}\nSee docs/faults.md."
        )


_COLLECTIVES = frozenset(
    "all_gather all_gather_object all_gather_into_tensor all_gather_single all_reduce all_to_all all_to_all_single "
    "barrier broadcast broadcast_object_list gather gather_object reduce reduce_scatter reduce_scatter_tensor "
    "reduce_scatter_single scatter scatter_object_list monitored_barrier".split()
)


_WHAT_LIMIT = 2000  # characters of a failure's first line the others are told: every message of this library fits


def _first_line(error: BaseException) -> str:
    """``error``'s type and the first line of its message, as the other ranks are told it (cut, and marked so, only
    past ``_WHAT_LIMIT``: a store value is bytes of memory on rank 0, not a log line)."""
    lines = f"{type(error).__name__}: {error}".strip().splitlines()
    line = lines[0] if lines else type(error).__name__
    return line if len(line) <= _WHAT_LIMIT else f"{line[:_WHAT_LIMIT]} [...]"


def _direct_collective(frame: Any) -> tuple[tuple[int, int], str] | None:
    """If ``frame``'s thread is inside a ``torch.distributed`` collective: where (to tell a new call from the
    same one) and a description naming the caller; else ``None``."""
    collective = None
    f = frame
    while f is not None:
        code = f.f_code
        if collective is None and code.co_name in _COLLECTIVES and "torch/distributed" in code.co_filename:
            collective = f
        elif collective is not None and "torch/distributed" not in code.co_filename:
            caller = f"{_short(code.co_filename)}:{f.f_lineno}"
            text = f"torch.distributed.{collective.f_code.co_name}, called from {caller} ({code.co_name})"
            return (id(collective), id(f)), text
        f = f.f_back
    return None


def _short(filename: str) -> str:
    parts = filename.replace("\\", "/").split("/")
    for anchor in ("site-packages", "lightning_zero", "tests"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + (1 if anchor == "site-packages" else 0) :])
    return "/".join(parts[-2:])


def _poll(ready: Callable[[], bool], seconds: float, sleep: Callable[[float], None]) -> bool:
    """Poll ``ready()`` for at most ``seconds``, sleeping between polls from ``_FIRST_PAUSE`` doubling up to
    ``_LONGEST_PAUSE`` (a short wait is seen to end within tens of microseconds, a long one within a millisecond,
    at little CPU); ``False`` if it is still not ready."""
    deadline = time.monotonic() + seconds
    pause = _FIRST_PAUSE
    while not ready():
        if time.monotonic() >= deadline:
            return False
        sleep(pause)
        pause = min(2 * pause, _LONGEST_PAUSE)
    return True


def _wait_for(work: dist.Work, limit: timedelta) -> bool:
    """Wait at most ``limit`` for ``work``; ``False`` if it is still running (errors propagate)."""
    try:
        work.wait(timeout=limit)
    except RuntimeError as err:
        if "timed out" in str(err).lower() and not work.is_completed():
            return False
        raise
    return True


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
