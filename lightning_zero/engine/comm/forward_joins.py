"""The collective checks of joined no-grad forwards: the agreements that start one, the sequences it is checked in,
and a rank that serves one from the agreement it is at (the engine's side is [Note: joined forwards] in
``engine/schedule/joined.py``; the checks are [Note: collective checks] in ``sequence.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from lightning_zero.engine.comm.advice import NO_GRAD_FORWARD, SERVES_FORWARD
from lightning_zero.engine.comm.control import code_of
from lightning_zero.engine.errors import CollectiveMismatchError

# The first number of an agreement row that starts a joined no-grad forward (``sequence.py`` numbers the others).
FORWARD_ROW = 4
# The third number of a FORWARD_ROW that begins a no-grad step of the Fabric door (``begin_no_grad_step``): one that
# ranks elsewhere may serve, and one that begins with a broadcast of rank 0's buffers, which they cannot.
_STEP_START, _STEP_START_BROADCASTS = 1, 2


class ForwardJoins:
    """The joined no-grad forwards' part of a ``CollectiveSequence`` (``sequence.py``), which is one: it starts them
    with the sequence's agreements (``_agree``, ``begin_sequence``, ``end_sequence``, ``settle_step``) and checks
    each in a sequence of its own, swapped in for the step's (``_key``, ``_step_text``, ``_sequence``,
    ``_on_track``, kept in ``_references``); the sequence asks it back whether a forward is open or was passed
    (``close_forward``, ``_passed``, ``_in_forward``) and to serve the others' (``_serve_joined``).

    Example::

        served = comm.begin_no_grad_step("no_grad", first, broadcasts, describe)   # other ranks may serve it
        with comm.forward_collectives() if served else nullcontext():
            root.unshard()                                   # the step's first gathers, in the forward's sequence
    """

    def __init__(self) -> None:
        # Joined no-grad forwards (see [Note: joined forwards] in engine/schedule/joined.py): ``forward_server``
        # issues this rank's part of the gathers of one that other ranks run, or of the first forward of a no-grad
        # step they begin (``(code, step)``; ``None`` once served, or why it cannot be: stage 3 sets it); ``_passed``: a
        # no-grad forward began since this rank last met the others outside one; ``_in_forward``: the collectives
        # being issued are a no-grad forward's own; ``_outer``: the step's sequence while a joined forward's is open.
        self.forward_server: Callable[[int, bool], str | None] | None = None
        self._passed = False
        self._in_forward = 0
        self._outer: tuple[str | None, str, list[tuple[int, int, int]], bool] | None = None
        self._forwards = 0  # joined forwards agreed in this step (their numbers in messages)
        # A no-grad step that other ranks serve (see ``begin_no_grad_step``): the unit its first forward announced it
        # starts at ("" for none), until that forward starts.
        self._announced: str | None = None
        self._elsewhere = False  # in the last agreement, some ranks were at another one (see ``_agree``)

    def begin_no_grad_step(self, key: str, first: str, broadcasts: bool, describe: Callable[[], str]) -> bool:
        """A no-grad step of the Fabric door begins on this rank (forwards under ``no_grad`` outside a training step:
        see [Note: Fabric steps] in ``fabric/wrapper.py``), agreed with a row that the ranks elsewhere serve from
        where they are, as a joined forward's (see [Note: joined forwards] in ``engine/schedule/joined.py``).
        ``first``: the unit at which this rank's last such step began its first forward (``""`` if none), the
        forward the ranks that serve it gather for; ``broadcasts``: the step begins with a broadcast of rank 0's
        buffers, which no rank elsewhere can join (such a row is a mismatch). Ends the current sequence.

        Returns ``False`` when every rank begins it: its collectives are checked in the sequence of ``key``'s
        steps, and its first forward rides on this agreement, as a Trainer step's does. ``True`` when other ranks
        serve it: its collectives up to the end of its first forward (which must start at ``first``) are checked
        in a sequence of their own, the ranks that serve it issue theirs there, that forward is agreed already
        (``begin_no_grad_forward``), and the caller issues the step's first collectives (the root unit's gather)
        inside ``forward_collectives()``."""
        self.end_sequence()
        self.settle_step()
        if self.control is None or self.checks == "off":
            return False
        code = code_of(first) if first else 0
        self._agree(
            [FORWARD_ROW, code, _STEP_START_BROADCASTS if broadcasts else _STEP_START],
            lambda: f"start {describe()}",
            self._advice,
        )
        if not self._elsewhere:
            self._passed = False  # every rank is here: the first forward rides on this agreement
            self.begin_sequence(key, None, describe)
            return False
        self._forwards = 0
        self._step_text = describe()  # (what the later forwards of the step say they are part of)
        self._open_forward(code, self._step_text, step=True)
        self._announced = first
        self._passed = True
        return True

    @property
    def step_served(self) -> bool:
        """A no-grad step that other ranks serve has begun here, and its first forward has not started yet."""
        return self._announced is not None

    def begin_no_grad_forward(self, key: str) -> bool:
        """A no-grad forward starts on this rank, its first unit ``key`` (stage 3, inside a step: see [Note: joined
        forwards] in ``engine/schedule/joined.py``). The first since this rank last met the others outside one
        rides on that meeting: nothing is agreed and its collectives stay in the step's sequence; returns
        ``False``. A later one is agreed (every rank runs it, or serves it from the agreement it is in) and checked
        in a sequence of its own, keyed by ``key``; returns ``True``."""
        if self._announced is not None:  # the first forward of a no-grad step that others serve: agreed already
            announced, self._announced = self._announced, None
            if key != announced:
                expected = (
                    f"to start at {announced!r}, where its last no-grad step's did"
                    if announced
                    else "to gather no unit, since it had run no no-grad step before (run one on every rank first)"
                )
                self._refuse(
                    f"rank {self._rank} began a no-grad step while other ranks were elsewhere, and they serve it: "
                    f"they expected its first {NO_GRAD_FORWARD} {expected}, and it starts at {key!r}"
                )
            self._passed = True
            return True
        self.close_forward()
        follows, self._passed = self._passed, True
        if not follows or self.control is None or self.checks == "off":
            return follows
        self._forwards += 1
        step = self._step_text or "no step (outside a step)"
        text = f"{NO_GRAD_FORWARD} {self._forwards + 1} (from {key!r}) of {step}"
        code = code_of(key)
        self._agree([FORWARD_ROW, code], lambda: f"start {text}", self._advice)
        self._open_forward(code, text)
        return True

    @contextmanager
    def forward_collectives(self) -> Iterator[None]:
        """The collectives issued inside are a no-grad forward's own (its units' gathers): they neither end it
        nor meet the ranks still running others (see ``_before``)."""
        self._in_forward += 1
        try:
            yield
        finally:
            self._in_forward -= 1

    def _open_forward(self, code: int, text: str, step: bool = False) -> None:
        """Check the collectives from here on in the sequence of the joined forwards of ``code`` (the previous one
        is the reference), or with ``step`` of the no-grad steps whose first forward is ``code``'s that other ranks
        served (see ``begin_no_grad_step``), until ``close_forward``."""
        if self.control is None or self.checks == "off":
            return
        self._outer = (self._key, self._step_text, self._sequence, self._on_track)
        key = f"no-grad {'step' if step else 'forward'} {code}"
        self._key, self._step_text, self._sequence = key, text, []
        self._on_track = self.checks == "auto" and key in self._references

    def close_forward(self) -> None:
        """End the joined forward whose sequence is open, if any: back to the step's sequence."""
        self._announced = None
        if self._outer is None:
            return
        if self._key is not None:
            self._references[self._key] = self._sequence
        self._key, self._step_text, self._sequence, self._on_track = self._outer
        self._outer = None

    def _serve_joined(self, rows: list[list[int]] | None, mine: int) -> bool:
        """After an agreement: if it found other ranks starting a joined forward while this rank (``mine``: the
        first number of its row) is elsewhere, issue this rank's part of that forward's gathers (or of the beginning
        of the no-grad step they begin: ``begin_no_grad_step``) and return ``True`` (the caller agrees again);
        otherwise ``False``. See [Note: joined forwards]."""
        if rows is None or mine == FORWARD_ROW:
            return False
        runner = next(row for row in rows if row[0] == FORWARD_ROW)
        code, step = runner[1], runner[2] != 0  # (a no-grad step that begins: see ``begin_no_grad_step``)
        runners = ", ".join(str(rank) for rank, row in enumerate(rows) if row[0] == FORWARD_ROW)
        what = f"first {NO_GRAD_FORWARD} of the no-grad step" if step else NO_GRAD_FORWARD
        text = f"{what} that rank(s) {runners} run (this rank {SERVES_FORWARD})"
        if self._in_forward:  # this rank is inside a forward of its own, which the others' does not match
            self._cannot_serve(runners, "it is in a forward of its own that the others do not run", what)
        self._open_forward(code, text, step)
        try:
            with self.forward_collectives():
                why = self.forward_server(code, step) if self.forward_server is not None else NEVER_RAN
        finally:
            self.close_forward()
        if why is not None:
            self._cannot_serve(runners, why, what)
        return True

    def _cannot_serve(self, runners: str, why: str, what: str = NO_GRAD_FORWARD) -> None:
        """Raise, here and (through the store) on the ranks ``runners`` waiting in the forward's gathers, that this
        rank cannot serve their joined forward."""
        self._refuse(f"rank {self._rank} cannot serve the gathers of the {what} that rank(s) {runners} run: {why}")

    @property
    def _rank(self) -> int:
        return self.control.rank if self.control is not None else 0

    def _refuse(self, said: str) -> None:
        """Raise ``said`` (with advice) here and, through the store, on the ranks waiting in a joined forward's
        gathers with this one; the group is broken from here on."""
        said += "."
        error = CollectiveMismatchError(f"{said}\n{self._advice([said])}")
        if self.control is not None:
            self.control.report_failure(error)
        self.broken = True
        raise error


def joinable(rows: list[list[int]]) -> bool:
    """Rows that are no mismatch although they differ: some ranks start a joined no-grad forward (all the same one)
    while the others are all at one other agreement, from which they serve it (see [Note: joined forwards] in
    ``engine/schedule/joined.py``)."""
    forwards = [row for row in rows if row[0] == FORWARD_ROW]
    others = [row for row in rows if row[0] != FORWARD_ROW]
    return (
        bool(forwards)
        and bool(others)
        and all(row == forwards[0] for row in forwards)
        and all(row == others[0] for row in others)
        and forwards[0][2] != _STEP_START_BROADCASTS  # a broadcast of buffers: DDP's would hang there too
    )


# Why a rank that has never run a forward starting at a unit cannot serve one (see ``_serve_joined``).
NEVER_RAN = "it never ran a forward starting at that unit, so it cannot know its gathers"
