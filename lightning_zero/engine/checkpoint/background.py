"""Asynchronous saves: the checkpoint staged in host memory while training waits, written by a thread while it runs.

[Note: asynchronous saves]
With ``async_save=True`` (or Lightning's ``AsyncCheckpointIO`` plugin), a save returns as soon as this rank's
pieces are copied; the save protocol (see [Note: save protocol] in ``saving.py``) then runs, unchanged, in a
thread, and training goes on:

- *Staging.* ``stage_on_host`` copies every tensor of the checkpoint (this rank's shards of the parameters
  and optimizer states, buffers, scalar states) and rebuilds every container (dicts, lists, tuples) around
  the copies, in the training thread, at the save's point of the step: the next optimizer step updates the
  shards in place, and Lightning's callbacks keep mutating the dicts their ``state_dict`` returned
  (``ModelCheckpoint.best_k_models``). Every other object is deep-copied (``copy.deepcopy``, one memo for
  the whole checkpoint, so what two entries share stays shared): a ``set``, a ``bytearray``, a NumPy array
  or a user's object that ``on_save_checkpoint`` or ``fabric.save``'s state holds may change in place in the
  next steps, and the write must see what a synchronous save at this point would (Lightning's
  ``AsyncCheckpointIO`` shares them; immutable ones, numbers and strings, cost nothing: ``deepcopy`` returns
  them). An object that cannot be copied is refused with its place in the checkpoint named, before
  anything is written. A tensor's identity is kept: a piece saved under two tied names is copied once and
  written once. On the CPU a copy is a ``clone``, freed when the write is done. A
  CUDA tensor is copied into a pinned host buffer with ``non_blocking=True`` on a *side stream* (``"save"``:
  see [Note: copies off the compute stream] in ``core/streams.py``), which first waits for the compute stream
  (what it has queued so far, the step that made these values, comes first), and an event is recorded on the
  side stream after the copies; the host does not wait. The copies occupy the copy engine for bytes / PCIe
  bandwidth (about 1.3 GB at 25 GB/s is 50 ms); on the compute stream they would hold up every kernel queued
  after them, on the side stream they overlap whatever comes next. Two waits make that safe: the thread
  waits for the event before it reads a byte (``Staged.ready``), and the compute stream waits for the same
  event before the engine next writes what was copied, at the start of the next step (its forward updates
  buffers such as BatchNorm's statistics) or optimizer step (which updates the shards and optimizer states in
  place), whichever comes first (``Staged.order_writes``, given to ``ShardedModel.order_writes_after`` by the
  driver; a caller that names no such point gets the wait at once), so nothing is overwritten before it is
  copied. What is not ordered so: an in-place write into one of the saved
  tensors by user code between the save and the next step (a callback that edits a buffer or a stage-1/2
  parameter right after ``ModelCheckpoint`` saved), which may land before the copy; write in the step, or save
  with ``async_save=False``. The tensors copied from are kept (``Staged``) until the thread has seen the event:
  a temporary made for the checkpoint could otherwise be freed at once and its block handed by the caching
  allocator to the compute stream's next kernel while the side stream still reads it. The pinned
  buffers are kept for the next save of the same shapes (pinning is slow: ``cudaHostRegister`` locks the
  pages), so a run that saves asynchronously holds one extra host copy of its shards, exactly the size of
  this rank's part of the checkpoint (see [Note: exact pinned memory] in ``core/pinned.py``). Not yet run on a
  GPU: the orders are CUDA's stream semantics, checked on a CPU with a recording fake (``tests/test_streams.py``).
- *The thread's collectives.* The protocol's exchanges (the temporary name, the failure reports, the
  checksums, DCP's plans) run on a gloo group of their own, created at the first asynchronous save (every
  rank is in the save, agreed: see ``agree_event``): on the training group they would interleave with the
  step's collectives in an order no two ranks share. DCP's pieces are rebuilt on a CPU mesh of that group.
- *One save in flight.* The next save waits for the previous one first (the staging buffers are reused, and
  two commits to one name must not race), and so do ``remove_checkpoint`` of the path being written,
  loading a checkpoint, ``teardown`` and a failure (``wait_after_failure``, bounded by the process group's
  timeout). What the protocol raises in the thread (``CheckpointSaveError``, the same on every rank) is
  raised again by the next wait, on every rank at the same point, so a failed background save is never
  silent. A crash before the commit leaves the previous checkpoint as it was: the thread runs the same
  protocol and the same crash points as a synchronous save.
- The thread is not a daemon: an interpreter that reaches its end with a save in flight finishes the save
  before it exits (a Fabric script that ends right after ``fabric.save``).
- *The thread's device.* CUDA's current device belongs to a host thread, and a new thread starts on device 0,
  whatever device the training thread uses. The thread's first CUDA call (``Staged.ready``'s event
  synchronisation; torch's ``Event.synchronize`` sets no device) would then initialise device 0's primary
  context in this process: on every rank, a context of some hundred MiB on GPU 0, and GPU 0 holding one per
  rank of the node. So the thread makes the save's device current before anything else (``start``'s
  ``device``: by default the one the staged tensors came from, else the training thread's current CUDA
  device), as torch's DataLoader pin-memory thread does with ``torch.cuda.set_device``. This is read from
  CUDA's threading model, not seen on a device: no GPU has run it yet.
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from lightning_zero.engine.core.pinned import CUDA_HOST, HostRegistration, pinned_empty
from lightning_zero.engine.core.streams import Streams, cuda_streams
from lightning_zero.engine.errors import CheckpointSaveError
from lightning_zero.engine.io.ranks import Ranks
from lightning_zero.engine.io.torch_file import FlatPiece


@dataclass
class PinnedBuffers:
    """Pinned host buffers for the CUDA tensors of a save, by their order in the checkpoint: reused by the next save
    whose tensor at that position has the same shape and dtype (see [Note: asynchronous saves])."""

    buffers: list[torch.Tensor] = field(default_factory=list)
    host: HostRegistration = CUDA_HOST  # how buffers are pinned (a recording fake in tests)

    def take(self, index: int, like: torch.Tensor) -> torch.Tensor:
        if index < len(self.buffers):
            buffer = self.buffers[index]
            if buffer.shape == like.shape and buffer.dtype == like.dtype:
                return buffer
        buffer = pinned_empty(like.shape, like.dtype, self.host)  # exact: see [Note: exact pinned memory] in pinned.py
        if index < len(self.buffers):
            self.buffers[index] = buffer
        else:
            self.buffers.append(buffer)
        return buffer


class Staged:
    """A checkpoint staged in host memory (``stage_on_host``): ``state``, readable once ``ready()`` returned;
    ``device``: the CUDA device its tensors were copied from (``None`` when none was). ``sources``: the tensors
    copied from, kept until the copies are done; ``joins``: each device's streams and the event behind its copies,
    for ``order_writes``."""

    def __init__(
        self,
        state: Any,
        events: list[Any],
        device: torch.device | None = None,
        sources: list[torch.Tensor] | None = None,
        joins: list[tuple[Streams, Any]] | None = None,
    ) -> None:
        self.state = state
        self._events = events
        self.device = device
        self._sources = sources or []
        self._joins = joins or []

    def ready(self) -> None:
        """Wait for the device-to-host copies (nothing to wait for on the CPU); the tensors copied from may go."""
        for event in self._events:
            event.synchronize()
        self._sources = []

    def order_writes(self) -> None:
        """Make each device's compute stream wait for the copies (see [Note: asynchronous saves]): call before
        anything writes the tensors copied from. Once; no host wait."""
        joins, self._joins = self._joins, []
        for streams, event in joins:
            streams.current_stream().wait_event(event)


def stage_on_host(
    obj: Any,
    pinned: PinnedBuffers,
    cpu_mesh: Callable[[], DeviceMesh] | None = None,
    streams: Callable[[torch.device], Streams | None] = cuda_streams,
    join_later: Callable[[Callable[[], None]], None] | None = None,
) -> Staged:
    """A copy of the checkpoint ``obj`` whose tensors are host copies and whose containers are new, taken now (see
    [Note: asynchronous saves]). ``cpu_mesh``: the mesh DTensor pieces of device tensors are rebuilt on. ``streams``:
    the side streams of a device (``None``: a CPU tensor is cloned; a recording fake in tests). ``join_later``: who
    runs ``Staged.order_writes`` before the next write of what was copied (``ShardedModel.order_writes_after``);
    without it the compute stream waits for the copies at once (safe whoever writes next, and the copies then hold
    up the kernels queued after them).

    Example::

        staged = stage_on_host({"w": torch.ones(2)}, PinnedBuffers())
        staged.ready()
        assert staged.state["w"].sum() == 2
    """
    memo: dict[int, Any] = {}
    devices: set[torch.device] = set()  # copied on their current stream (a device without side streams)
    on_side: dict[torch.device, Streams | None] = {}  # each device's side streams, once they wait for its compute
    sources: list[torch.Tensor] = []
    slots = itertools.count()  # the position of each device tensor, for its pinned buffer

    def host(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.device not in on_side:
            side_streams = on_side[tensor.device] = streams(tensor.device)
            if side_streams is not None:  # after what the compute stream has queued so far
                side_streams.side_stream("save").wait_stream(side_streams.current_stream())
        side_streams = on_side[tensor.device]
        if side_streams is None and tensor.device.type == "cpu":
            return tensor.clone()
        buffer = pinned.take(next(slots), tensor)
        if side_streams is None:
            buffer.copy_(tensor, non_blocking=True)
            devices.add(tensor.device)
            return buffer
        with side_streams.on(side_streams.side_stream("save")):
            buffer.copy_(tensor, non_blocking=True)
        sources.append(tensor)  # kept until the copy is done (see [Note: asynchronous saves])
        return buffer

    def mesh_for(piece: DTensor) -> DeviceMesh:
        if piece.device_mesh.device_type == "cpu":
            return piece.device_mesh
        if cpu_mesh is None or piece.device_mesh.ndim != 1:
            raise TypeError(
                f"a DTensor on a {piece.device_mesh.ndim}-D {piece.device_mesh.device_type} mesh cannot "
                "be staged for an asynchronous save"
            )
        return cpu_mesh()

    copies: dict[int, Any] = {}  # copy.deepcopy's memo, shared by every object copied

    def stage(item: Any, where: str) -> Any:
        if id(item) in memo:
            return memo[id(item)]
        if isinstance(item, FlatPiece):
            result: Any = FlatPiece(item.key, item.shape, item.dtype, host(item.local), item.offset)
        elif isinstance(item, DTensor):
            local = item.to_local()
            if isinstance(local, LocalShardsWrapper):
                local = LocalShardsWrapper([host(t) for t in local.local_shards()], list(local.local_offsets()))
            else:
                local = host(local)
            result = DTensor.from_local(
                local, mesh_for(item), item.placements, run_check=False, shape=item.shape, stride=item.stride()
            )
        elif isinstance(item, torch.Tensor):
            result = host(item)
        elif isinstance(item, dict):
            result = copy.copy(item)  # keeps the type and attributes (a state dict's _metadata), copied below
            for key, value in item.items():
                result[key] = stage(value, f"{where}[{key!r}]")
            for name, value in vars(item).items() if hasattr(item, "__dict__") else ():
                result.__dict__[name] = stage(value, f"{where}.{name}")
        elif isinstance(item, list):
            result = [stage(value, f"{where}[{i}]") for i, value in enumerate(item)]
        elif isinstance(item, tuple):
            values = [stage(value, f"{where}[{i}]") for i, value in enumerate(item)]
            result = type(item)(*values) if hasattr(item, "_fields") else type(item)(values)
        else:
            result = copy_value(item, where, copies)
        memo[id(item)] = result
        return result

    state = stage(obj, "checkpoint")
    events = []
    joins: list[tuple[Streams, Any]] = []
    for side_streams in on_side.values():
        if side_streams is not None:
            event = side_streams.new_event()
            event.record(side_streams.side_stream("save"))
            events.append(event)
            joins.append((side_streams, event))
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    copied = devices | {d for d, s in on_side.items() if s is not None and d.type != "cpu"}
    first = min(copied, key=lambda d: d.index or 0) if copied else None
    staged = Staged(state, events, first, sources, joins)
    if join_later is None:
        staged.order_writes()
    else:
        join_later(staged.order_writes)
    return staged


def copy_value(value: Any, where: str, memo: dict[int, Any]) -> Any:
    """A deep copy of ``value`` (at ``where`` in the checkpoint), as a synchronous save would write it now; an object
    that cannot be copied is refused with its place named (see [Note: asynchronous saves])."""
    try:
        return copy.deepcopy(value, memo)
    except Exception as err:
        raise TypeError(
            f"an asynchronous save copies the checkpoint when it is saved, and {where} (a {type(value).__name__}) "
            f"cannot be copied ({type(err).__name__}: {err}): make it copyable (copy.deepcopy), store its state "
            "instead of the object, or save with async_save=False"
        ) from err


class BackgroundSaves:
    """At most one save in flight, written by a thread over a process group of its own (see [Note: asynchronous
    saves]). Held by the driver; ``wait`` at every point that needs the save done.

    Example::

        saves = BackgroundSaves()
        ranks = saves.prepare(timedelta(minutes=30))  # the previous save done, the save group made
        staged = stage_on_host(checkpoint, saves.pinned, saves.cpu_mesh)
        saves.start(path, lambda r: save_full(r, staged.state, path), staged, ranks)
        ...
        saves.wait()  # raises what the save raised
    """

    def __init__(self, use_device: Callable[[torch.device], None] | None = None) -> None:
        self.pinned = PinnedBuffers()
        # What the thread runs first with the save's device (see [Note: asynchronous saves], the thread's device).
        self._use_device = use_device or use_device_in_thread
        self._thread: threading.Thread | None = None
        self._path: Path | None = None
        self._error: BaseException | None = None
        self._group: Any = None
        self._mesh: DeviceMesh | None = None

    # ------------------------------------------------------------------ the thread's ranks
    def _ranks(self, timeout: timedelta) -> Ranks:
        """The ranks of a background save: every rank, on the save group (made on the first call: a collective)."""
        if not (dist.is_available() and dist.is_initialized()):
            return Ranks(0, 1, lambda obj: obj)
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        group = self._group

        def broadcast(obj: Any) -> Any:
            objects = [obj]
            dist.broadcast_object_list(objects, src=0, group=group)
            return objects[0]

        return Ranks(dist.get_rank(), dist.get_world_size(), broadcast, group)

    def cpu_mesh(self) -> DeviceMesh:
        """A 1-D CPU mesh over the save group, for DCP's pieces of device tensors staged on the host."""
        if self._mesh is None:
            assert self._group is not None, "cpu_mesh() after the save group exists (start or prepare)"
            self._mesh = DeviceMesh.from_group(self._group, "cpu")
        return self._mesh

    def prepare(self, timeout: timedelta) -> Ranks:
        """The background ranks, their group created if needed; call on every rank, before staging."""
        self.wait()
        return self._ranks(timeout)

    # ------------------------------------------------------------------ one save
    def start(
        self,
        path: Path,
        write: Callable[[Ranks], None],
        staged: Staged,
        ranks: Ranks,
        device: torch.device | None = None,
    ) -> None:
        """Run ``write(ranks)`` (the save protocol on ``staged.state``) in the background, in a thread whose current
        device is ``device`` (default: ``staged.device``, else the calling thread's current CUDA device, if any)."""
        assert self._thread is None, "one save at a time: prepare() waits for the previous one"
        device = device or staged.device or _current_cuda_device()

        def run() -> None:
            try:
                if device is not None:
                    self._use_device(device)  # first: see [Note: asynchronous saves], the thread's device
                staged.ready()
                write(ranks)
            except BaseException as error:  # raised again by the next wait(), in the training thread
                self._error = error

        self._path = path
        self._thread = threading.Thread(target=run, name=f"lightning_zero save {path.name}", daemon=False)
        self._thread.start()

    def writing(self, path: Path) -> bool:
        """Whether the save in flight (if any) writes ``path``."""
        return self._path is not None and _same(self._path, path)  # set while a thread is held

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Wait for the save in flight; raise what it raised (``CheckpointSaveError``: every rank raises it)."""
        thread, path = self._thread, self._path
        if thread is None:
            return
        thread.join()
        self._thread = self._path = None
        error, self._error = self._error, None
        if error is None:
            return
        if isinstance(error, CheckpointSaveError):
            raise error
        raise CheckpointSaveError(
            f"the asynchronous save of {str(path)!r} failed on this rank ({type(error).__name__}: {error}); the "
            "previous checkpoint of that name, if any, is unchanged"
        ) from error

    def wait_after_failure(self, timeout: float) -> BaseException | None:
        """After the run failed: wait at most ``timeout`` seconds for the save in flight (a peer that died makes it
        fail at once; one that hangs, at the group's timeout); what it raised is returned, not raised."""
        thread = self._thread
        if thread is None:
            return None
        thread.join(timeout)
        if thread.is_alive():
            return CheckpointSaveError(
                f"the asynchronous save of {str(self._path)!r} was still being written when the run failed; it "
                "will be committed only if every rank finishes it, otherwise the previous checkpoint stays"
            )
        try:
            self.wait()
        except CheckpointSaveError as error:
            return error
        return None

    def close(self) -> None:
        """After ``wait``: the save group goes (the next run makes its own)."""
        if self._thread is not None and self._thread.is_alive():
            return  # still in flight after a failure: its group must stay for it
        self._thread = self._path = None
        self._mesh = None
        group, self._group = self._group, None
        if group is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group(group)


def use_device_in_thread(device: torch.device) -> None:
    """Make ``device`` the calling thread's current device (CUDA only: a CPU has none)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _current_cuda_device() -> torch.device | None:
    """The calling thread's current CUDA device, if CUDA is in use in this process (never initialises it)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return a == b
