"""``ShardedUnit``: the parameters that are gathered, reduced and stepped together.

[Note: unit memory]
A unit owns one flat buffer, ``flat`` (see [Note: flat layout] in ``layout.py``), whose views *are*
the module's parameters (``param.data`` points into it, so tied references, ``module.weight`` and
the autograd graph keep working). ``flat`` holds the *compute* copy, in ``dtype`` (the
``param_dtype`` under mixed precision, otherwise the module's own dtype).

The optimizer steps the *master* shard, ``master``: this rank's slice of the unit in
``master_dtype`` (the dtype the module was built in, fp32 under mixed precision), on
``master_device`` (the CPU when the optimizer is offloaded). Each parameter has a ``shard_param``,
a 1-D ``nn.Parameter`` over its piece of ``master``; the user's optimizer steps those and nothing
else does. ``shard`` is the compute-dtype slice that all-gathers read from:

- without a separate master (same dtype and device), ``master`` *is* ``shard``;
- with one, stages 1 and 2 keep ``shard`` as a view of ``flat``; stage 3 keeps no compute shard
  (the master is cast on the fly before each gather, so stage 3 holds ``16Ψ/N`` bytes under mixed
  precision as in fp32) unless the master is offloaded, where a persistent compute shard saves a
  host-to-device copy per gather;
- with ``offload_params`` (stage 3), ``shard`` is in host memory next to the master: the master
  itself when the dtypes match, else a host tensor in the compute dtype (see [Note: parameter
  offload]).

- ``reshard_after_forward=False`` (stages 1 and 2): ``flat`` is always allocated; after the
  optimizer step the master shard is copied into ``shard`` and all-gathered in place.
- ``reshard_after_forward=True`` (stage 3): ``flat``'s storage is resized to 0 bytes while the
  unit is ``SHARDED``; ``unshard()`` re-allocates it and all-gathers into it. Writes go through
  ``flat``, which does not share the parameters' version counters, so tensors saved for backward
  stay usable. The parameters themselves never point into freed storage: see [Note: parameters
  outside their unit's use].

[Note: parameters outside their unit's use]
A stage-3 parameter is always the same ``nn.Parameter`` object (optimizers, tied modules, autograd
and user code keep their references), but what its ``.data`` is depends on the unit's state:

- ``UNSHARDED``: a view of ``flat`` (the gathered values);
- ``SHARDED``: a *placeholder*: one NaN element expanded to the parameter's shape (stride 0), which
  never points into freed memory, and the parameter itself switched to a subclass of its class whose
  ``__torch_function__`` answers every use (see [Note: reading a sharded parameter] in
  ``placeholder.py``): metadata (``shape``, ``dtype``, ``device``, ``numel()``, ``requires_grad``) as
  under DDP; a read of values (``p.norm()``, ``p.detach().cpu()``) from a copy gathered for it, when
  every rank reads; an in-place write, which would be lost, refused with ``ShardedParameterWriteError``.
  What only the engine can still write into a placeholder is caught by version: an in-place write bumps
  the parameter's version counter, and the next ``unshard()`` compares it with the one recorded at
  ``reshard()`` and raises ``ShardedParameterWriteError`` naming the parameter.

Reading a freed storage crashed the process; a placeholder cannot. Code that reads many parameters
outside a forward is faster inside ``ShardedModel.gathered_parameters()`` (full values in the master
dtype, writes go back to the shards), or with ``module.state_dict()``, which gathers each unit once (see
``StateDictGatherer`` in ``full_state.py``). FSDP2 answers the same question with DTensor parameters;
our flat layout splits parameters at arbitrary element offsets, which a DTensor placement cannot
describe, and DeepSpeed leaves an empty tensor, which reads as a silently wrong shape.

During an optimizer step (``ShardedModel.on_shards``) a parameter's ``.data`` is its 1-D master
piece and its ``.grad`` the sharded gradient, so the user's optimizer steps the module's own
parameters: ``param_groups`` and ``state`` keep the objects Lightning callbacks look for.

Gradients are never kept here: ``schedule/reduce.py`` packs the full gradients into a ``reduce_dtype``
buffer, reduce-scatters it, and returns this rank's shard in the master dtype and device; the full
gradients are dropped.

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
times as many bytes) usually hides.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_zero.engine.comm.comm import Comm, Pending
from lightning_zero.engine.comm.device_wait import wait_for_device
from lightning_zero.engine.comm.labels import label
from lightning_zero.engine.comm.quantized import all_gather_quantized, plan_blocks
from lightning_zero.engine.core.layout import ParamShard, ShardLayout
from lightning_zero.engine.core.ledger import GatherLedger
from lightning_zero.engine.core.param_checks import check_unit_params
from lightning_zero.engine.core.pinned import PinnedPool, pinned_copy
from lightning_zero.engine.core.placeholder import (
    ShardedParameterReadError,
    ShardedParameterWriteError,
    arrive,
    check_conversion,
    hide,
    passthrough,
    reveal,
    settle,
)
from lightning_zero.engine.core.streams import Streams, cuda_streams

HALF_DTYPES = (torch.float16, torch.bfloat16)
_VERSION = operator.attrgetter("_version")
_DATA_PTR = torch.Tensor.data_ptr


class UnitState(enum.Enum):
    """Whether a unit's full parameters exist on this rank (see [Note: unit lifecycle])."""

    SHARDED = "sharded"
    UNSHARDED = "unsharded"


class UnitPhase(enum.Enum):
    """Where the current step is with a unit (see [Note: unit lifecycle]).

    [Note: unit lifecycle]
    A unit has two states, which answer different questions and change at different points:

    - its *storage*, ``UnitState``: ``SHARDED`` (only this rank's shard exists; the parameters are placeholders)
      or ``UNSHARDED`` (``flat`` is allocated and gathered, or being gathered: ``gather_in_flight``). Only
      ``unshard()`` and ``reshard()`` change it (both idempotent), and ``release``. Stages 1 and 2 stay
      ``UNSHARDED``.
    - its *phase*, ``UnitPhase``: how far the step has got with the unit, which decides when its storage may be
      freed. The stage-3 schedule sets it (``Stage3Hooks``); under stages 1 and 2 nothing is gathered or freed
      per unit, no module hook runs, and every unit stays ``IDLE``.

    Over one training step (FSDP2's ``TrainingState`` has the same four)::

        IDLE -> FORWARD -> IDLE -> PRE_BACKWARD -> POST_BACKWARD -> IDLE
             pre-      post-    backward      its gradients     end of
             forward   forward  reaches it    reduced           backward

    - ``FORWARD``: from the unit's forward pre-hook to its post-hook, in training and evaluation alike (a module
      called twice goes ``FORWARD -> IDLE`` twice). A forward while the unit is ``PRE_BACKWARD`` is an
      activation-checkpointing recomputation inside backward: the phase stays, and so does the storage (what the
      recomputation saves for backward is the parameters themselves).
    - ``IDLE`` after forward: freed, unless held (the root unit during a step) or kept for backward (the last unit
      of the recorded forward; every unit without ``reshard_after_forward``: see [Note: prefetch] in
      ``stage3.py``). The storage says which.
    - ``PRE_BACKWARD``: a gradient reached an output of the unit's forward; the unit is gathered (again) and stays
      so while its backward may still read its parameters.
    - ``POST_BACKWARD``: backward is done with the unit: the reduce-scatter of its trainable parameters' gradients
      is issued (see [Note: reduce order] in ``grads.py``) and, if it has a frozen parameter, its inputs' gradients
      are computed (see [Note: frozen units] in ``stage3.py``). It is freed then, unless held. A unit that backward
      reaches again (a graph that gets to it by another path later) goes back to ``PRE_BACKWARD``.
    - ``IDLE`` when the backward pass ends (``Stage3Hooks.after_backward``): units still ``PRE_BACKWARD`` (one with
      a frozen parameter whose inputs' gradients never came) are freed then. And when the step ends
      (``Stage3Hooks.end_step``) with no unit ``PRE_BACKWARD``: a forward that raised leaves its unit ``FORWARD``,
      a step without backward leaves every unit ``IDLE`` already.

    What is not a unit's phase stays where it is decided: whether the backward pass has started, which units are
    held and which reductions were issued (the schedule's, for this pass), which gradients each rank produced (the
    reducer's). The hooks that move a unit on are ranges in a profiler trace, ``ZeRO::pre_forward``,
    ``ZeRO::post_forward``, ``ZeRO::pre_backward``, and so is its work, ``ZeRO::gather``, ``ZeRO::reduce_grads``,
    ``ZeRO::release`` (see [Note: profiler labels] in ``comm/labels.py``).
    """

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


class ShardedUnit:
    """One group of parameters with its flat buffer and shards (see [Note: unit memory]).

    Example::

        unit = ShardedUnit("layer", layer, [layer.weight, layer.bias], ["weight", "bias"], comm,
                           reshard_after_forward=True, param_dtype=torch.bfloat16)
        unit.unshard()            # all-gather in bfloat16: layer.weight is usable
        unit.reshard()            # free the gathered storage again
        unit.shard_params         # fp32 master pieces, stepped by the optimizer

    With ``offload_params=True`` (stage 3) the shards stay in host memory and each ``unshard()`` copies this
    rank's shard to the device first (see [Note: parameter offload]).
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        params: list[nn.Parameter],
        param_names: list[str],
        comm: Comm,
        reshard_after_forward: bool,
        sync_from_rank0: bool = True,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        offload: bool = False,
        full: torch.Tensor | None = None,
        replicate: Comm | None = None,
        offload_params: bool = False,
        quantize_weights: str | None = None,
        quantize_grads: str | None = None,
    ) -> None:
        check_unit_params(name, params, param_names)
        if offload_params and not reshard_after_forward:
            raise ValueError(
                f"unit {name!r}: offload_params needs a unit that is freed after use (stage 3); stages 1 and 2 keep "
                "the full parameters on the device"
            )
        self.name = name
        self.module = module
        self.params = params
        self.param_names = param_names
        self.comm = comm  # the shard group (all ranks unless hybrid: see [Note: hybrid sharding] in mesh.py)
        self.replicate = replicate  # the replicate group under hybrid sharding, else None
        self.reshard_after_forward = reshard_after_forward
        self.layout = ShardLayout.from_shapes([p.shape for p in params], comm.world_size)
        self.param_shards: list[ParamShard] = self.layout.param_shards(comm.rank)
        self._piece_split = _piece_split(self.param_shards, self.layout.shard_numel)
        self._empty = [index for index, p in enumerate(params) if p.numel() == 0]  # (shapes never change)
        self.master_dtype = params[0].dtype
        self.dtype = param_dtype or self.master_dtype
        # Gradients of half-precision parameters are summed in fp32 unless asked otherwise (accuracy).
        self.reduce_dtype = reduce_dtype or (torch.float32 if self.dtype in HALF_DTYPES else self.master_dtype)
        self.device = params[0].device if full is None else full.device
        self.offload = offload or offload_params  # parameters on the host imply the master there too
        self.offload_params = offload_params
        self.master_device = torch.device("cpu") if self.offload else self.device
        # See [Note: quantized collectives] in comm/quantized.py: the gathers for compute, and the reduce-scatters.
        self.quantize_weights = quantize_weights if reshard_after_forward and not comm.skips_collectives else None
        self.quantize_grads = quantize_grads if not comm.skips_collectives else None
        self.holds_quantized = False  # ``flat`` holds dequantized values of a quantized gather, not the master's
        # Which blocks of each rank's range go exactly (the blocks across parameters), decided once from the layout:
        # see [Note: blocks that span parameters] in comm/quantized.py.
        self.block_plan = (
            plan_blocks(
                self.layout.shard_numel,
                comm.world_size,
                (offset for offset, numel in zip(self.layout.offsets, self.layout.numels) if numel),
                self.device,
            )
            if self.quantize_weights or self.quantize_grads
            else None
        )
        self.separate_master = self.dtype != self.master_dtype or self.offload
        self._pin = self.offload and self.device.type == "cuda"  # see [Note: offload copies]
        # The host buffers the sharded gradients are copied into, reused step after step (see [Note: exact pinned
        # memory] in pinned.py).
        self.host_grads = PinnedPool() if self._pin else None
        # The side streams of the copies between host and device (see [Note: copies off the compute stream] in
        # streams.py): only where there are such copies (offload on CUDA). ``ShardedModel`` gives its units one set.
        self.streams: Streams | None = cuda_streams(self.device) if self._pin else None
        self.copied_to_host: Any = None  # the event behind the last copy of a sharded gradient to the host

        if full is None:
            full = self._flatten(self.master_dtype)
        if sync_from_rank0:
            # Every rank starts from rank 0's values, as with DDP (in the master dtype: nothing is rounded).
            comm.broadcast(full, src=0)
            if replicate is not None:  # then from the first shard group, whose ranks now all hold rank 0's
                replicate.broadcast(full, src=0)
        start, end = self.layout.shard_range(comm.rank)
        if self.separate_master:
            if self._pin:  # see [Note: exact pinned memory] in pinned.py
                self.master = pinned_copy(full[start:end])
            else:
                self.master = full[start:end].to(self.master_device, copy=True)
            self.flat = full if self.dtype == self.master_dtype else full.to(self.dtype)
            del full
            self.shard: torch.Tensor | None = None
            if not reshard_after_forward:
                self.shard = self.flat[start:end]
            elif offload_params:  # on the host (see [Note: parameter offload])
                self.shard = self.master if self.dtype == self.master_dtype else self._host_copy(self.master)
            elif self.offload:
                self.shard = self.flat[start:end].clone()
        else:
            self.flat = full
            self.master = self.flat[start:end].clone() if reshard_after_forward else self.flat[start:end]
            self.shard = self.master
        self._point_params_into(self.flat)
        # Views of ``flat`` (valid across storage resizes) and placeholders, made once: switching between
        # them is one ``.data`` assignment per parameter (see [Note: parameters outside their unit's use]).
        self._views = [p.data for p in params]
        self._placeholders = [placeholder_like(p) for p in params]
        self._hidden_classes: dict[type, type] = {}  # see [Note: reading a sharded parameter] in placeholder.py
        self._arriving_classes: dict[type, type] = {}  # see [Note: parameters whose values are on their way]
        self._arriving = False  # the parameters wait for ``_gathering`` on use (the post-step gather in flight)
        self.between_runs: str | None = None  # set while the model stays sharded between runs (ShardedModel.release)
        self._exposed = True
        self._versions_when_hidden: list[int] = []
        self._aliases: dict[int, torch.Tensor] = {}  # see ``adopt_rebound_data``
        self._gathering: Pending | None = None  # an all-gather into ``flat`` in flight (prefetch)
        self.ledger: GatherLedger | None = None  # told when the gathered storage is allocated and freed
        self._host_read: Any = None  # an event behind the last copy that reads the host shard or master
        # Whether the sharded gradients last reduced hold no inf/NaN on any rank: True/False when known for
        # every rank alike (set by GradReducer, at the step: see [Note: flags read at the step]), None when unknown.
        self.grads_finite: bool | None = None
        self.shard_params = [self._make_shard_param(p, piece) for p, piece in zip(params, self.param_shards)]
        self.state = UnitState.UNSHARDED
        self.phase = UnitPhase.IDLE  # set by the stage-3 schedule (see [Note: unit lifecycle])
        self.reshard()

    # ------------------------------------------------------------------ construction
    def _flatten(self, dtype: torch.dtype) -> torch.Tensor:
        flat = torch.zeros(self.layout.padded_numel, dtype=dtype, device=self.device)
        with torch.no_grad():
            for param, offset, numel in zip(self.params, self.layout.offsets, self.layout.numels):
                flat[offset : offset + numel].copy_(param.detach().reshape(-1))
        return flat

    def _point_params_into(self, flat: torch.Tensor) -> None:
        for param, offset, numel in zip(self.params, self.layout.offsets, self.layout.numels):
            param.data = flat[offset : offset + numel].view(param.shape)

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

    # ------------------------------------------------------------------ properties
    @property
    def is_unsharded(self) -> bool:
        return self.state is UnitState.UNSHARDED

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

    def _refresh_shard(self, non_blocking: bool = False) -> None:
        """Copy the master into the compute shard where that is a tensor of its own (``non_blocking`` for a
        copy from the pinned master to the device: see [Note: offload copies]), once an all-gather in flight that
        reads it or writes it is done.

        [Note: a refresh waits for the gather in flight]
        The compute shard is what an all-gather of the unit reads (stage 3 with ``offload``; the staging copy of
        ``offload_params`` is read from it), and under stages 1 and 2 it is a view of ``flat``, which the all-gather
        writes (this rank's chunk included). A refresh while such a gather is in flight (a post-step gather not yet
        waited for, a prefetch) would race it: on NCCL the gather runs on its own stream, which waited for the
        compute stream only up to its issue, so the refresh's copy could land before the gather read the old
        values, or the gather could write the old values over the refreshed ones; on gloo the gather's thread reads
        and writes the same memory. So the refresh first waits for the gather (``_finish_gather``: on NCCL a stream
        wait, the host does not block). ``gather_updated_shards`` refreshed before its own wait for the gather;
        no caller reached that with a gather in flight (an optimizer step reveals its units first, which waits;
        ``load_full_flat`` waits first), but nothing made it so: the wait is here, for every caller.
        """
        if self.separate_master and self.shard is not None and self.shard is not self.master:
            if self._gathering is not None:
                self._finish_gather()  # see [Note: a refresh waits for the gather in flight]
            self.wait_host_reads()
            if non_blocking and self.streams is not None and not self.offload_params:  # host master -> device shard
                with self._copy_in():  # see [Note: copies off the compute stream] in streams.py
                    self.shard.copy_(self.master, non_blocking=True)
                    self._record_host_read()
                return
            self.shard.copy_(self.master, non_blocking=non_blocking and self.shard.device != self.master.device)

    # ------------------------------------------------------------------ parameters
    def unshard(self, async_op: bool = False) -> None:
        """Make the full parameters usable (idempotent; a no-op for stages 1 and 2). ``async_op``
        (prefetch) only issues the all-gather: a later ``unshard()`` waits for it, and only then do the
        parameters point at the gathered values."""
        if self.state is UnitState.SHARDED:
            with label("ZeRO::gather", self.name):
                self.check_no_hidden_writes()
                storage = self.flat.untyped_storage()
                storage.resize_(self.layout.padded_numel * self.flat.element_size())
                if self.ledger is not None:
                    self.ledger.add(self.name, storage.nbytes())
                # From the copy-in stream with side streams, then waited for on the compute stream (below).
                issue_async = async_op or self.streams is not None
                with torch.no_grad(), self._copy_in():
                    # Which unit is gathered when depends on the model's control flow: checked (see
                    # [Note: collective checks] in sequence.py).
                    source = self._gather_source()
                    if self.block_plan is not None and self.quantize_weights:
                        self._gathering = all_gather_quantized(
                            self.comm,
                            self.flat,
                            source,
                            self.block_plan,
                            name=self.name,
                            guard=True,
                            async_op=issue_async,
                        )
                    else:
                        self._gathering = self.comm.all_gather(
                            self.flat, source, name=self.name, guard=True, async_op=issue_async
                        )
                    self.holds_quantized = self.quantize_weights is not None
            self.state = UnitState.UNSHARDED
        if not async_op:
            self.wait_gather()

    def serve_gather(self) -> None:
        """Take part in another rank's all-gather of this unit, the one its ``unshard()`` issues, into a buffer of
        its own that is dropped at once: this unit's state, storage and parameters are left as they are, so it may
        be called at any point, even while this unit is being gathered (a rank that serves the no-grad forwards of
        the ranks still running them: see [Note: joined forwards] in ``schedule/joined.py``)."""
        with label("ZeRO::serve_gather", self.name), torch.no_grad():
            scratch = torch.empty(self.layout.padded_numel, dtype=self.flat.dtype, device=self.flat.device)
            issue_async = self.streams is not None  # issued from the copy-in stream, waited for on the compute one
            with self._copy_in():
                source = self._gather_source()
                if self.block_plan is not None and self.quantize_weights:
                    pending = all_gather_quantized(
                        self.comm, scratch, source, self.block_plan, name=self.name, guard=True, async_op=issue_async
                    )
                else:
                    pending = self.comm.all_gather(scratch, source, name=self.name, guard=True, async_op=issue_async)
            if pending is not None:
                pending.wait()

    @property
    def gather_in_flight(self) -> bool:
        return self._gathering is not None

    def _finish_gather(self) -> None:
        if self._gathering is not None:
            self._gathering.wait()
            self._gathering = None
        if self._arriving:
            self._arriving = False
            settle(self.params)

    @property
    def arriving(self) -> bool:
        """Whether the post-step all-gather is in flight with the parameters waiting for it on use."""
        return self._arriving

    def leave_in_flight(self, pending: Pending | None) -> None:
        """Keep ``pending`` (this unit's post-step all-gather, from ``gather_updated_shards(async_op=True)``) in
        flight: the parameters wait for it when first used (see [Note: parameters whose values are on their way]
        in ``placeholder.py``)."""
        if pending is None:
            return
        self._gathering = pending
        if self._exposed:
            self._arriving = True
            arrive(self.params, self, self._arriving_classes)

    def wait_gather(self) -> None:
        """Wait for a prefetching all-gather, if one is in flight; the parameters then show its values."""
        self._finish_gather()
        if self.state is UnitState.UNSHARDED and not self._exposed:
            # Issued ahead (a prefetch, or at the start of a batch): user code ran in between.
            self.check_no_hidden_writes()
            reveal(self.params)
            self._set_param_data(self._views)
            self._exposed = True

    def reshard(self) -> None:
        """Free the full parameters (idempotent; a no-op for stages 1 and 2): they become placeholders."""
        if not self.reshard_after_forward or self.state is UnitState.SHARDED:
            return
        with label("ZeRO::release", self.name):
            self._finish_gather()
            self._set_param_data(self._placeholders)
            hide(self.params, self, self._hidden_classes)
            self._exposed = False
            self.record_hidden_versions()
            self.flat.untyped_storage().resize_(0)
            if self.ledger is not None:
                self.ledger.remove(self.name)
        self.state = UnitState.SHARDED

    def record_hidden_versions(self) -> None:
        """Remember the parameters' version counters while they are placeholders (see [Note: parameters outside
        their unit's use]); called by ``reshard()`` and after anything of ours that writes them legitimately."""
        with passthrough():  # a hidden parameter's attribute costs a ``__torch_function__`` call otherwise
            self._versions_when_hidden = list(map(_VERSION, self.params))

    def check_no_hidden_writes(self) -> None:
        """Raise ``ShardedParameterWriteError`` if user code wrote into a placeholder since ``reshard()``."""
        if self._exposed or not self._versions_when_hidden:
            return
        with passthrough():
            if list(map(_VERSION, self.params)) == self._versions_when_hidden:
                return
        for param, name, version in zip(self.params, self.param_names, self._versions_when_hidden):
            if param._version != version:
                raise ShardedParameterWriteError(
                    f"parameter {name!r} (unit {self.name!r}) was written in place while its unit was sharded "
                    "(stage 3, outside its module's forward), so the write would be lost. Write inside "
                    "`with trainer.strategy.gathered_parameters(module):` (or ShardedModel.gathered_parameters), "
                    "which writes back into the shards, or load values with module.load_state_dict(...)."
                )

    def adopt_rebound_data(self) -> None:
        """Take over values that user code gave a parameter by rebinding its ``.data`` (``p.data = x``: what
        ``torch.nn.utils.prune.remove`` and Lightning's ``ModelPruning`` do), which would otherwise detach it
        from the unit: the values go into the flat buffer and this rank's master piece, and the parameter
        points where it should again. Local (no collective); cheap when nothing was rebound."""
        with passthrough():
            self._adopt_rebound_data()

    def _adopt_rebound_data(self) -> None:
        expected = self._views if self._exposed else self._placeholders
        if list(map(_DATA_PTR, self.params)) == list(map(_DATA_PTR, expected)):
            return  # nothing rebound (the common case, checked in C; the loop below also lets empty parameters be)
        adopted = False
        for index, (param, want) in enumerate(zip(self.params, expected)):
            if param.data_ptr() == want.data_ptr() or param.numel() == 0:
                continue
            if self._on_master_piece(param, index):
                continue  # inside an optimizer step (ShardedModel.on_shards)
            new = param.data
            check_conversion(f"parameter {self.param_names[index]!r}", want, new.dtype, new.device)
            if new.shape != want.shape:
                raise ValueError(
                    f"parameter {self.param_names[index]!r} was given data of shape {tuple(new.shape)} "
                    f"(param.data = ...), but it was sharded with shape {tuple(want.shape)}: ZeRO cannot change a "
                    "parameter's shape during training. Keep the shape, or rebuild the model before fit."
                )
            adopted = True
            with torch.no_grad():
                if self.state is UnitState.UNSHARDED:  # gathered, or being gathered ahead of its use: the new
                    self._finish_gather()  # values go into the gathered buffer too, once the gather is done
                    self._views[index].copy_(new)
                piece = self.param_shards[index]
                if piece.numel:
                    values = new.reshape(-1)[piece.param_offset : piece.param_offset + piece.numel]
                    target = self.master[piece.shard_offset : piece.shard_offset + piece.numel]
                    self.wait_host_reads()
                    target.copy_(values)
                    if self.separate_master and self.shard is not None and self.shard is not self.master:
                        # the compute-dtype shard gathers read
                        self.shard[piece.shard_offset : piece.shard_offset + piece.numel].copy_(target)
            # Under DDP the rebound parameter trains in the memory it was given, so whoever holds that memory (the
            # tensor ``x`` of ``p.data = x``) sees it train: ``refresh_aliases`` keeps that true here.
            self.keep_alias(index, new)
            param.data = want
        if adopted and not self._exposed:  # (only then: re-recording would hide a write made into a placeholder)
            self.record_hidden_versions()

    def keep_alias(self, index: int, memory: torch.Tensor) -> None:
        """Remember that user code rebound parameter ``index`` to ``memory`` (see ``adopt_rebound_data``)."""
        self._aliases[index] = memory

    def refresh_aliases(self, values: list[torch.Tensor] | None = None) -> None:
        """Copy the parameters' current values (``values``, or the parameters themselves when they show them) into
        the memory user code once rebound them to (see ``adopt_rebound_data``)."""
        with torch.no_grad():
            for index, alias in self._aliases.items():
                alias.copy_(values[index] if values is not None else self.params[index])

    def _on_master_piece(self, param: nn.Parameter, index: int) -> bool:
        piece = self.shard_params[index]
        return param.data_ptr() == piece.data_ptr() and param.shape == piece.shape

    def shown_data(self) -> list[torch.Tensor]:
        """What each parameter's ``.data`` is now, once ``adopt_rebound_data`` has run: its view of the gathered
        values, or its placeholder (an empty parameter keeps whatever it was given: nothing is adopted for it)."""
        shown = list(self._views if self._exposed else self._placeholders)
        for index in self._empty:
            shown[index] = self.params[index].data
        return shown

    def piece_views(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's piece of ``shard`` (a 1-D tensor laid out as this rank's shard, such as its sharded
        gradient), as views in parameter order: ``shard[piece.shard_offset : piece.shard_offset + piece.numel]``
        for every piece, made by one ``split`` (a slice per parameter costs microseconds of Python each)."""
        sizes, picks = self._piece_split
        parts = shard.split_with_sizes(sizes)
        return [parts[i] for i in picks]

    def _set_param_data(self, tensors: list[torch.Tensor]) -> None:
        for param, data in zip(self.params, tensors):
            param.data = data

    def gather_updated_shards(self, async_op: bool = False) -> Pending | None:
        """After the optimizer stepped the master shard: refresh the compute shard, then the full
        parameters (stages 1 and 2) or the gathered copy if one is held (stage 3). With ``async_op``,
        return the all-gather in flight (wait on it before the parameters are read)."""
        with torch.no_grad():
            self._refresh_shard(non_blocking=self.offload)
            if self.reshard_after_forward and self.state is not UnitState.UNSHARDED:
                return None
            self.wait_gather()
            issue_async = async_op or self.streams is not None  # from the copy-in stream, after the refresh
            with label("ZeRO::gather", self.name), self._copy_in():
                self.holds_quantized = False  # gathered exactly (see [Note: quantized collectives])
                pending = self.comm.all_gather(self.flat, self._gather_source(), name=self.name, async_op=issue_async)
            if pending is not None and not async_op:
                pending.wait()  # (on the compute stream)
                return None
            return pending

    def after_master_loaded(self) -> None:
        """After this rank's master shard was written in place (pretrained weights, see [Note: pretrained weights
        under meta init] in ``pretrained.py``): refresh the compute shard and, where the full parameters are kept
        (stages 1 and 2), gather them again (a collective)."""
        pending = self.gather_updated_shards()
        if pending is not None:
            pending.wait()
        if not self._exposed:
            self.record_hidden_versions()

    def full_flat(self, purpose: str | None = None) -> torch.Tensor:
        """A full copy of the flat buffer in the master dtype, gathered (for state dicts). With ``purpose`` (what
        user code asked for: ``"state_dict()"``), the gather is named after it and agreed with the other ranks
        outside steps, so a call on one rank only is reported as such (see ``advice.explain_texts``). A unit
        gathered ahead and not yet in use (a prefetch; the next step's first gathers, see [Note: gathers at the
        start of a batch] in ``sharded_model.py``) is gathered again for such a call: what user code asks for is
        a collective whether or not the unit happens to be there already, so a read on one rank only fails the
        same way at every point of the loop."""
        self._finish_gather()
        exact = not self.holds_quantized  # a quantized gather is for compute only: gathered again, exactly
        if (
            self.state is UnitState.UNSHARDED
            and not self.separate_master
            and exact
            and (purpose is None or self._exposed)
        ):
            return self.flat.detach().clone()
        full = torch.empty(self.layout.padded_numel, dtype=self.master_dtype, device=self.device)
        name = self.name if purpose is None else f"{self.name} ({purpose})"
        self.comm.all_gather(full, self.master.to(self.device), name=name, guard=purpose is not None)
        return full

    def load_full_flat(self, full: torch.Tensor) -> None:
        """Take this rank's master shard (and compute copies) from a full flat tensor (any dtype)."""
        start, end = self.layout.shard_range(self.comm.rank)
        self._finish_gather()
        with torch.no_grad():
            self.wait_host_reads()
            self.master.copy_(full[start:end])
            self._refresh_shard()
            if self.state is UnitState.UNSHARDED:
                self.flat.copy_(full)
                self.holds_quantized = False

    def release_without_peers(self) -> None:
        """After a failure other ranks may not share: make the parameters safe to touch without any
        collective. What cannot be rebuilt alone (stage-3 parameters, or master values that only exist
        as shards under mixed precision) becomes NaN, loud rather than silently wrong; reload it from a
        checkpoint."""
        # A gather issued ahead whose peers may be gone is never waited for, and what it wrote is not trusted,
        # unless it is known to have completed (a post-step gather every rank issued before the failure).
        unfinished = self._gathering is not None and not self._gathering.completed()
        lost = self.state is UnitState.SHARDED or not self._exposed or self.separate_master or unfinished
        self._gathering = None
        self._arriving = False
        settle(self.params)
        reveal(self.params)
        with torch.no_grad():
            for param, view in zip(self.params, self._views):
                if lost:
                    param.data = torch.full(param.shape, float("nan"), dtype=self.master_dtype, device=self.device)
                else:
                    param.data = view.to(self.master_dtype, copy=True)
        self._exposed = True
        self.state = UnitState.UNSHARDED

    def release(self) -> None:
        """Give every parameter its own storage again, with the master values in the master dtype (the
        module becomes a plain module, as before sharding), and free this unit's shards and buffers at once, so
        that releasing a model unit by unit never holds much more than its full parameters (see [Note: what fits
        at the end] in ``free_memory.py``). The unit cannot be used afterwards."""
        self._finish_gather()
        reveal(self.params)
        in_place = self.state is UnitState.UNSHARDED and not self.separate_master
        full = self.flat if in_place else self.full_flat()  # the parameters' own values, or a gathered copy
        with torch.no_grad():
            for param, offset, numel in zip(self.params, self.layout.offsets, self.layout.numels):
                param.data = full[offset : offset + numel].view(param.shape).clone()
        del full
        self._exposed = True
        self.state = UnitState.UNSHARDED
        for shard_param in self.shard_params:
            shard_param.grad = None
            shard_param.data = shard_param.data.new_empty(0)
        self.master = self.master.new_empty(0)
        self.flat = self.flat.new_empty(0)
        if self.ledger is not None:
            self.ledger.remove(self.name)
        self.shard = None
        self._views, self._placeholders, self._aliases = [], [], {}

    # ------------------------------------------------------------------ user access and optimizer steps
    @property
    def needs_gather_to_read(self) -> bool:
        """Whether the parameters may not show the master values (stage 3, or a separate master)."""
        return self.reshard_after_forward or self.separate_master

    def show(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Point the parameters at ``tensors``; return what they pointed at (to ``show`` again later). Writes made
        meanwhile are the caller's to handle (``take_writes``)."""
        self._finish_gather()
        with passthrough():
            previous = [p.data for p in self.params]
        reveal(self.params)
        self._set_param_data(tensors)
        return previous

    def full_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view of a full flat tensor (``full_flat()``)."""
        return [
            full[offset : offset + numel].view(p.shape)
            for p, offset, numel in zip(self.params, self.layout.offsets, self.layout.numels)
        ]

    def take_writes(self, full: torch.Tensor) -> None:
        """After user code wrote into a gathered copy: this rank's slice becomes the master shard, and the
        compute copies are refreshed from the shards (a collective when the full parameters are kept)."""
        start, end = self.layout.shard_range(self.comm.rank)
        with torch.no_grad():
            self.wait_host_reads()
            self.master.copy_(full[start:end])
        pending = self.gather_updated_shards()
        if pending is not None:
            pending.wait()

    def hide_again(self, previous: list[torch.Tensor]) -> None:
        """Undo ``show``: the parameters point at ``previous`` again; what was written meanwhile is not a write
        into a placeholder."""
        self._set_param_data(previous)
        self.conceal_if_sharded()
        self.record_hidden_versions()

    def reveal(self) -> None:
        """Let the parameters behave as plain tensors (of whatever their ``.data`` is) until ``conceal_if_sharded``:
        for the engine's own work on them, e.g. an optimizer step on the master pieces (which may be slices of the
        buffer a gather in flight writes: waited for first)."""
        self._finish_gather()
        reveal(self.params)

    def conceal_if_sharded(self) -> None:
        """After ``reveal``: while the unit is sharded, reads go through [Note: reading a sharded parameter] again."""
        if not self._exposed:
            hide(self.params, self, self._hidden_classes)

    def read_values(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """The values of ``params`` (some of this unit's), gathered from every rank into a read-only copy in the
        master dtype (see [Note: reading a sharded parameter]). A collective: every rank reads the same."""
        names = [n for p, n in zip(self.params, self.param_names) if any(p is q for q in params)]
        if self.between_runs is not None:
            raise ShardedParameterReadError(
                f"parameter {names[0]!r} (unit {self.name!r}) was read between runs: the model stayed sharded when the "
                f"run ended, since its full parameters would not fit ({self.between_runs}). Its values can be read "
                "in the next trainer.validate/test/predict with the same Trainer, saved with "
                "trainer.save_checkpoint(...) on every rank (written in pieces, never whole) and read whole from the "
                "file with lightning_zero.consolidate_checkpoint(...), or gathered with "
                "trainer.strategy.full_state_dict() on every rank where they fit."
            )
        with torch.no_grad():
            views = self.full_views(self.full_flat(f"a read of {', '.join(names)} outside its forward"))
        return [views[next(i for i, p in enumerate(self.params) if p is q)] for q in params]

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


def placeholder_like(param: torch.Tensor) -> torch.Tensor:
    """A parameter's stand-in while its unit is sharded: one NaN element expanded to the parameter's shape
    (see [Note: parameters outside their unit's use])."""
    return torch.full((), float("nan"), dtype=param.dtype, device=param.device).expand(param.shape)


def _piece_split(pieces: list[ParamShard], shard_numel: int) -> tuple[list[int], list[int]]:
    """The ``split_with_sizes`` of a shard that yields every piece of ``pieces`` (see ``ShardedUnit.piece_views``):
    the sizes, gaps included, and which part is each piece. Pieces lie in parameter order along the shard (the flat
    layout is the parameters side by side); an empty piece is an empty part where the previous one ends."""
    sizes: list[int] = []
    picks: list[int] = []
    cursor = 0
    for piece in pieces:
        if piece.numel and piece.shard_offset > cursor:
            sizes.append(piece.shard_offset - cursor)  # padding, or a piece of another parameter
            cursor = piece.shard_offset
        if piece.numel and piece.shard_offset < cursor:
            raise AssertionError(f"shard pieces out of order: {pieces}")
        picks.append(len(sizes))
        sizes.append(piece.numel)
        cursor += piece.numel
    if cursor < shard_numel:
        sizes.append(shard_numel - cursor)
    return sizes, picks
