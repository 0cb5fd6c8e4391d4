"""``Comm`` in a process group of one rank with ``run_alone=True``: the collectives really run (the path a
single GPU exercises in ``benchmarks/gpu_check.py``), agreements included, and give the single-rank values.

Device timing (see [Note: device timing] in ``engine/comm/timing.py``), with a clock that records what would be
queued on which stream: both events of a collective on its timing stream, around its issue and its end, none on
the compute stream; events only while statistics are kept, and only those of collectives not yet reached held.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_zero.engine import Comm, CommStats, shard_model
from lightning_zero.engine.comm.control import ControlChannel
from lightning_zero.engine.comm.timing import DeviceTiming
from lightning_zero.strategies.stats import StepStats
from tests.distributed import spawn


def _alone(rank: int, world_size: int) -> dict[str, int]:
    skipping = Comm(checks="off")
    full = torch.zeros(4)
    skipping.all_gather(full, torch.arange(4.0))
    assert skipping.stats.calls("all_gather") == 0 and full.tolist() == [0, 1, 2, 3]

    comm = Comm(checks="auto", control=ControlChannel.create(run_alone=True), run_alone=True)
    assert comm.control is not None
    comm.begin_sequence("training", [1], lambda: "step 1")
    full = torch.zeros(4)
    comm.all_gather(full, torch.arange(4.0), name="u", guard=True)
    shard = torch.zeros(4)
    pending = comm.reduce_scatter(shard, torch.ones(4), name="u", async_op=True)
    assert pending is not None
    pending.wait()
    total = torch.full((2,), 3.0)
    comm.all_reduce(total)
    comm.end_sequence()
    assert full.tolist() == [0, 1, 2, 3] and shard.tolist() == [1, 1, 1, 1] and total.tolist() == [3, 3]
    calls = {kind: comm.stats.calls(kind) for kind in ("all_gather", "reduce_scatter", "all_reduce", "check")}

    # A sequence opened at the step's agreement and named later (the gathers issued at a batch's start, see
    # Comm.continue_sequence): on track while it matches the named key's reference, agreed from where it does not.
    def step(number: int, key: str) -> int:
        before = comm.stats.calls("check")
        comm.agree_step([number], lambda: f"step {number}")
        comm.begin_sequence("training", None, lambda: f"step {number}")
        comm.all_gather(full, torch.arange(4.0), name="u", guard=True)
        comm.continue_sequence(key, lambda: f"step {number}")
        comm.reduce_scatter(shard, torch.ones(4), name="u")
        comm.all_reduce(total)
        return comm.stats.calls("check") - before

    calls["same key"] = step(2, "training")  # the agreement only
    calls["new key"] = step(3, "training (accumulating)")  # and the two collectives after the gather
    calls["known key"] = step(4, "training (accumulating)")  # its reference now exists
    comm.end_sequence()

    # A deferred step (evaluation under stages 1 and 2): agreed at its first collective, if any.
    def deferred(number: int, collectives: int) -> int:
        before = comm.stats.calls("check")
        comm.defer_sequence("evaluation", [number], lambda: f"evaluation step {number}")
        for _ in range(collectives):
            comm.all_reduce(total)
        comm.end_sequence()
        return comm.stats.calls("check") - before

    calls["deferred, silent"] = deferred(1, 0)  # nothing
    calls["deferred, first"] = deferred(2, 2)  # the step, and its two collectives (no reference yet)
    calls["deferred, again"] = deferred(3, 2)  # the step only
    calls["deferred, silent again"] = deferred(4, 0)
    return calls


def test_a_comm_of_one_rank_runs_its_collectives_when_asked() -> None:
    (calls,) = spawn(_alone, world_size=1, timeout=120)
    # The first step of a key is agreed collective by collective: 1 for the step and 3 for its collectives.
    assert calls == {
        "all_gather": 1,
        "reduce_scatter": 1,
        "all_reduce": 1,
        "check": 4,
        "same key": 1,
        "new key": 3,
        "known key": 1,
        "deferred, silent": 0,
        "deferred, first": 3,
        "deferred, again": 1,
        "deferred, silent again": 0,
    }


class _Clock:
    """A device clock that logs what each call would queue, and on which stream (the current one is "compute"
    unless ``on`` says otherwise); an event is reached once ``reach`` says so."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.current = "compute"
        self.events: list[_Event] = []
        self.reach = True

    def current_stream(self, device: torch.device) -> str:
        return self.current

    def new_stream(self, device: torch.device) -> _Stream:
        return _Stream(self, f"timing {device}")

    def new_event(self) -> _Event:
        self.events.append(_Event(self, len(self.events)))
        return self.events[-1]

    @contextmanager
    def on(self, stream: _Stream) -> Any:
        before, self.current = self.current, stream.name
        try:
            yield
        finally:
            self.current = before


class _Stream:
    def __init__(self, clock: _Clock, name: str) -> None:
        self.clock, self.name = clock, name

    def wait_stream(self, other: str) -> None:
        self.clock.log.append(("wait", self.name, other))


class _Event:
    def __init__(self, clock: _Clock, number: int) -> None:
        self.clock, self.number, self.reached = clock, number, False

    def record(self, stream: _Stream) -> None:
        self.clock.log.append(("record", f"event {self.number}", stream.name))
        self.reached = self.clock.reach

    def query(self) -> bool:
        return self.reached

    def synchronize(self) -> None:
        self.clock.log.append(("synchronize", f"event {self.number}"))
        for event in self.clock.events[: self.number + 1]:  # and every event recorded before it
            event.reached = True

    def elapsed_time(self, end: _Event) -> float:
        assert self.reached and end.reached, "elapsed_time of an event not reached"
        return 2.0  # milliseconds


class _Work:
    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        clock.log.append(("issue", clock.current))

    def block_current_stream(self) -> None:
        self.clock.log.append(("wait for the collective", self.clock.current))


def test_a_collective_is_timed_on_its_own_stream_from_its_start_to_its_end() -> None:
    clock = _Clock()
    stats = CommStats()
    stats.time_on_device(clock)
    device = torch.device("cuda", 1)
    work = stats.on_device("all_gather", device, lambda: _Work(clock))
    assert isinstance(work, _Work)
    timing = "timing cuda:1"
    assert clock.log == [
        ("wait", timing, "compute"),  # no earlier than the collective's own stream may start it
        ("record", "event 0", timing),
        ("issue", "compute"),  # enqueued from the compute stream, as the engine issues it
        ("wait for the collective", timing),  # the timing stream, not the compute stream, waits for its end
        ("record", "event 1", timing),
    ]
    # Reached at once here: counted as soon as the next collective is issued (or now), nothing held.
    assert stats.by_kind["all_gather"].seconds == 0.002 and not stats.device_timing.held

    # One timing stream per device, made once.
    stats.on_device("reduce_scatter", device, lambda: _Work(clock))
    assert sum(1 for entry in clock.log if entry[0] == "wait") == 2
    assert {entry[2] for entry in clock.log if entry[0] == "record"} == {timing}


def test_device_timing_holds_only_what_the_device_has_not_reached() -> None:
    clock = _Clock()
    timing = DeviceTiming(clock)
    seconds: list[float] = []
    device = torch.device("cuda", 0)
    for _ in range(100):  # each collective ends before the next is issued
        timing.around("all_reduce", device, lambda: _Work(clock))
        timing.resolve(lambda kind, s: seconds.append(s))
        assert len(timing.held) == 0
    assert len(seconds) == 100

    clock.reach = False  # the device lags behind the host
    timing.most_held = 8
    for _ in range(20):
        timing.around("all_reduce", device, lambda: _Work(clock))
        timing.resolve(lambda kind, s: seconds.append(s))
    assert len(timing.held) == 8  # past the bound, the oldest were waited for
    assert sum(1 for entry in clock.log if entry[0] == "synchronize") == 12
    timing.resolve(lambda kind, s: seconds.append(s), block=True)  # when the figures are read
    assert not timing.held and len(seconds) == 120


def test_events_are_made_only_while_statistics_are_kept() -> None:
    assert CommStats().device_timing is None  # by default: no event on any collective
    sharded = shard_model(nn.Linear(4, 4), stage=2, comm=Comm())
    assert all(comm.stats.device_timing is None for comm in sharded.comms().values())
    StepStats().start(sharded)  # log_stats=True
    assert all(comm.stats.device_timing is not None for comm in sharded.comms().values())
