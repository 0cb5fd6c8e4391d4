"""The stall report that turns a hang into an error: every wait on a collective has a time limit, past which the
ranks' states in the rendezvous store say whether they can still meet.

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
a collective that will never complete, is then aborted (see ``abort_if_broken`` in ``control.py``). Where the host
must wait for the device itself (to read a value), it polls an event and reports that wait the
same way, as a wait behind the last collective it issued (``wait_for_device``; see [Note: waits
for the device] in ``device_wait.py``).
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from lightning_zero.engine.comm.advice import explain_texts
from lightning_zero.engine.comm.blocked_call import direct_collective
from lightning_zero.engine.errors import CollectiveMismatchError, PeerFailureError

LINGER_POLLS = 4  # how long rank 0 waits for the others to read a verdict, in polls (see [Note: every rank is told])
# Between two polls of the device in ``wait_for_device``: from 20 us, doubling, to 1 ms.
_FIRST_PAUSE, _LONGEST_PAUSE = 2e-5, 1e-3


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


class StallReporter:
    """One rank's side of the stall reports (see the note above): its waits on collectives, each with a time limit,
    its state in the rendezvous store, and the monitor thread that reports a main thread blocked in someone else's
    ``torch.distributed`` call. ``issued`` counts the collectives this rank has issued on each group ("main", the
    tensors'; "side", the agreements'), which the reports compare. ``ControlChannel`` (``control.py``) is one.

    Example::

        reporter = StallReporter(store, rank, world_size, poll_seconds=1.0)
        work = dist.all_reduce(tensor, async_op=True)
        reporter.issued["main"] += 1
        reporter.wait(work, "main", 0, lambda: "all_reduce of the loss")   # raises instead of hanging
        reporter.stop_monitor()                                            # at the end of the run
    """

    def __init__(self, store: dist.Store | None, rank: int, world_size: int, poll_seconds: float) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.poll_seconds = poll_seconds
        self.issued: dict[str, int] = {"main": 0, "side": 0}
        self._token = 0
        self.broken = False  # a deadlock was found: collectives may be left in flight on this group
        self.verdict: str | None = None  # a deadlock or failure the monitor found while the main thread was blocked
        self._lock = threading.Lock()  # the store client is shared with the monitor thread
        self._in_wait = False
        self._stop = threading.Event()  # set by ``stop_monitor``: the monitor ends
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

    def stop_monitor(self) -> None:
        """End the monitor thread and wait for it (see [Note: nothing outlives teardown] in ``control.py``)."""
        self._stop.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=self.poll_seconds + 5)
        self._monitor = None

    def where(self) -> str | None:
        """What ``context`` says of where this rank is now (``"in on_train_end, after the training loop"``), or
        ``None``; asked only when a report is made (by the monitor thread too), and never raises."""
        try:
            return self.context() if self.context is not None else None
        except Exception:  # a report must not fail for its decoration
            return None

    # ------------------------------------------------------------------ waits
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
                blocked = None if self._in_wait or frame is None else direct_collective(frame)
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


_WHAT_LIMIT = 2000  # characters of a failure's first line the others are told: every message of this library fits


def _first_line(error: BaseException) -> str:
    """``error``'s type and the first line of its message, as the other ranks are told it (cut, and marked so, only
    past ``_WHAT_LIMIT``: a store value is bytes of memory on rank 0, not a log line)."""
    lines = f"{type(error).__name__}: {error}".strip().splitlines()
    line = lines[0] if lines else type(error).__name__
    return line if len(line) <= _WHAT_LIMIT else f"{line[:_WHAT_LIMIT]} [...]"


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
