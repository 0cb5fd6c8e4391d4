"""Side streams for the engine's copies between host and device memory, so that the compute stream never queues one.

[Note: copies off the compute stream]
On CUDA a copy between pinned host memory and the device, queued with ``non_blocking=True``, returns at once on the
host, but it occupies the stream it is queued on: every kernel queued after it on that stream waits until the bytes
have crossed PCIe (about 1 ms per 25 MB). Queued on the compute stream, each offload copy (a sharded gradient to the
host, an offloaded shard to the device, an asynchronous save's staging) would stall the kernels behind it. FSDP2
queues them on streams of its own (its reduce-scatter stream carries the copy of a reduced shard to the host, its
all-gather copy-in stream the copies that feed a gather). The engine does the same with three side streams per
device (``Streams.side_stream``):

- ``"reduce"``: the copy of a reduced gradient shard to the host (``to_master`` in ``schedule/reduce.py``). The
  compute stream has waited for the reduce-scatter (``Pending.wait``) and divided the shard; the side stream waits
  for the compute stream up to there (``wait_stream``), copies, and records an event (``ShardedUnit.copied_to_host``).
  The host reads the host gradients only after waiting for that event (``GradReducer._synchronize_copies``, through
  ``host_copies_event``); no kernel on the compute stream waits for the copy.
- ``"copy_in"``: the copies into the device's compute shard (the refresh of stages 1 and 2 and of an offloaded
  stage-3 master) and the staging copies of ``offload_params``, and the all-gather they feed, issued from that
  stream (``ShardedUnit._copy_in``). It first waits for the compute stream (the memory it writes was last used
  there), copies, records an event behind the copy (``ShardedUnit.wait_host_reads``: the host waits for it before
  it writes the host memory the copy reads) and issues the all-gather, whose own NCCL stream waits for the side
  stream at its launch, so the gather reads the copied values. The consumer of the gathered values, the compute
  stream, waits for the gather (``Pending.wait``), hence for the copy, where the values are used and no earlier.
- ``"save"``: an asynchronous save's staging into pinned host buffers (``stage_on_host`` in
  ``checkpoint/background.py``), with an event the save thread waits for before it reads a byte; the compute
  stream waits for the same event before the engine next writes what was copied (``ShardedModel.order_writes_after``).

What the caching allocator needs. It hands a freed block to the next allocation *on the stream that allocated it*,
at once, trusting that stream's order: a block used by another stream must not be freed (or must be marked with
``record_stream``) until that use is ordered before the block's next user. So:

- every tensor a side stream reads or writes is allocated on the compute stream, before the side stream waits for
  it (``wait_stream``), except the staging shard and what a quantized gather makes (allocated on ``copy_in``, and
  used by the gather and by the compute stream's dequantization, both ordered before ``copy_in``'s next use by its
  ``wait_stream`` of the compute stream, which has waited for the gather by then);
- the device source of a gradient's copy to the host is freed right after the copy is queued, while the copy may
  not have run: ``keep_for(source, reduce_stream)`` (``record_stream``) makes the allocator hold the block until the
  side stream's work queued so far is done;
- the sources of a save's staging live in ``Staged`` until the save thread has seen the copies' event (a block freed
  after the host saw the event is free of any use); the pinned host buffers are host memory, outside the caching
  allocator: each is held until the host waited for the copy into it.

On a CPU there is no stream: ``cuda_streams`` gives ``None`` and every copy is a plain synchronous one.
Tests inject a recording fake (``tests/test_streams.py``) to check on which stream each copy is queued. Nothing here
has run on a GPU yet: the orders are read from CUDA's stream semantics and the caching allocator's documentation.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch


class Streams(Protocol):
    """What the side-stream copies need of one device (``CudaStreams``; a recording fake in tests). Streams have
    ``wait_stream(other)`` and ``wait_event(event)``; events ``record(stream)``, ``query()`` and ``synchronize()``."""

    def current_stream(self) -> Any: ...

    def side_stream(self, name: str) -> Any: ...

    def on(self, stream: Any) -> AbstractContextManager[Any]: ...

    def new_event(self) -> Any: ...

    def keep_for(self, tensor: torch.Tensor, stream: Any) -> None: ...


class CudaStreams:
    """The side streams of one CUDA device, one per name, made on first use (see [Note: copies off the compute
    stream]).

    Example::

        streams = CudaStreams(torch.device("cuda", 0))
        side = streams.side_stream("reduce")
        side.wait_stream(streams.current_stream())
        with streams.on(side):
            host.copy_(shard, non_blocking=True)
        streams.keep_for(shard, side)
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._side: dict[str, torch.cuda.Stream] = {}

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def side_stream(self, name: str) -> torch.cuda.Stream:
        stream = self._side.get(name)
        if stream is None:
            stream = self._side[name] = torch.cuda.Stream(self.device)
        return stream

    def on(self, stream: torch.cuda.Stream) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def keep_for(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)


def cuda_streams(device: torch.device) -> CudaStreams | None:
    """Side streams for ``device`` when it is a CUDA device; ``None`` (copies stay synchronous) otherwise."""
    return CudaStreams(device) if device.type == "cuda" else None


class AllEvents:
    """Several events waited for as one (the copies of units on different side streams)."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def query(self) -> bool:
        return all(event.query() for event in self.events)

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()
