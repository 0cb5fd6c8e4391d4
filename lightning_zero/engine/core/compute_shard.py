"""``ShardStorage``: a unit's flat buffer, master shard and compute shard, and the copies between host and device.

[Note: shard forms]
``shard`` is the compute-dtype slice of this rank that every all-gather of the unit reads (see [Note: unit memory]
in ``unit.py``). What it is follows from the policy once, at construction (``ShardForm``), and never changes:

- ``MASTER``: the master itself (no separate master; or ``offload_params`` in the master's dtype, where the master
  is in host memory);
- ``FLAT_VIEW``: stages 1 and 2 with a separate master: a view of ``flat``, refreshed from the master after the
  step and gathered in place;
- ``CAST``: stage 3 with a separate master on the device: no compute shard at all; the master is cast before each
  gather, so stage 3 holds ``16Ψ/N`` bytes under mixed precision as in fp32;
- ``DEVICE_COPY``: stage 3 with the master offloaded: a persistent device copy saves a host-to-device copy per
  gather;
- ``HOST_COPY``: ``offload_params`` in a compute dtype other than the master's: a host tensor that
  ``gather_updated_shards`` refreshes from the master after each step (see [Note: parameter offload]).

[Note: offload copies]
With ``offload_optimizer`` the sharded gradient moves to the host once per unit, from a backward
hook, and the stepped master shard moves back once per unit after the step. Neither may block the
host: a blocking device-to-host copy waits for every kernel queued before it (the rest of backward
would stop being queued ahead), and a copy into pageable memory is staged and synchronous whatever
``non_blocking`` says. So:

- device to host (``to_master``): the shard is copied with ``non_blocking=True`` into a *pinned*
  host buffer of the unit's (``host_grads``, handed out again once the previous step's gradients
  are gone: see [Note: exact pinned memory] in ``pinned.py``), on CUDA on the ``"reduce"`` side
  stream, which first waits for the compute stream, itself ordered after the reduce-scatter by the
  collective's ``wait()`` (see [Note: copies off the compute stream] in ``streams.py``): no kernel
  queued later waits for the copy. The device-side source is dropped at once, marked for the side
  stream (``record_stream``), so that the caching allocator hands its block to nothing before the
  copy has read it. The host tensor must not be read before the copy lands. The only host reads
  before the optimizer step are in ``GradReducer._attach_pending`` (accumulation into an earlier
  sharded gradient); they come after an event recorded behind the last copy (on the side stream:
  ``host_copies_event``) has been waited for (polled: see [Note: waits for the device] in
  ``device_wait.py``), at the end of each backward pass, and the step comes later still. The finite
  check sums each shard on the device before the copy, so it reads nothing on the host.
- host to device (``gather_updated_shards``): the master is pinned when the unit is built, so
  ``copy_(non_blocking=True)`` is a real asynchronous copy, queued on the ``"copy_in"`` side stream
  (after it waited for the compute stream, which last used the compute shard), and the all-gather
  that reads the compute shard is issued from that stream after it (``_copy_in``); the compute
  stream waits only for the gather, where the parameters are used. The optimizer step (on the host)
  has finished writing the master by then, and the next step writes it only after
  ``wait_host_reads()`` has waited for the event recorded behind the copy.

On a CPU build every copy is between host tensors and synchronous: the behaviour is the same.

[Note: parameter offload]
With ``offload_params`` (stage 3 only; it implies ``offload``, as FSDP2's ``CPUOffloadPolicy`` and
FSDP1's ``CPUOffload(offload_params=True)`` do: a device-side master would outweigh the compute shard
it feeds) the compute shard ``shard`` lives in host memory: the master itself when ``dtype`` is the
master dtype, else a host tensor in ``dtype`` that ``gather_updated_shards`` refreshes from the master
after each step (a host-to-host cast). The device holds no piece of the unit between its uses; only
``flat`` while the unit is gathered, freed at ``reshard()`` as without offload.

- Pinned memory. On a CUDA device both host tensors are pinned (page-locked), so that a copy with
  ``non_blocking=True`` is a DMA transfer queued on the stream and returns at once; from pageable
  memory the driver stages the data through a pinned bounce buffer and the host waits for it. On a
  CPU-only build nothing can be pinned and there is no device to copy to: the all-gather reads the
  host shard directly, and the results are those of the unit without offload.
- Streams. ``_gather_source`` copies the host shard into a new device *staging* shard with
  ``non_blocking=True`` on the ``"copy_in"`` side stream, and the all-gather that reads the staging
  shard is issued from that stream (``_copy_in``, which first makes it wait for the compute stream:
  ``flat``'s new storage was allocated there). The collective (on NCCL's own stream) waits for the
  side stream at its launch, so it sees the copied values; the compute stream waits for the
  collective where the unit is used (``wait_gather``), and never for the copy itself (see [Note:
  copies off the compute stream] in ``streams.py``). A prefetch (``unshard(async_op=True)``) queues
  the copy and then the all-gather, in that order, and returns; a blocking gather is issued the same
  way and then waited for on the compute stream. The collective keeps the staging shard until it is
  waited for (``Pending``); the block then goes back to the side stream's pool, and the side stream's
  next use of it comes after its next wait for the compute stream, which by then has waited for the
  gather.
- When the host may write the shard again. A queued copy reads the host shard *later*, when the
  stream reaches it. The host writes that memory in the optimizer step (the master is the shard when
  the dtypes match), in ``gather_updated_shards`` (the cast into the compute shard), and when values
  are loaded or written back (``load_full_flat``, ``take_writes``, ``adopt_rebound_data``). An event is
  recorded behind each staging copy (on the side stream), and every one of those writers first calls
  ``wait_host_reads()``, which waits on the host for the event (free when the copy has landed, which by
  the optimizer step it has: the gathers it fed were waited for by the compute stream long before).
- Caching allocator. The staging shard is allocated per gather and freed once the gather is waited for;
  its block returns to the side stream's pool in the caching allocator and serves the next unit's staging
  shard, so the device's
  persistent parameter bytes are 0 and its peak grows by one staging shard per gather in flight (at
  most ``prefetch + 1``), ``1/N`` of a unit each.

The price is one host-to-device copy of the unit's shard (``1/N`` of the unit, in the compute dtype)
per gather: two per step with ``reshard_after_forward``, which the all-gather's own traffic (``N - 1``
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_zero.engine.comm.comm import Comm
from lightning_zero.engine.comm.device_wait import wait_for_device
from lightning_zero.engine.core.grouping import UnitPlan
from lightning_zero.engine.core.layout import ParamShard, ShardLayout
from lightning_zero.engine.core.pinned import PinnedPool, pinned_copy
from lightning_zero.engine.core.policy import HALF_DTYPES, EnginePolicy
from lightning_zero.engine.core.streams import Streams, cuda_streams


class ShardForm(enum.Enum):
    """What a unit's compute shard is (see [Note: shard forms])."""

    MASTER = "master"
    FLAT_VIEW = "flat_view"
    CAST = "cast"
    DEVICE_COPY = "device_copy"
    HOST_COPY = "host_copy"

    @classmethod
    def choose(cls, policy: EnginePolicy, same_dtype: bool) -> ShardForm:
        """The form for a unit of ``policy`` whose compute dtype is (``same_dtype``) or is not its master's."""
        if policy.offload.params:
            return cls.MASTER if same_dtype else cls.HOST_COPY
        if same_dtype and not policy.offload.optimizer:
            return cls.MASTER
        if not policy.frees_parameters:
            return cls.FLAT_VIEW
        return cls.DEVICE_COPY if policy.offload.optimizer else cls.CAST


class ShardStorage:
    """The memory of one unit (see [Note: unit memory] in ``unit.py`` and [Note: shard forms]): ``flat`` (the full
    compute copy, the parameters' views), ``master`` (this rank's slice in the master dtype, on the master device),
    ``shard`` (the compute shard every all-gather reads, in its ``form``), ``shard_params`` (the master pieces the
    optimizer steps), and the side streams and events of the copies between host and device. ``ShardedUnit``
    builds on it; constructing one broadcasts rank 0's values (a collective).
    """

    def __init__(
        self, plan: UnitPlan, comm: Comm, policy: EnginePolicy, full: torch.Tensor | None, replicate: Comm | None
    ) -> None:
        params = plan.params
        self.name = plan.name
        self.module = plan.module
        self.params = params
        self.param_names = plan.param_names
        self.policy = policy
        self.comm = comm  # the shard group (all ranks unless hybrid: see [Note: hybrid sharding] in mesh.py)
        self.replicate = replicate  # the replicate group under hybrid sharding, else None
        self.reshard_after_forward = policy.frees_parameters
        self.layout = ShardLayout.from_shapes([p.shape for p in params], comm.world_size)
        self.param_shards: list[ParamShard] = self.layout.param_shards(comm.rank)
        self.master_dtype = params[0].dtype
        self.dtype = policy.param_dtype or self.master_dtype
        # Gradients of half-precision parameters are summed in fp32 unless asked otherwise (accuracy).
        self.reduce_dtype = policy.reduce_dtype or (torch.float32 if self.dtype in HALF_DTYPES else self.master_dtype)
        self.device = params[0].device if full is None else full.device
        self.offload = policy.offload.optimizer
        self.offload_params = policy.offload.params
        self.master_device = torch.device("cpu") if self.offload else self.device
        self.form = ShardForm.choose(policy, self.dtype == self.master_dtype)
        self.separate_master = self.dtype != self.master_dtype or self.offload
        self._pin = self.offload and self.device.type == "cuda"  # see [Note: offload copies]
        # The host buffers the sharded gradients are copied into, reused step after step (see [Note: exact pinned
        # memory] in pinned.py).
        self.host_grads = PinnedPool() if self._pin else None
        # The side streams of the copies between host and device (see [Note: copies off the compute stream] in
        # streams.py): only where there are such copies (offload on CUDA). ``ShardedModel`` gives its units one set.
        self.streams: Streams | None = cuda_streams(self.device) if self._pin else None
        self.copied_to_host: Any = None  # the event behind the last copy of a sharded gradient to the host
        self._host_read: Any = None  # an event behind the last copy that reads the host shard or master
        self._allocate(self._flatten(self.master_dtype) if full is None else full)
        self.shard_params = [self._make_shard_param(p, piece) for p, piece in zip(params, self.param_shards)]

    # ------------------------------------------------------------------ construction
    def _allocate(self, full: torch.Tensor) -> None:
        """``flat``, ``master`` and ``shard`` from ``full`` (this unit's flat values), after every rank took rank
        0's values, as with DDP (in the master dtype: nothing is rounded)."""
        self.comm.broadcast(full, src=0)
        if self.replicate is not None:  # then from the first shard group, whose ranks now all hold rank 0's
            self.replicate.broadcast(full, src=0)
        start, end = self.layout.shard_range(self.comm.rank)
        if not self.separate_master:
            self.flat = full
            self.master = self.flat[start:end].clone() if self.reshard_after_forward else self.flat[start:end]
            self.shard: torch.Tensor | None = self.master
            return
        if self._pin:  # see [Note: exact pinned memory] in pinned.py
            self.master = pinned_copy(full[start:end])
        else:
            self.master = full[start:end].to(self.master_device, copy=True)
        self.flat = full if self.dtype == self.master_dtype else full.to(self.dtype)
        del full
        forms = {
            ShardForm.MASTER: lambda: self.master,  # offload_params in the master's dtype: on the host
            ShardForm.FLAT_VIEW: lambda: self.flat[start:end],
            ShardForm.CAST: lambda: None,
            ShardForm.DEVICE_COPY: lambda: self.flat[start:end].clone(),
            ShardForm.HOST_COPY: lambda: self._host_copy(self.master),  # see [Note: parameter offload]
        }
        self.shard = forms[self.form]()

    def _flatten(self, dtype: torch.dtype) -> torch.Tensor:
        flat = torch.zeros(self.layout.padded_numel, dtype=dtype, device=self.device)
        with torch.no_grad():
            for param, offset, numel in zip(self.params, self.layout.offsets, self.layout.numels):
                flat[offset : offset + numel].copy_(param.detach().reshape(-1))
        return flat

    def _host_copy(self, source: torch.Tensor) -> torch.Tensor:
        """``source`` in the compute dtype, in (pinned, on CUDA) host memory: the offloaded compute shard."""
        if self._pin:
            return pinned_copy(source, self.dtype)  # see [Note: exact pinned memory] in pinned.py
        host = torch.empty(source.shape, dtype=self.dtype, device=self.master_device)
        host.copy_(source)
        return host

    def _make_shard_param(self, param: nn.Parameter, piece: ParamShard) -> nn.Parameter:
        # Holds the master piece and, as its ``.grad``, the sharded gradient; never itself in an optimizer.
        data = self.master[piece.shard_offset : piece.shard_offset + piece.numel]
        return nn.Parameter(data, requires_grad=False)

    # ------------------------------------------------------------------ copies between host and device
    def _gather_source(self) -> torch.Tensor:
        """This rank's compute-dtype shard on the compute device, the input of every all-gather of the
        parameters (a staging copy of the host shard under ``offload_params``: see [Note: parameter offload]).
        With side streams, call inside ``_copy_in``, which the gather is issued from too."""
        if self.shard is None:
            return self.master.to(device=self.device, dtype=self.dtype)
        staged = self.offload_params and (self.shard.device != self.device or self.streams is not None)
        if not staged:
            return self.shard
        staging = torch.empty(self.shard.shape, dtype=self.shard.dtype, device=self.device)
        staging.copy_(self.shard, non_blocking=True)
        self._record_host_read()
        return staging

    @contextmanager
    def _copy_in(self) -> Iterator[None]:
        """Inside: the current stream is the side stream of copies to the device, after it waited for the compute
        stream (see [Note: copies off the compute stream] in ``streams.py``); nothing without side streams. What is
        issued inside may not be waited for inside: a collective is issued with ``async_op=True`` and waited for
        after, on the compute stream."""
        streams = self.streams
        if streams is None:
            yield
            return
        side = streams.side_stream("copy_in")
        side.wait_stream(streams.current_stream())
        with streams.on(side):
            yield

    def _record_host_read(self) -> None:
        """Record an event behind the copy just queued from host memory (``wait_host_reads`` waits for it)."""
        if self.streams is not None:
            event = self.streams.new_event()
            event.record(self.streams.current_stream())
            self._host_read = event
        elif self.device.type == "cuda":
            self._host_read = torch.cuda.Event()
            self._host_read.record()

    def wait_host_reads(self) -> None:
        """Before the host writes the host shard (or the master it may be): wait until every copy of it to the
        device queued so far has read it (see [Note: parameter offload]). Free when there is none."""
        if self._host_read is not None:  # (polled, through the stall report: see device_wait.py)
            wait_for_device(self.comm, self._host_read, f"the host shard of {self.name!r} read by its copies")
            self._host_read = None

    # ------------------------------------------------------------------ accounting
    def persistent_param_bytes(self) -> int:
        """Bytes of the compute copy this unit keeps on its device while not in use: the full parameters (stages 1
        and 2) or this rank's shard (stage 3, where it is also the master unless one is kept apart); 0 with
        ``offload_params``, whose shard is in host memory (``host_param_bytes``)."""
        if not self.reshard_after_forward:
            return self.layout.padded_numel * self.flat.element_size()
        if self.shard is None or self.offload_params:
            return 0
        return self.layout.shard_numel * self.shard.element_size()

    def host_param_bytes(self) -> int:
        """Bytes of the compute shard kept in host memory apart from the master (``offload_params`` with a
        compute dtype other than the master's); 0 otherwise, including when the host shard *is* the master,
        which ``master_bytes`` counts."""
        if not self.offload_params or self.shard is None or self.shard is self.master:
            return 0
        return self.layout.shard_numel * self.shard.element_size()

    def master_bytes(self) -> int:
        """Bytes of the master shard where it is stored apart from the compute copy (else 0)."""
        return self.layout.shard_numel * self.master.element_size() if self.separate_master else 0
