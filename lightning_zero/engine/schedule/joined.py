"""Stage 3's no-grad forwards that ranks may run different numbers of times, and the rank that has finished its
own serving the gathers of those the others still run.

[Note: joined forwards]
A generation loop (transformers' ``model.generate(...)``) runs one forward per new token, under ``no_grad``, and
stops when its sequences end: after ``max_new_tokens``, which may differ per rank, or at an end-of-sequence token,
which one rank may reach first. DDP runs that, since its forward has no collective; under stage 3 every forward
gathers the units, so a rank that has stopped must go on taking part in the gathers of the ranks still generating,
for as many forwards as they run, whatever it does next (the next evaluation step, the loss forward of a training
step, the end of the loop). transformers' own answer is ``synced_gpus=True``: every rank runs as many forwards,
the finished ones on dummy inputs, with an all-reduce of a "done" flag per token. Without it, the ranks meet here:

- *Which forwards.* A no-grad forward, inside a step (a Trainer step, a Fabric no-grad step), is what the units that
  start between two of its boundaries run: the first unit started under ``no_grad`` opens one; the next opens
  at a unit that starts again after the call its previous start was in has returned (not at a module used twice
  in one forward, as ``ParityNet``'s layers are), or at any unit once every call under way when the open one
  began has returned (another model called after the first). The calls are those of every module that contains
  a unit (``install`` hooks them), so each of a generation loop's calls of the model is one forward, and one
  forward of a model that calls a block twice is still one. A forward is keyed by its first unit; ``UnitOrder``
  records its units per key.
- *Agreed.* The first no-grad forward since this rank last met the others outside one (at a step agreement, or at
  an agreed collective) rides on that meeting: nothing is agreed, its gathers stay in the step's sequence, as
  every evaluation forward's did (so a plain ``validation_step`` costs what it did). Each later one (the second
  token on) is agreed first (``CollectiveSequence.begin_no_grad_forward``) and checked in a sequence of its own,
  keyed by its first unit, so that how many a rank runs does not move the step's collectives; its units are
  prefetched along its own recorded order (when none repeats in it: see ``_begin``). A no-grad step of the Fabric
  door that some ranks begin while the others are elsewhere is agreed at its start, in a row the others serve
  (``CollectiveSequence.begin_no_grad_step``, [Note: Fabric steps] in ``fabric/wrapper.py``): its first forward is
  then agreed already, and runs as a later one does, from the unit its start announced (``step_first``: where the
  rank's last such step began).
- *Met.* The first collective a rank issues after a no-grad forward that is not one of that forward's own
  gathers is agreed (``CollectiveSequence._before``), even on track: whatever comes next after a generation loop
  (the next step's agreement, the loss forward's first gather, a synced log, the teardown) is an agreement.
- *Served.* An agreement in which some ranks start a joined forward (all the same one) while all the others are
  at one other agreement is no mismatch (``forward_joins.joinable``): the ranks that start it run it, and each other
  rank serves it from where it is (``serve``): it takes part in the gathers of that forward's recorded units, in
  order, each into a buffer of its own that is dropped at once (``ShardedUnit.serve_gather``: nothing of its own
  state changes, so it may serve from anywhere, even from inside a gather of its own or a backward hook), checked
  in that forward's sequence as the runners' are, then agrees again where it was. When no rank runs one any more,
  every rank is at the same agreement, and all go on together.

So the tokens are DDP's, and a rank that has finished costs the others nothing but its share of their gathers.
A generation loop pays one agreement per forward from the second on and one at the collective after it, on every
rank (with ``synced_gpus=True`` too); a step with one no-grad forward (plain evaluation) pays nothing more, and a
training step with one (a teacher's forward) one agreement. The gathers a rank serves pair with the runners'
because, from the second forward of a loop on, every unit of a forward starts sharded on every rank (a no-grad
forward frees each unit after its forward), so a runner gathers a unit at each of its starts, in the recorded
order, as the rank serving it does; a runner whose forward differs (a data-dependent branch) is caught by that
forward's sequence, as any rank off the recorded order is (see [Note: collective checks] in
``comm/sequence.py``). What cannot be served raises ``CollectiveMismatchError`` on every rank, naming generation
and ``synced_gpus=True``: a rank that ran no forward of the loop at all while others did (nothing marks the point
where the others started, but a Fabric no-grad step's start, above), a forward that issues another collective than
its units' gathers, and a forward starting at a unit this rank never ran, in a forward of its own or inside one (it
cannot know which units it gathers). With ``collective_checks="off"`` nothing is agreed, so nothing is joined
either. Outside steps (a callback that generates) every gather is agreed on its own, unjoined: a generation loop
there must run as many forwards on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_zero.engine.comm.control import code_of
from lightning_zero.engine.comm.forward_joins import NEVER_RAN
from lightning_zero.engine.core.unit import ShardedUnit
from lightning_zero.engine.schedule.compiled import outside_graphs
from lightning_zero.engine.schedule.order import UnitOrder

if TYPE_CHECKING:
    from lightning_zero.engine.comm.comm import Comm


class JoinedForwards:
    """Finds the no-grad forwards of a step, has every one after the first agreed, and serves those of other ranks
    (see [Note: joined forwards]). Stage 3's hooks call ``unit_starts`` for a unit that starts under ``no_grad``
    inside a step, and ``close`` where a step begins or ends.

    Example::

        joined = JoinedForwards(units, comm, prefetch)
        joined.install(model, skip=set())        # the calls of every module that contains a unit
        with torch.no_grad():
            model.generate(x, max_new_tokens=4)  # forward 1 rides on the step's agreement, 2 to 4 are agreed
    """

    def __init__(self, units: list[ShardedUnit], comm: Comm, prefetch: Callable[[list[ShardedUnit]], None]) -> None:
        self.comm = comm
        self.units = units
        self.prefetch = prefetch
        self._by_code = {code_of(unit.name): unit for unit in units}
        self._orders: dict[ShardedUnit, UnitOrder] = {}  # per first unit: the units of that forward
        self._frames: list[tuple[int, int]] = []  # the calls under way: (id of the module, call number)
        self._calls = 0
        self._seen: dict[ShardedUnit, int] | None = None  # the open forward's units: the call each last started in
        self._begun_in: set[int] = set()  # the calls under way when the open forward began
        self._order: UnitOrder | None = None  # the open forward's
        self._agreed = False  # the open forward was agreed
        self._prefetching = False  # ... and its units are prefetched along its own order (see ``_begin``)
        # The unit at which the first no-grad forward since the last ``close`` started: what a no-grad step of the
        # Fabric door announces as its first forward's (see ``CollectiveSequence.begin_no_grad_step``).
        self.step_first: ShardedUnit | None = None
        self._handles: list[Any] = []

    def install(self, top: nn.Module, skip: set[int]) -> None:
        """Hook the calls of ``top`` and of every module under it that contains a unit, except those whose ids are
        in ``skip`` (compiled code: a hook there would break its graph)."""
        roots = {id(unit.module) for unit in self.units if unit.module is not top}
        found: dict[int, bool] = {}

        def contains_unit(module: nn.Module) -> bool:
            if id(module) not in found:
                found[id(module)] = False  # (a module reachable twice is visited once)
                inside = [contains_unit(child) or id(child) in roots for child in module.children()]
                found[id(module)] = any(inside)
            return found[id(module)]

        contains_unit(top)
        for module in top.modules():
            if (found.get(id(module)) or module is top) and id(module) not in skip:
                self._handles.append(module.register_forward_pre_hook(outside_graphs(self._enter)))
                self._handles.append(module.register_forward_hook(outside_graphs(self._exit), always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter(self, module: nn.Module, _args: Any) -> None:
        self._calls += 1
        self._frames.append((id(module), self._calls))

    def _exit(self, module: nn.Module, _args: Any, _output: Any) -> None:
        if self._frames and self._frames[-1][0] == id(module):
            self._frames.pop()

    @contextmanager
    def frame(self) -> Iterator[None]:
        """One call around what runs inside (a replay of a recorded forward: one forward, whatever units repeat)."""
        self._calls += 1
        self._frames.append((0, self._calls))
        try:
            yield
        finally:
            self._frames.pop()

    def _running(self, call: int) -> bool:
        return call != 0 and any(number == call for _, number in self._frames)

    def unit_starts(self, unit: ShardedUnit) -> bool:
        """``unit`` starts under ``no_grad`` inside a step (call between ``comm.forward_collectives()``): open a
        forward if it begins one (agreed, unless it is the first since this rank met the others), and prefetch
        along that forward's order. Returns whether the forward was agreed (if not, the step's own order
        prefetches)."""
        call = self._frames[-1][1] if self._frames else 0
        seen = self._seen
        if (
            seen is None
            or (unit in seen and not self._running(seen[unit]))  # a unit again, after the call it ran in
            or (self._begun_in and not any(number in self._begun_in for _, number in self._frames))  # a new call
        ):
            self._begin(unit)
            seen = self._seen
            assert seen is not None
        seen[unit] = call
        assert self._order is not None
        upcoming = self._order.reached(unit)
        if self._prefetching:
            self.prefetch(upcoming)
        return self._agreed

    def _begin(self, unit: ShardedUnit) -> None:
        if self._seen is None:
            self.step_first = unit
        self._finish()  # (``begin_no_grad_forward`` closes the previous forward's sequence)
        self._agreed = self.comm.begin_no_grad_forward(unit.name)
        self._seen = {}
        self._begun_in = {number for _, number in self._frames}
        self._order = self._orders.setdefault(unit, UnitOrder())
        upcoming = self._order.start()
        # Prefetched, the units are still gathered in their recorded order, as a rank that serves the forward
        # gathers them, as long as none repeats (a unit still in use when the window reaches its next start would
        # be gathered after the ones behind it); a forward that repeats one gathers each at its start instead.
        self._prefetching = self._agreed and len(set(upcoming)) == len(upcoming)
        if self._prefetching:
            self.prefetch(upcoming)

    def close(self, sequence: bool = True) -> None:
        """The open forward is over (a step begins or ends, a unit runs with gradients): its order is recorded, and
        its sequence closed (not with ``sequence=False``: a no-grad step that other ranks serve, whose sequence
        its first forward goes on in; see ``CollectiveSequence.begin_no_grad_step``)."""
        self._finish()
        if sequence:
            self.comm.close_forward()

    def _finish(self) -> None:
        if self._order is not None:
            self._order.finish()
            self._order = None
        self._seen = None
        self._begun_in = set()
        self._agreed = self._prefetching = False

    def serve(self, code: int, gathered: set[ShardedUnit] | None = None) -> str | None:
        """Take part in the gathers of one forward that other ranks run, the one that starts at the unit whose name
        has ``code`` (see [Note: joined forwards]); ``None`` once served, or why this rank cannot serve it.
        ``gathered``: for the first forward of a no-grad step, the units gathered on this rank, whose state is the
        runners' (see [Note: Fabric steps] in ``fabric/wrapper.py``): a runner gathers none of them at its first
        start in that forward, nor a unit that stays gathered after it (``reshard_after_forward=False``) again; a
        ``code`` of 0 there is a forward that gathers no unit."""
        if gathered is not None and code == 0:
            return None
        first = self._by_code.get(code)
        if first is None:
            return NEVER_RAN
        order = self._orders.get(first)
        units = order.recorded if order is not None else None
        if units is None:  # a forward that starts inside one this rank ran (a decoder step after the encoder's)
            known = [o.recorded for o in self._orders.values() if o.recorded is not None and first in o.recorded]
            units = known[0][known[0].index(first) :] if known else None
        if not units:
            return NEVER_RAN
        for unit in units:
            if gathered is not None:
                if unit in gathered:
                    if unit.reshard_after_forward:
                        gathered.discard(unit)  # freed after its forward, as every unit of a no-grad forward is
                    continue
                if not unit.reshard_after_forward:
                    gathered.add(unit)
            unit.serve_gather()
        return None
