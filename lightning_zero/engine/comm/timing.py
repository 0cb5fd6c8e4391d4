"""The seconds a collective takes on a device, measured with CUDA events only while statistics are kept.

[Note: device timing]
On NCCL a collective issued with ``async_op=True`` runs on ProcessGroupNCCL's own stream (one per process group
and device), which first waits for the current stream at the point of issue; ``work.wait()`` later makes the
current (compute) stream wait for its end. The host never blocks, so the host's clock says nothing of how long
the collective took; CUDA events do, on the right stream. An interval from an event on the compute stream before
the issue to one recorded there after the consumer's ``wait()`` is wrong: a prefetch is waited for one unit of
compute later, and that compute, which the collective overlapped, would be counted as communication.

NCCL's stream is not reachable from Python (and a collective issued with ``async_op=False`` on a stream of the
engine's, which recent torch runs on the current stream, returns no work for the stall report to wait on), so
each ``Comm`` times its collectives on a *timing stream* of its own that follows the same waits in the same
order: for each collective it waits for the current stream (as NCCL's stream does at the issue), records the
start event, and after the collective is issued waits for its end (``work.block_current_stream()`` under the
timing stream: ``WorkNCCL`` then makes the *current* stream, the timing stream, wait for its end event, and the
host does not block) and records the end event. Both events are on one stream, so the interval starts when the
collective can start (its inputs are ready and the previous collective of the group has ended, as on NCCL's
stream) and ends when it ends: the collective's own time, the compute it overlapped and the queueing behind the
group's previous collective excluded. The compute stream sees nothing of it. ``WorkNCCL``'s stream wait also
releases its stash of the tensors (the allocator's safety); the engine keeps every tensor a collective uses alive
until its own ``wait()`` (``Pending.keep``), which orders the compute stream after the collective before they can
be freed, so that release changes nothing. (Read from ProcessGroupNCCL's source, where ``blockCurrentStream`` is
``synchronize``, a stream wait, and the host wait of ``TORCH_NCCL_BLOCKING_WAIT`` is in ``wait()``; not yet
checked on a device.)

Events are made only while statistics are kept (``CommStats.time_on_device()``, which ``log_stats=True``
turns on): otherwise two events per collective would be made and kept for nothing. Pairs whose end has been
reached are added to the counters as later collectives are issued (``CudaClock`` asks the event, never blocks), so
at most the collectives still running on the device are held; ``resolve(block=True)`` (when the figures are read)
waits for the rest. Nothing here has run on a GPU yet: the orders of calls are tested on a CPU with a recording
clock (``tests/test_comm.py``), the CUDA semantics are torch's and NCCL's as documented.

Example::

    stats = CommStats()
    stats.time_on_device()                         # log_stats: events from now on
    work = stats.device_timing.around("all_gather", device, lambda: dist.all_gather_into_tensor(o, i, async_op=True))
    stats.resolve()                                # waits for the last one, adds the seconds
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

# Beyond this many pairs not yet reached, the oldest is waited for (the host blocks): a bound on what is held that a
# device cannot reach in practice (its launch queue holds about a thousand operations).
MOST_HELD = 4096


class DeviceClock(Protocol):
    """What device timing needs of a device (``CudaClock``; a recording fake in tests)."""

    def current_stream(self, device: torch.device) -> Any: ...

    def new_stream(self, device: torch.device) -> Any: ...

    def new_event(self) -> Any: ...

    def on(self, stream: Any) -> AbstractContextManager[Any]: ...


class CudaClock:
    """CUDA streams and timing events."""

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    def on(self, stream: torch.cuda.Stream) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)


class DeviceTiming:
    """Start and end events of each collective on a timing stream (see [Note: device timing]), turned into seconds
    per kind once the device has reached them."""

    def __init__(self, clock: DeviceClock | None = None) -> None:
        self.clock: DeviceClock = clock if clock is not None else CudaClock()
        self._streams: dict[torch.device, Any] = {}
        self.held: deque[tuple[str, Any, Any]] = deque()  # (kind, start, end), oldest first
        self.most_held = MOST_HELD

    def around(self, kind: str, device: torch.device, issue: Callable[[], Any]) -> Any:
        """``issue()`` (which enqueues one collective with ``async_op=True`` and returns its work) between the two
        events; returns the work."""
        clock = self.clock
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = clock.new_stream(device)
        stream.wait_stream(clock.current_stream(device))  # where the collective's own stream waits at its issue
        start, end = clock.new_event(), clock.new_event()
        start.record(stream)
        work = issue()
        with clock.on(stream):
            work.block_current_stream()  # the timing stream waits for the collective's end; the host does not
        end.record(stream)
        self.held.append((kind, start, end))
        return work

    def resolve(self, add: Callable[[str, float], None], block: bool = False) -> None:
        """Add (``add(kind, seconds)``) the pairs the device has reached, oldest first; with ``block``, wait for
        every one; past ``most_held`` pairs, for the oldest."""
        held = self.held
        while held:
            kind, start, end = held[0]
            if block or len(held) > self.most_held:
                end.synchronize()
            elif not end.query():
                return
            held.popleft()
            add(kind, start.elapsed_time(end) / 1000.0)

    def clear(self) -> None:
        self.held.clear()
