"""Sequence checks: every rank's collectives compared with what the other ranks do, on the host.

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
another does not is caught by the stall report ([Note: stall reports] in ``stall.py``): one
rank waits in an agreement, the other in a collective the first will not issue. Outside steps (setup, a
callback reading ``state_dict()``, a checkpoint) the collectives whose order depends on
control flow (stage-3 gathers, ``guard=True``) are agreed one by one. So, on the
step path: one agreement per step, no device synchronisation, nothing per unit.

A step that needs no collective may run a different number of times on each rank (evaluation
under stages 1 and 2 with uneven data, as DDP allows): ``defer_sequence`` opens it without an
agreement, and its first collective, if it issues one, agrees on the step first; one that
issues none costs nothing and needs nothing of the other ranks.

``checks="auto"`` is the above; ``"all"`` agrees every collective (a debugging mode); ``"off"``
agrees nothing (the stall report still turns a deadlock into an error).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import torch.distributed as dist

from lightning_zero.engine.comm.advice import explain_texts as _explain
from lightning_zero.engine.comm.control import ControlChannel, PendingAgreement, code_of
from lightning_zero.engine.comm.forward_joins import FORWARD_ROW, ForwardJoins, joinable
from lightning_zero.engine.comm.labels import label
from lightning_zero.engine.comm.stats import CommStats
from lightning_zero.engine.errors import CollectiveMismatchError, PeerFailureError

CollectiveChecks = Literal["auto", "all", "off"]
_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
# The first number of an agreement row (see control.py); 4, FORWARD_ROW: a joined no-grad forward starts (see
# [Note: joined forwards] in engine/schedule/joined.py, and ``forward_joins.py``).
_OP_ROW, _STEP_ROW, _EVENT_ROW = 1, 2, 3


class CollectiveSequence(ForwardJoins):
    """The checks of [Note: collective checks]: which step each rank runs, which collectives it has issued in it,
    the reference each is compared with, and the agreements that settle the rest. ``Comm`` is one (its
    collectives call ``_before`` ahead of each issue and ``_wait`` for each wait); a ``Comm.subgroup`` is checked
    in its parent's sequence. Joined no-grad forwards are checked in sequences of their own (``ForwardJoins``).

    Example::

        comm.begin_sequence("training", [step], lambda: f"training step {step}")   # one agreement
        ...                                                # the step's collectives: compared, agreed if off track
        comm.agree_event("save_checkpoint", lambda: "save_checkpoint('last.ckpt')")
    """

    def __init__(
        self,
        checks: CollectiveChecks,
        control: ControlChannel | None,
        stage: int | None,
        stats: CommStats,
        waits_block_host: bool,
    ) -> None:
        if checks not in ("auto", "all", "off"):
            raise ValueError(f"checks must be 'auto', 'all' or 'off', got {checks!r}")
        super().__init__()
        self.checks = checks
        self.control = control
        self.stage = stage  # the ZeRO stage these collectives serve, if known: only the advice in errors depends on it
        self.stats = stats  # agreements are counted as "check"
        # A wait on NCCL orders streams and returns: only host-side waits need the stall report.
        self._waits_block_host = waits_block_host
        self._codes: dict[str, int] = {}  # a unit's name -> its code in agreement rows (computed once)
        self._references: dict[str, list[tuple[int, int, int]]] = {}
        self._key: str | None = None
        self._step_text = ""
        self._sequence: list[tuple[int, int, int]] = []
        self._on_track = False
        self._deferred: tuple[str, list[int], Callable[[], str]] | None = None  # see ``defer_sequence``
        self._outstanding = 0  # collectives issued and not yet waited for
        self._pending_step: PendingStep | None = None  # see ``agree_step_later``
        self.broken = False  # a check failed while collectives were in flight: this group can no longer be used

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
        self._forwards = 0

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
        return self.agree_step_later(row, describe, shared).result()

    def agree_step_later(self, row: list[int], describe: Callable[[], str], shared: int = 0) -> PendingStep:
        """``agree_step``, issued now and settled by ``result()`` on the returned object, or by itself before this
        sequence's next collective or agreement, whichever comes first: nothing of the step that other ranks must
        join is issued before every rank is known to start it (see [Note: the start of a training batch] in
        ``strategies/agreement.py``). Ends the current sequence."""
        self.end_sequence()
        self.settle_step()
        pending = None
        reissue = None
        start = time.perf_counter()
        control = self.control
        if control is not None and self.checks != "off":
            if self.broken:
                raise CollectiveMismatchError(_BROKEN)

            def reissue() -> PendingAgreement:
                return control.agree_later(
                    [_STEP_ROW, *row],
                    lambda: f"start {describe()}",
                    self._advice,
                    shared,
                    advice=self._advice,
                    accept=joinable,
                )

            pending = reissue()
        self._forwards = 0
        self._pending_step = PendingStep(self, pending, time.perf_counter() - start, reissue)
        return self._pending_step

    def settle_step(self) -> None:
        """Settle the step agreement ``agree_step_later`` issued, if it is still pending (raises what it raises)."""
        if self._pending_step is not None:
            self._pending_step.result()

    def forget_step(self) -> None:
        """Leave the pending step agreement unsettled (after an error on this rank; see
        ``ControlChannel.forget_pending``)."""
        if self._pending_step is not None and self.control is not None:
            self.control.forget_pending()
        self._pending_step = None

    def end_sequence(self) -> None:
        """The step is over (the next one, or something outside steps, follows): its collectives become the
        reference for the next step of the same key."""
        self.close_forward()
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
        while True:
            self.settle_step()
            if self.broken:
                raise CollectiveMismatchError(_BROKEN)
            before = self.control.bytes_sent
            start = time.perf_counter()
            try:
                with label("ZeRO::agree"):
                    pending = self.control.agree_later(
                        row, describe, explain, shared, advice=self._advice, accept=joinable
                    )
                    shared_values = pending.result()
            except (CollectiveMismatchError, PeerFailureError):
                self.broken = self.broken or self._outstanding > 0 or self.control.broken
                raise
            finally:
                self.stats.record("check", self.control.bytes_sent - before, time.perf_counter() - start)
            if not self._serve_joined(pending.joined, row[0]):
                break
        self._elsewhere = pending.joined is not None  # (for a forward's row: the ranks that serve it)
        if row[0] != FORWARD_ROW and not self._in_forward:
            self._passed = False  # every rank is here: none runs a no-grad forward of this rank's last ones any more
        return shared_values

    def _advice(self, texts: list[str]) -> str:
        """What to change, from what the ranks were doing (for this Comm's stage)."""
        return _explain(texts, self.stage)

    def _describer(self, kind: str, name: str, numel: int, position: int | None) -> Callable[[], str]:
        """What this collective is, for a report; formatted only if a report is made (not on the step path)."""
        step = self._step_text

        def describe() -> str:
            # Where the caller says this rank is (``ControlChannel.context``) says more than the open step's counters.
            where = self.control.where() if self.control is not None else None
            if where is None:
                where = f"collective {position + 1} of {step}" if position is not None else "outside a step"
                if position is None and step:
                    where += f", after {step}"
            return f"{kind} of {name!r} ({numel} elements, {where})"

        return describe

    def _before(self, kind: str, name: str, numel: int, guard: bool) -> Callable[[], str]:
        """Track (and, where needed, agree on) the collective about to be issued; returns its description."""
        self.settle_step()
        if self.broken:
            raise CollectiveMismatchError(_BROKEN)
        if self.control is None or self.checks == "off":
            return self._describer(kind, name, numel, None)
        if self._deferred is not None:  # the first collective of a deferred step: agree on the step first
            key, row, describe_step = self._deferred
            self.begin_sequence(key, row, describe_step)
        # Outside a no-grad forward's own collectives, after one: the forward is over here, and this collective is
        # agreed, so that ranks still running no-grad forwards are met and served (see [Note: joined forwards]).
        meet = not self._in_forward and self._passed
        if not self._in_forward:
            self.close_forward()
        code = self._codes.get(name)
        if code is None:
            code = self._codes[name] = code_of(name)
        if self._key is None:
            describe = self._describer(kind, name, numel, None)
            if guard or self.checks == "all" or meet:
                self._agree([_OP_ROW, _KINDS.index(kind), code, numel], describe, self._advice)
            return describe
        entry = (_KINDS.index(kind), code, numel)
        position = len(self._sequence)
        self._sequence.append(entry)
        describe = self._describer(kind, name, numel, position)
        reference = self._references.get(self._key)
        if self._on_track and reference is not None and position < len(reference) and reference[position] == entry:
            if not meet:
                return describe
        else:
            self._on_track = False
        self._agree([_OP_ROW, *entry, position], describe, self._advice)
        return describe

    def _wait(self, work: dist.Work, index: int, describe: Callable[[], str]) -> None:
        """Wait for ``work``, collective ``index`` of this rank's main group, through the stall report where the
        host blocks in a wait (see [Note: stall reports] in ``stall.py``)."""
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


class PendingStep:
    """A step agreement in flight (``CollectiveSequence.agree_step_later``): ``result()`` waits for it and returns
    every rank's shared value (``None`` when checks are off and nothing was exchanged), or raises what
    ``agree_step`` would have raised; later calls return the same.

    Example::

        pending = comm.agree_step_later([phase, step], lambda: f"training step {step}")
        batch = next(batches)                        # the exchange travels meanwhile
        shared = pending.result()
    """

    def __init__(
        self,
        sequence: CollectiveSequence,
        pending: PendingAgreement | None,
        issue_seconds: float,
        reissue: Callable[[], PendingAgreement] | None = None,
    ) -> None:
        self._sequence = sequence
        self._pending = pending
        self._issue_seconds = issue_seconds
        self._reissue = reissue  # the same agreement again, after serving a joined forward (see ``result``)

    @property
    def exchanges(self) -> bool:
        """Whether anything travels (not with checks off, or in a world of one): ``result()`` is ``None`` if not."""
        return self._pending is not None

    def result(self) -> list[int] | None:
        sequence = self._sequence
        if sequence._pending_step is self:
            sequence._pending_step = None
        while True:
            pending = self._pending
            if pending is None:
                return None
            control = sequence.control
            assert control is not None
            settled = pending.settled
            start = time.perf_counter()
            try:
                with label("ZeRO::agree"):
                    shared = pending.result()
            except (CollectiveMismatchError, PeerFailureError):
                sequence.broken = sequence.broken or sequence._outstanding > 0 or control.broken
                raise
            finally:
                if not settled:  # counted once, as ``agree_step`` counts it: its bytes, the time to issue and wait
                    elapsed = self._issue_seconds + time.perf_counter() - start
                    sequence.stats.record("check", pending.bytes_sent, elapsed)
            if settled:
                return shared
            # Other ranks are in a joined no-grad forward: serve it, then agree on the step again (see [Note:
            # joined forwards] in engine/schedule/joined.py).
            if self._reissue is None or not sequence._serve_joined(pending.joined, _STEP_ROW):
                sequence._passed = False
                return shared
            self._issue_seconds = 0.0
            self._pending = self._reissue()


_BROKEN = (
    "an earlier collective check failed while collectives were in flight, so this process group can no longer be "
    "used: restart the run (see the first error)."
)
