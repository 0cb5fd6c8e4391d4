"""Waits for the device that the stall report sees, and device values read on the host without blocking behind
later work.

[Note: waits for the device]
On NCCL a wait for a collective orders streams and returns (see [Note: streams] in ``comm.py``): the host blocks
only where it reads a device value (``.tolist()``, ``.item()``, ``bool()``) or synchronises on an event, and there
it blocks inside the CUDA driver, behind every kernel queued before, collectives among them. If a peer never issues
one of those collectives (it left the recorded track, or died), that read never returns and nothing reports it:
the stall monitor of ``stall.py`` only sees a main thread blocked in ``torch.distributed``, and the job would end
at the process group's timeout (30 minutes) with NCCL's watchdog abort. So the engine never blocks there. Where
it must wait for the device, it records a CUDA event and polls ``event.query()``, sleeping briefly between polls
(``ControlChannel.wait_for_device``); once ``poll_seconds`` have passed it publishes "waiting for the device after
collective #i" as a wait for collective ``i`` of the main group would be published (``i`` is the last collective
this rank issued there, which the device must finish first) and reads the other ranks' states at every poll, so a
deadlock or a failed peer raises ``CollectiveMismatchError`` or ``PeerFailureError`` on every rank within seconds,
as a wait on gloo does. A value read at once (``read_on_host``) is read right after the event: nothing has been
queued behind it, so the read's own copy waits for nothing more. A value read later (``HostValues``: the flags of
a backward pass, read at the optimizer step) is first copied into pinned host memory with ``non_blocking=True``,
the event recorded behind that copy: the read then touches only host memory, where a ``.tolist()`` of the device
tensor would queue its copy behind whatever the stream holds by then, and block behind that. On the CPU nothing
is queued: there is no event, and a read is immediate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lightning_zero.engine.errors import CollectiveMismatchError, PeerFailureError

if TYPE_CHECKING:
    from lightning_zero.engine.comm.sequence import CollectiveSequence


class DeviceEvent(Protocol):
    """What ``wait_for_device`` needs of an event (a ``torch.cuda.Event``, or a fake in tests)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def record_event(device: torch.device) -> DeviceEvent | None:
    """An event recorded on ``device``'s current stream; ``None`` on a CPU, where nothing is queued."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def wait_for_device(
    comm: CollectiveSequence | None,
    event: DeviceEvent | None,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Wait until the device has run everything queued before ``event``, through ``comm``'s stall report (see
    [Note: waits for the device]); ``what`` says why, for the report. Immediate when ``event`` is ``None``; a plain
    ``synchronize()`` where ``comm`` has no control channel (a world of one). A verdict marks ``comm`` broken (its
    collectives in flight may never complete) and raises.

    Example::

        event = record_event(flags.device)
        wait_for_device(comm, event, "reading the gradients' flags")
    """
    if event is None:
        return
    control = comm.control if comm is not None else None
    if comm is None or control is None or control.store is None:
        event.synchronize()
        return
    index = control.issued["main"] - 1  # the last collective this rank issued on the main group

    def describe() -> str:
        after = f"after collective #{index + 1} of the main group" if index >= 0 else "before any collective"
        where = control.where()
        return f"waiting for the device {after} ({what}{f', {where}' if where else ''})"

    try:
        control.wait_for_device(event.query, index, describe, comm._advice, sleep)
    except (CollectiveMismatchError, PeerFailureError):
        comm.broken = True
        raise


HostBuffer = Callable[[torch.Size, torch.dtype], torch.Tensor]  # a pinned host buffer (``PinnedPool.take``)


class HostValues:
    """A tensor's values on their way to the host, to be read later (see [Note: waits for the device]): on CUDA
    copied without blocking into a pinned host buffer from ``host_buffer`` (a ``PinnedPool``'s: registering pinned
    memory is slow, see [Note: exact pinned memory] in ``core/pinned.py``), an event recorded behind the copy;
    ``read()`` waits for that event through ``wait_for_device`` and returns the values as a list. On a CPU the
    tensor itself, read at once (on another device type, read as ``tolist()`` reads it).

    Example::

        flags = HostValues(torch.cat(slots), pool.take)    # queued: nothing waits here
        ...                                                # more work queued on the device
        values = flags.read(comm, "the gradients' flags")
    """

    def __init__(self, tensor: torch.Tensor, host_buffer: HostBuffer | None = None) -> None:
        self.event: DeviceEvent | None = None
        if tensor.device.type == "cuda":
            if host_buffer is None:
                raise ValueError("HostValues of a CUDA tensor needs host_buffer (pinned memory to copy into)")
            self.values = host_buffer(tensor.shape, tensor.dtype)
            self.values.copy_(tensor, non_blocking=True)
            self.event = record_event(tensor.device)
        else:
            self.values = tensor

    def wait(self, comm: CollectiveSequence | None, what: str, sleep: Callable[[float], None] = time.sleep) -> None:
        """Wait until ``values`` hold the tensor's values (``wait_for_device``); at once after the first time."""
        wait_for_device(comm, self.event, what, sleep)
        self.event = None

    def read(self, comm: CollectiveSequence | None, what: str) -> list[Any]:
        self.wait(comm, what)
        return self.values.tolist()


def read_on_host(comm: CollectiveSequence | None, tensor: torch.Tensor, what: str) -> list[Any]:
    """``tensor.tolist()`` now, waiting for the device through ``comm``'s stall report first: an event recorded
    behind ``tensor``, then the read, whose copy has nothing else to wait for (see [Note: waits for the device])."""
    wait_for_device(comm, record_event(tensor.device), what)
    return tensor.tolist()
