"""The order in which units ran in a pass, recorded once, and where the current pass is in it: what stage 3
prefetches from (see [Note: prefetch] in ``stage3.py``)."""

from __future__ import annotations

from lightning_zero.engine.core.unit import ShardedUnit


class UnitOrder:
    """The order in which units ran in the first pass of one kind (a training forward, its backward, an evaluation
    forward, a joined no-grad forward: see [Note: joined forwards] in ``joined.py``), and where the current pass
    is in it.

    Example::

        order = UnitOrder()
        order.start()                    # the first pass: [] (recording)
        order.reached(block0)            # [] while recording
        order.finish()                   # recorded: [block0, ...]
        order.start()                    # later passes: the units to prefetch first
        order.reached(block0)            # the units after block0
    """

    def __init__(self) -> None:
        self.recorded: list[ShardedUnit] | None = None
        self._recording: list[ShardedUnit] | None = None
        self._position: int | None = None

    def start(self) -> list[ShardedUnit]:
        """A pass begins: record it if nothing is recorded yet; return the units to prefetch first."""
        if self.recorded is None:
            self._recording = []
            return []
        self._position = 0
        return self.recorded

    def reached(self, unit: ShardedUnit) -> list[ShardedUnit]:
        """``unit`` starts now; the units that follow it in the recorded order (empty when off track)."""
        if self._recording is not None:
            self._recording.append(unit)
            return []
        if self._position is None or self.recorded is None:
            return []
        if self._position < len(self.recorded) and self.recorded[self._position] is unit:
            self._position += 1
            return self.recorded[self._position :]
        self._position = None  # this pass left the recorded order: no more prefetching in it
        return []

    def at_end(self, unit: ShardedUnit) -> bool:
        """Whether ``unit`` is the last unit of the recorded order and this pass has followed it to there."""
        recorded = self.recorded
        return recorded is not None and self._position == len(recorded) and recorded[-1] is unit

    def finish(self) -> None:
        if self._recording is not None:
            self.recorded = self._recording or None
            self._recording = None
        self._position = None
