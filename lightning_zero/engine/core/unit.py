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
else does. ``shard`` is the compute-dtype slice that all-gathers read from, in one of five forms
fixed at construction (see [Note: shard forms] in ``compute_shard.py``).

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
"""

from __future__ import annotations

import operator

import torch

from lightning_zero.engine.comm.comm import Comm, Pending
from lightning_zero.engine.comm.labels import label
from lightning_zero.engine.comm.quantized import all_gather_quantized, plan_blocks
from lightning_zero.engine.core.arriving import arrive, settle
from lightning_zero.engine.core.compute_shard import ShardForm
from lightning_zero.engine.core.grouping import UnitPlan
from lightning_zero.engine.core.layout import ParamShard
from lightning_zero.engine.core.ledger import GatherLedger
from lightning_zero.engine.core.param_checks import check_unit_params
from lightning_zero.engine.core.placeholder import (
    ShardedParameterWriteError,
    hide,
    passthrough,
    reveal,
)
from lightning_zero.engine.core.policy import EnginePolicy
from lightning_zero.engine.core.unit_access import UnitAccess
from lightning_zero.engine.core.unit_state import ParamView, UnitPhase, UnitState

_VERSION = operator.attrgetter("_version")
_DATA_PTR = torch.Tensor.data_ptr


class ShardedUnit(UnitAccess):
    """One group of parameters with its flat buffer and shards (see [Note: unit memory]), gathered, freed and
    stepped together; its storage is ``ShardStorage``'s (see [Note: shard forms] in ``compute_shard.py``), and what
    user code does to its parameters outside their use is ``UnitAccess``'s (``unit_access.py``).

    Example::

        plan = UnitPlan("layer", layer, [layer.weight, layer.bias], ["weight", "bias"])
        unit = ShardedUnit(plan, comm, EnginePolicy(stage=3, param_dtype=torch.bfloat16))
        unit.unshard()            # all-gather in bfloat16: layer.weight is usable
        unit.reshard()            # free the gathered storage again
        unit.shard_params         # fp32 master pieces, stepped by the optimizer

    With ``EnginePolicy(stage=3, offload=Offload.PARAMS)`` the shards stay in host memory and each ``unshard()``
    copies this rank's shard to the device first (see [Note: parameter offload] in ``compute_shard.py``).
    """

    def __init__(
        self,
        plan: UnitPlan,
        comm: Comm,
        policy: EnginePolicy,
        full: torch.Tensor | None = None,
        replicate: Comm | None = None,
    ) -> None:
        check_unit_params(plan.name, plan.params, plan.param_names)
        super().__init__(plan, comm, policy, full, replicate)
        params = self.params
        self._piece_split = _piece_split(self.param_shards, self.layout.shard_numel)
        self._empty = [index for index, p in enumerate(params) if p.numel() == 0]  # (shapes never change)
        # See [Note: quantized collectives] in comm/quantized.py: the gathers for compute, and the reduce-scatters.
        exact = comm.skips_collectives
        self.quantize_weights = policy.quantize_weights if self.reshard_after_forward and not exact else None
        self.quantize_grads = policy.quantize_grads if not exact else None
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
        self.holds_quantized = False  # ``flat`` holds dequantized values of a quantized gather, not the master's
        self._point_params_into(self.flat)
        # Views of ``flat`` (valid across storage resizes) and placeholders, made once: switching between
        # them is one ``.data`` assignment per parameter (see [Note: parameters outside their unit's use]).
        self._views = [p.data for p in params]
        self._placeholders = [placeholder_like(p) for p in params]
        self._hidden_classes: dict[type, type] = {}  # see [Note: reading a sharded parameter] in placeholder.py
        # See [Note: parameters whose values are on their way] in arriving.py.
        self._arriving_classes: dict[type, type] = {}
        self.between_runs: str | None = None  # set while the model stays sharded between runs (ShardedModel.release)
        self.view = ParamView.SHOWN
        self._versions_when_hidden: list[int] = []
        self._aliases: dict[int, torch.Tensor] = {}  # see ``adopt_rebound_data``
        self._gathering: Pending | None = None  # an all-gather into ``flat`` in flight (prefetch)
        self.ledger: GatherLedger | None = None  # told when the gathered storage is allocated and freed
        # Whether the sharded gradients last reduced hold no inf/NaN on any rank: True/False when known for every
        # rank alike (set by GradReducer, at the step: see [Note: flags read at the step] in grad_flags.py), None
        # when unknown.
        self.grads_finite: bool | None = None
        self.state = UnitState.UNSHARDED
        self.phase = UnitPhase.IDLE  # set by the stage-3 schedule (see [Note: unit lifecycle])
        self.reshard()

    # ------------------------------------------------------------------ construction
    def _point_params_into(self, flat: torch.Tensor) -> None:
        for param, offset, numel in zip(self.params, self.layout.offsets, self.layout.numels):
            param.data = flat[offset : offset + numel].view(param.shape)

    # ------------------------------------------------------------------ properties
    @property
    def is_unsharded(self) -> bool:
        return self.state is UnitState.UNSHARDED

    def _refresh_shard(self, non_blocking: bool = False) -> None:
        """Copy the master into the compute shard where that is a tensor of its own (``non_blocking`` for a
        copy from the pinned master to the device: see [Note: offload copies] in ``compute_shard.py``), once an
        all-gather in flight that reads it or writes it is done.

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
            if non_blocking and self.streams is not None and self.form is not ShardForm.HOST_COPY:  # to the device
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
        if self.view is ParamView.ARRIVING:
            self.view = ParamView.SHOWN
            settle(self.params)

    @property
    def arriving(self) -> bool:
        """Whether the post-step all-gather is in flight with the parameters waiting for it on use."""
        return self.view is ParamView.ARRIVING

    def leave_in_flight(self, pending: Pending | None) -> None:
        """Keep ``pending`` (this unit's post-step all-gather, from ``gather_updated_shards(async_op=True)``) in
        flight: the parameters wait for it when first used (see [Note: parameters whose values are on their way]
        in ``arriving.py``)."""
        if pending is None:
            return
        self._gathering = pending
        if self.exposed:
            self.view = ParamView.ARRIVING
            arrive(self.params, self, self._arriving_classes)

    def wait_gather(self) -> None:
        """Wait for a prefetching all-gather, if one is in flight; the parameters then show its values."""
        self._finish_gather()
        if self.state is UnitState.UNSHARDED and self.view is ParamView.HIDDEN:
            # Issued ahead (a prefetch, or at the start of a batch): user code ran in between.
            self.check_no_hidden_writes()
            reveal(self.params)
            self._set_param_data(self._views)
            self.view = ParamView.SHOWN

    def reshard(self) -> None:
        """Free the full parameters (idempotent; a no-op for stages 1 and 2): they become placeholders."""
        if not self.reshard_after_forward or self.state is UnitState.SHARDED:
            return
        with label("ZeRO::release", self.name):
            self._finish_gather()
            self._set_param_data(self._placeholders)
            hide(self.params, self, self._hidden_classes)
            self.view = ParamView.HIDDEN
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
        if self.exposed or not self._versions_when_hidden:
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

    def piece_views(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's piece of ``shard`` (a 1-D tensor laid out as this rank's shard, such as its sharded
        gradient), as views in parameter order: ``shard[piece.shard_offset : piece.shard_offset + piece.numel]``
        for every piece, made by one ``split`` (a slice per parameter costs microseconds of Python each)."""
        sizes, picks = self._piece_split
        parts = shard.split_with_sizes(sizes)
        return [parts[i] for i in picks]

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
        under meta init] in ``hf/weights.py``): refresh the compute shard and, where the full parameters are kept
        (stages 1 and 2), gather them again (a collective)."""
        pending = self.gather_updated_shards()
        if pending is not None:
            pending.wait()
        if not self.exposed:
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
            and (purpose is None or self.exposed)
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
        lost = self.state is UnitState.SHARDED or not self.exposed or self.separate_master or unfinished
        self._gathering = None
        settle(self.params)
        reveal(self.params)
        with torch.no_grad():
            for param, view in zip(self.params, self._views):
                if lost:
                    param.data = torch.full(param.shape, float("nan"), dtype=self.master_dtype, device=self.device)
                else:
                    param.data = view.to(self.master_dtype, copy=True)
        self.view = ParamView.SHOWN
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
        self.view = ParamView.SHOWN
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
