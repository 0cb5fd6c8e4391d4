"""Counters of the collectives a ``Comm`` issues: calls, bytes sent by this rank (the ring model: see ``comm.py``)
and seconds spent, per kind of collective.

Example::

    before = comm.stats.snapshot()
    ...                                           # one training step
    step = comm.stats.since(before)
    step.calls("all_gather"), step.bytes_sent     # the step's figures
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_zero.engine.comm.timing import DeviceClock, DeviceTiming


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
    # While statistics are kept (``time_on_device``): the CUDA events of the collectives on a device, turned into
    # ``seconds`` once reached (see [Note: device timing] in ``timing.py``). ``None``: no events are made.
    device_timing: DeviceTiming | None = None

    def time_on_device(self, clock: DeviceClock | None = None) -> None:
        """From now on, time the collectives on a CUDA device with events (``log_stats``); without it their
        ``seconds`` are the host's, which on NCCL are only the time to issue them."""
        if self.device_timing is None:
            self.device_timing = DeviceTiming(clock)

    def on_device(self, kind: str, device: torch.device, issue: Callable[[], Any]) -> Any:
        """``issue()`` (one collective, ``async_op=True``; returns its work) timed on ``device``; the pairs the device
        has already reached are counted now, so only those of collectives still running are held."""
        assert self.device_timing is not None, "on_device() after time_on_device()"
        work = self.device_timing.around(kind, device, issue)
        self.device_timing.resolve(self.add_seconds)
        return work

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
        if self.device_timing is not None:
            self.device_timing.resolve(self.add_seconds, block=True)

    @property
    def bytes_sent(self) -> int:
        return sum(s.bytes_sent for s in self.by_kind.values())

    def calls(self, kind: str) -> int:
        return self.by_kind[kind].calls if kind in self.by_kind else 0

    def reset(self) -> None:
        self.by_kind.clear()
        if self.device_timing is not None:
            self.device_timing.clear()

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
