"""``GatherLedger``: stage 3's gathered units over time, for the peak a step reaches (``dry-run``, statistics).

A unit's gathered storage exists from the moment its all-gather is issued (``ShardedUnit.unshard``, prefetches
included) until it is freed (``reshard``, ``release``). The ledger is told both, so it knows the bytes gathered
now, the most gathered at any moment since its last ``reset``, and which units were gathered at that moment.
Two dictionary operations per gather: nothing a step notices.

Example::

    ledger = GatherLedger()
    ledger.add("h.0", 4096); ledger.add("h.1", 4096); ledger.remove("h.0")
    ledger.peak, ledger.at_peak   # (8192, ("h.0", "h.1"))
"""

from __future__ import annotations


class GatherLedger:
    """The bytes of gathered units, now and at the peak since ``reset``."""

    def __init__(self) -> None:
        self._live: dict[str, int] = {}
        self.current = 0
        self.peak = 0
        self.at_peak: tuple[str, ...] = ()

    def add(self, unit: str, nbytes: int) -> None:
        """``unit``'s ``nbytes`` of gathered storage were allocated."""
        self.current += nbytes - self._live.get(unit, 0)
        self._live[unit] = nbytes
        if self.current > self.peak:
            self.peak = self.current
            self.at_peak = tuple(self._live)

    def remove(self, unit: str) -> None:
        """``unit``'s gathered storage was freed."""
        self.current -= self._live.pop(unit, 0)

    def reset(self) -> None:
        """Start a new peak from what is gathered now."""
        self.peak = self.current
        self.at_peak = tuple(self._live)
