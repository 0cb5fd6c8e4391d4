"""``ShardedModel``: a module's parameters, gradients and optimizer states sharded over ranks.

This is the engine's one entry point; the Lightning strategies drive it and nothing else.
It ties together the units (``unit.py``), gradient reduction (``grads.py``), stage-3 hooks
(``stage3.py``) and the user's optimizers (``optimizer.py``). Pure torch: no Lightning here.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_zero.engine.comm.comm import Comm
from lightning_zero.engine.comm.device_wait import read_on_host
from lightning_zero.engine.comm.mesh import ShardGroups, ShardSize, resolve_shard_size
from lightning_zero.engine.comm.quantized import check_quantization
from lightning_zero.engine.core.grouping import ROOT_NAME, UnitPolicy, bucket_units, plan_units
from lightning_zero.engine.core.layout import ParamShard
from lightning_zero.engine.core.ledger import GatherLedger
from lightning_zero.engine.core.optimizer import (
    bind_optimizer,
    check_optimizer_params,
    guard_sharded_state,
    is_param_shaped,
)
from lightning_zero.engine.core.param_checks import check_no_shared_memory, check_no_sparse_gradients, check_unit_params
from lightning_zero.engine.core.unit import ShardedUnit, UnitState
from lightning_zero.engine.free_memory import FIT_MARGIN, available_bytes, describe_bytes, fits
from lightning_zero.engine.full_state import (
    ShardLoader,
    StateDictGatherer,
    full_optimizer_state_dict,
    full_state_dict,
    load_full_optimizer_state_dict,
)
from lightning_zero.engine.meta.init_trace import InitTrace
from lightning_zero.engine.meta.materialize import has_meta_tensors, materialize_units
from lightning_zero.engine.meta.pretrained import load_weight_shards, resolve_weight_loads
from lightning_zero.engine.schedule.arrivals import ForwardWaits
from lightning_zero.engine.schedule.grads import GradReducer
from lightning_zero.engine.schedule.stage3 import Stage3Hooks

if TYPE_CHECKING:
    from lightning_zero.engine.comm.control import ControlChannel

STAGES = (1, 2, 3)


class ShardedModel:
    """Shard ``module`` over the ranks of ``comm`` (ZeRO ``stage`` 1, 2 or 3), in place.

    Example::

        comm = Comm()                                     # after torch.distributed.init_process_group
        sharded = ShardedModel(model, stage=3, comm=comm)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sharded.bind_optimizer(optimizer)                 # now steps this rank's shards
        with sharded.step_context():
            model(x).sum().backward()                     # gathers, reduce-scatters, frees
        optimizer.step()                                  # on this rank's master pieces
        sharded.after_optimizer_step(optimizer)
        optimizer.zero_grad()
        with sharded.gathered_parameters():               # full values, e.g. for an EMA copy
            ema.update_parameters(model)

    ``shard_size`` (hybrid sharding, see [Note: hybrid sharding] in ``mesh.py``): ``None`` shards over every
    rank of ``comm``; a number ``S`` (or ``"node"``: ``LOCAL_WORLD_SIZE``) shards inside groups of ``S``
    consecutive ranks and replicates across them, e.g. ``ShardedModel(model, stage=3, comm=comm, shard_size=8)``.

    ``offload_optimizer``: master shards, sharded gradients and optimizer states in (pinned) host memory, the
    step on the CPU (see [Note: offload copies] in ``unit.py``). ``offload_params`` (stage 3 only; implies
    ``offload_optimizer``): the parameter shards in host memory too, copied to the device when their unit is
    gathered, so the device holds only the units in flight (see [Note: parameter offload] in ``unit.py``), e.g.
    ``ShardedModel(model, stage=3, comm=comm, offload_params=True)``.

    ``accumulate`` (stages 2 and 3): ``"sharded"`` reduce-scatters every micro-batch, even inside ``no_sync()``;
    ``"local"`` keeps the full gradients across the micro-batches run inside ``no_sync()`` and reduce-scatters
    once, at the first backward outside it (see [Note: local accumulation] in ``grads.py``). Stage 1 always does
    the latter.
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        comm: Comm,
        policy: UnitPolicy | None = None,
        broadcast_buffers: bool = True,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        offload_optimizer: bool = False,
        device: torch.device | None = None,
        meta_init: InitTrace | None = None,
        prefetch: int = 1,
        reshard_after_forward: bool = True,
        bucket_numel: int = 0,
        shard_size: ShardSize = None,
        offload_params: bool = False,
        accumulate: str = "sharded",
        quantize_weights: str | None = None,
        quantize_grads: str | None = None,
    ) -> None:
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        check_offload_params(stage, offload_params)
        check_quantize(stage, quantize_weights, quantize_grads)
        # Checked before anything else, on every rank alike (see [Note: hybrid sharding] in mesh.py).
        size = resolve_shard_size(shard_size, comm.world_size, _local_world_size())
        plans = plan_units(module, policy)
        if not plans:
            raise ValueError(
                f"{type(module).__name__} has no parameters, so there is nothing to shard. Create the layers in "
                "__init__ or configure_model(), or use a strategy without sharding for a parameter-free model."
            )
        for plan in plans:  # all of them before sharding any: a refused model is left untouched
            check_unit_params(plan.name, plan.params, plan.param_names)
        check_no_shared_memory(module)
        check_no_sparse_gradients(module)
        # The module each planned unit came from, by its first parameter: where its forward waits for its
        # post-step gather under stages 1 and 2 (a bucket waits in each of its units' modules; see [Note: each unit
        # waits for its own gather] in arrivals.py).
        planned_from = {id(plan.params[0]): plan.module for plan in plans}
        if stage < 3:
            plans = bucket_units(plans, bucket_numel)
        self.module = module
        self.stage = stage
        self.comm = comm  # the world: agreements, flags, buffers
        where = device or next(module.parameters()).device
        groups = ShardGroups.create(comm, size, "cpu" if where.type == "meta" else where.type)
        self.shard_comm = groups.shard  # where states are sharded: ``comm`` itself unless hybrid
        self.replicate_comm = groups.replicate  # across shard groups (hybrid sharding only), else None
        self.shard_size = size
        self.broadcast_buffers = broadcast_buffers
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        # Parameters on the host imply the optimizer there too, as FSDP2's CPUOffloadPolicy does (see
        # [Note: parameter offload] in unit.py).
        self.offload_optimizer = offload_optimizer or offload_params
        self.offload_params = offload_params
        units: list[ShardedUnit | None] = [None] * len(plans)

        def build(index: int, full: torch.Tensor | None) -> None:
            plan = plans[index]
            units[index] = ShardedUnit(
                plan.name,
                plan.module,
                plan.params,
                plan.param_names,
                self.shard_comm,
                reshard_after_forward=stage == 3,
                param_dtype=param_dtype,
                reduce_dtype=reduce_dtype,
                offload=self.offload_optimizer,
                full=full,
                replicate=self.replicate_comm,
                offload_params=offload_params,
                quantize_weights=quantize_weights,
                quantize_grads=quantize_grads,
            )

        # See [Note: pretrained weights under meta init] in pretrained.py: names resolved before the replay.
        loads = resolve_weight_loads(module, meta_init.weight_loads) if meta_init and meta_init.weight_loads else None
        if has_meta_tensors(module):
            materialize_units(module, plans, device or torch.device("cpu"), size, build, meta_init)
        else:
            for index in range(len(plans)):
                build(index, None)
        self.units = [u for u in units if u is not None]
        # One set of side streams for the copies between host and device (see [Note: copies off the compute stream]
        # in core/streams.py), shared by every unit that has such copies.
        shared = next((u.streams for u in self.units if u.streams is not None), None)
        for unit in self.units:
            if unit.streams is not None:
                unit.streams = shared
        # Before the engine next writes what copies on side streams still read (an asynchronous save's staging):
        # each makes the compute stream wait for them (``order_writes_after``).
        self._before_writes: list[Callable[[], None]] = []
        # Stage 3's gathered units over time (the peak of a step: see ``GatherLedger``).
        self.gathered = GatherLedger()
        for unit in self.units:
            if unit.reshard_after_forward:
                unit.ledger = self.gathered
                if unit.is_unsharded:
                    self.gathered.add(unit.name, unit.flat.untyped_storage().nbytes())
        if loads is not None:
            load_weight_shards(self.units, loads)
            meta_init.weight_loads.clear()
        self.root_unit = next((u for u in self.units if u.name == ROOT_NAME), None)
        self._shard_of: dict[nn.Parameter, tuple[nn.Parameter, ParamShard]] = {}
        self._param_of: dict[nn.Parameter, tuple[nn.Parameter, ParamShard]] = {}
        self._unit_of: dict[nn.Parameter, ShardedUnit] = {}
        for unit in self.units:
            for param, shard_param, piece in zip(unit.params, unit.shard_params, unit.param_shards):
                self._shard_of[param] = (shard_param, piece)
                # Keyed by both: optimizers hold the module's parameters, the engine's own code shard ones.
                self._param_of[shard_param] = self._param_of[param] = (param, piece)
                self._unit_of[shard_param] = self._unit_of[param] = unit
        self._own_ids = frozenset(id(p) for p in self._shard_of)  # the module's parameters (optimizers hold them)
        # [Note: buffer broadcast] DDP copies rank 0's buffers (BatchNorm statistics) to every rank before a forward
        # through its wrapper, but only when the previous such forward ran with gradients and synchronised them:
        # not after a no_sync micro-batch of gradient accumulation, nor after an evaluation forward, and so on the
        # first validation step after training. Lightning routes training, validation, test and predict steps
        # through the wrapper; ``begin_step`` follows the same rule, so every rank ends with DDP's buffers.
        self._forward_syncs_buffers = True
        # As DDP (``will_sync_module_buffers``): a module without buffers when it is wrapped never looks for them
        # again (a walk over every submodule per step saved); one with buffers collects them at every broadcast,
        # since user code may reassign them.
        self._has_buffers = any(b is not None for b in module.buffers())
        self.loader = ShardLoader(self.units)
        self.loader.install(module)
        self.state_dict_gatherer = StateDictGatherer(self.units)
        self.state_dict_gatherer.install(module)
        self._sync_buffers()

        self.stage3: Stage3Hooks | None = None
        if accumulate not in ("sharded", "local"):
            raise ValueError(f"accumulate must be 'sharded' or 'local', got {accumulate!r}")
        self.accumulate = "local" if stage == 1 else accumulate
        self.reducer = GradReducer(self.units, reduce_every_micro_batch=self.accumulate == "sharded", comm=comm)
        if stage == 3:
            self.stage3 = Stage3Hooks(
                self.units,
                self.reducer.queue_finish,
                prefetch=prefetch,
                reshard_after_forward=reshard_after_forward,
                root=module,
                comm=comm,
            )
            self.reducer.after_unit_reduced = self.stage3.after_unit_reduced
            self.reducer.after_backward = self.stage3.after_backward
            self.stage3.install()
        self.reducer.install()
        self.forward_waits: ForwardWaits | None = None
        if stage < 3:
            modules = [[planned_from[id(p)] for p in unit.params if id(p) in planned_from] for unit in self.units]
            self.forward_waits = ForwardWaits(self.units, modules, root=module)
            self.forward_waits.install()
        # Every parameter, once, in an order that is the same on every rank (unit by unit).
        self.params: list[nn.Parameter] = [p for unit in self.units for p in unit.params]
        self.optimizers: list[Optimizer] = []
        self._units_of_cache: dict[int, tuple[tuple[int, ...], list[ShardedUnit]]] = {}
        self._step_hooks: dict[int, list[Any]] = {}
        # While an optimizer steps: each parameter with what its .data was (see ``on_shards``).
        self._on_shards: list[tuple[nn.Parameter, nn.Parameter, torch.Tensor]] | None = None
        self._on_shards_units: list[ShardedUnit] = []
        self._entered_by_step_hook = False
        self.between_runs: str | None = None  # why the module stayed sharded after a run (see ``release``)

    # ------------------------------------------------------------------ steps
    @contextmanager
    def step_context(self) -> Iterator[None]:
        """Around one step of user code (forward, and backward for training): buffers as rank 0's,
        and the root unit gathered for the whole step under stage 3."""
        self.begin_step()
        try:
            yield
        finally:
            self.end_step()

    def begin_step(self, training: bool = True) -> None:
        """Start a step (a forward, and its backward when training): rank 0's buffers on DDP's schedule (see
        [Note: buffer broadcast]), the root unit held and the first units prefetched (stage 3; see
        [Note: prefetch] in ``stage3.py``). Stages 1 and 2 wait here only for the post-step gathers of the units
        that are not waited for in their own forward (see [Note: each unit waits for its own gather] in
        ``arrivals.py``)."""
        self._order_writes()
        if self.forward_waits is not None:
            self.forward_waits.begin_forward()
        else:
            self.wait_for_parameters()
        self.adopt_rebound_data()
        if self._forward_syncs_buffers:
            self._sync_buffers()
        self._forward_syncs_buffers = torch.is_grad_enabled() and not self.reducer.no_sync_requested
        if self.stage3 is not None:
            if self.root_unit is not None:
                self.stage3.hold(self.root_unit)
            self.stage3.begin_forward(training and torch.is_grad_enabled())

    def gather_for_next_step(self) -> None:
        """Issue, without waiting, the all-gathers a training step begins with (stage 3: the root unit and the
        first units of the recorded forward), at a point every rank is known to reach together: right after an
        optimizer step outside a step (both doors), or right after every rank agreed to start a training batch
        (the Trainer's door, for the micro-batches no optimizer step precedes). Idempotent; nothing for stages 1
        and 2 (their next step's parameters are already on their way: ``after_optimizer_step``).

        [Note: gathers at the start of a batch]
        A training step of stage 3 begins by waiting for the root unit's all-gather (``begin_step`` holds it):
        on a small model, an exchange more than DDP has on its step path, and on two processes that share the
        cores every exchange waited for costs the time one rank lags the other. So the gathers are issued
        ahead, where every rank is known to issue them in the same place of its sequence of collectives, and
        travel behind the loop's own work: the ``on_train_batch_end`` hooks, logging, the next fetch and its
        transfer, the ``on_train_batch_start`` hooks (Fabric: whatever user code runs between
        ``optimizer.step()`` and the next forward). Two such places:

        - the end of an optimizer step that no step context is around (Lightning's automatic optimization;
          Fabric's ``optimizer.step()``): every rank has just stepped, since the step's reductions and the
          step itself are collectives of every rank. The gathers are collectives of the step just ended,
          checked with it ([Note: collective checks] in ``comm/sequence.py``). The Trainer's door issues them
          after every optimizer step but the last of ``max_steps``; the condition may depend only on what
          every rank knows alike (a rank that runs out of data counts the epoch's batches differently, and a
          gather issued by one rank only would pair with whatever the other does next). Manual
          optimization steps inside ``training_step``, where the root unit is held and a forward may follow
          in the same step: nothing is issued there;
        - the step agreement of the Trainer's door, for a training batch no optimizer step precedes (the first,
          the micro-batches of gradient accumulation), issued only *after* the agreement has answered: every
          rank is then known to start this training step, so every rank issues the same gathers (a gather issued
          before would pair with whatever another rank does next if the ranks had parted ways). They are
          collectives of the step's sequence (``Comm.begin_sequence`` is called at the agreement,
          ``Comm.continue_sequence`` names its key in ``training_step``). Where both apply, the second finds
          the units gathered and issues nothing.

        Until ``begin_step`` waits for them, the parameters stay placeholders (``ShardedUnit.wait_gather``
        shows the values only when it is waited for), so the code in between sees what it saw before; a read
        of one of their values by user code is a collective as it was (``ShardedUnit.full_flat``). What
        that code may do to a parameter is caught as it is outside any step: an in-place write into a
        placeholder raises when the gather is waited for (``check_no_hidden_writes`` runs there too), values
        given by rebinding ``.data`` are copied into the gathered buffer as well as into the shard
        (``adopt_rebound_data``), and the engine's own writes into the shards of a gathered unit (another
        optimizer's step, ``gathered_parameters()`` with writes, a state dict loaded) gather it again
        (``ShardedUnit.gather_updated_shards``, ``load_full_flat``). Memory: the first units stay gathered
        between two steps, as they would be during the next fetch anyway. If no training step follows
        (validation, the end of training, a batch skipped by ``on_train_batch_start``), an evaluation forward
        uses the units it needs and frees the rest when it ends, and ``free_unused_units`` (the end of training)
        or teardown frees them. On CUDA the gathers run on the communication stream, as prefetches do: nothing
        here waits for the device.
        """
        if self.stage3 is None or not torch.is_grad_enabled():
            return
        if self.root_unit is not None:
            self.root_unit.unshard(async_op=True)
        self.stage3.prefetch_first()

    def replay_eval_forward(self) -> None:
        """Stage 3: the all-gathers of one evaluation forward, in the recorded order, computing nothing (what a rank
        that has run out of evaluation batches issues for each batch the others still run; see [Note: uneven
        evaluation] in ``strategies/agreement.py``). Call between ``begin_step(training=False)`` and ``end_step()``.
        Stages 1 and 2: nothing (their forward gathers nothing)."""
        if self.stage3 is not None:
            with torch.no_grad():
                self.stage3.replay_eval_forward()

    def free_unused_units(self) -> None:
        """Free units gathered but not used by a step (see [Note: gathers at the start of a batch])."""
        if self.stage3 is not None:  # (held units and units backward still needs are kept)
            self.stage3.free_unused()

    def adopt_rebound_data(self) -> None:
        """Keep parameters whose ``.data`` user code rebound training (see ``ShardedUnit.adopt_rebound_data``)."""
        for unit in self.units:
            unit.adopt_rebound_data()

    @property
    def root_held(self) -> bool:
        """Whether a step holds the root unit gathered now (stage 3)."""
        return self.stage3 is not None and self.root_unit in self.stage3.held

    def end_step(self) -> None:
        if self.stage3 is not None:
            if self.root_unit is not None:
                self.stage3.unhold(self.root_unit)
            self.stage3.end_step()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient reduction in backward (stage 1 accumulates full gradients locally)."""
        with self.reducer.no_sync():
            yield

    def _sync_buffers(self) -> None:
        """Broadcast rank 0's buffers, as DDP's ``broadcast_buffers``: one collective for all of them (their bytes
        side by side, whatever their dtypes; DDP sends one per dtype), so a model with BatchNorm (float statistics,
        an int64 counter) waits at one exchange per step, not two. Exact: bytes are copied, not converted."""
        if not self.broadcast_buffers or not self._has_buffers or self.comm.world_size == 1:
            return
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for buf in self.module.buffers():
            if buf is not None:
                by_device.setdefault(buf.device, []).append(buf)
        with torch.no_grad():
            for group in by_device.values():
                flat = torch.cat([b.reshape(-1).view(torch.uint8) for b in group])
                self.comm.broadcast(flat, src=0)
                sizes = [b.numel() * b.element_size() for b in group]
                torch._foreach_copy_(group, [v.view(b.dtype).view_as(b) for v, b in zip(flat.split(sizes), group)])

    # ------------------------------------------------------------------ optimizers
    def bind_optimizer(self, optimizer: Optimizer) -> None:
        """Let ``optimizer`` (built over the module's parameters) step this rank's shards: its state is sliced,
        and each ``optimizer.step()`` runs on the master pieces (``on_shards``)."""
        bind_optimizer(optimizer, self._shard_of)
        self.optimizers.append(optimizer)
        self._step_hooks[id(optimizer)] = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]

    def _before_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if self._on_shards is not None:
            return  # already entered by ``on_shards``
        if any(callable(a) for a in args) or kwargs.get("closure") is not None:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step(closure) on a ZeRO-sharded model: the closure would run while the "
                "parameters are this rank's master pieces. Call the closure first, then optimizer.step() without "
                "one (Lightning's strategies do this for you)."
            )
        self._enter_shards(optimizer)
        self._entered_by_step_hook = True

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if self._entered_by_step_hook:
            self._entered_by_step_hook = False
            self._exit_shards()

    @contextmanager
    def on_shards(self, optimizer: Optimizer) -> Iterator[None]:
        """While inside: every parameter of ``optimizer``'s units is its 1-D master piece, with the sharded
        gradient as its ``.grad`` (see [Note: parameters outside their unit's use] in ``unit.py``), so the
        user's optimizer, a gradient scaler or a clipping function work on shards. ``optimizer.step()`` enters
        it by itself; re-entrant."""
        if self._on_shards is not None:
            yield
            return
        self._enter_shards(optimizer)
        try:
            yield
        finally:
            self._exit_shards()

    def _enter_shards(self, optimizer: Optimizer) -> None:
        check_optimizer_params(optimizer, self._own_ids, self.module)  # e.g. add_param_group with a foreign tensor
        self._order_writes()  # the step writes master shards and optimizer states
        reducer = self.reducer
        reducer.settle()  # the backward passes' flags (see [Note: flags read at the step] in grads.py)
        saved = []
        self._on_shards_units = self.units_of(optimizer)
        for unit in self._on_shards_units:
            unit.wait_host_reads()  # the step writes the master, which may be the offloaded shard itself
            unit.adopt_rebound_data()
            unit.check_no_hidden_writes()
            unit.reveal()  # the optimizer works on the parameters themselves (see [Note: reading a sharded parameter])
            # What each parameter shows now (``adopt_rebound_data`` just made sure of it), put back by ``_exit_shards``.
            shown = unit.shown_data()
            # The sharded gradients the user zeroed are dropped (see [Note: gradient markers] in grads.py); the
            # markers are replaced by the sharded gradients below, and put back by ``_exit_shards``.
            reducer.drop_unwanted(unit.params, unit.shard_params)
            for param, shard_param, data in zip(unit.params, unit.shard_params, shown):
                saved.append((param, shard_param, data))
                param.data = shard_param  # (its values, as ``shard_param.data`` would give, without a new tensor)
                param.grad = shard_param.grad
        self._on_shards = saved

    def _exit_shards(self) -> None:
        assert self._on_shards is not None
        for param, shard_param, data in self._on_shards:
            shard_param.grad = param.grad
            param.grad = None
            param.data = data
        for unit in self._on_shards_units:
            self.reducer.put_markers(unit.params, unit.shard_params)
            unit.conceal_if_sharded()
            unit.record_hidden_versions()  # the optimizer's in-place updates count as writes
        self._on_shards = None
        self._on_shards_units = []

    def settle_grads(self) -> None:
        """Read what the backward passes since the last step found (which gradients exist anywhere, whether any
        holds an inf or NaN) and act on it: the step's one host read (see [Note: flags read at the step] in
        ``grads.py``). Every reader of the sharded gradients here calls it first; a precision plugin calls it
        before the hooks that precede the optimizer step. Call on every rank at the same point."""
        self.reducer.settle()

    def shard_params_of(self, optimizer: Optimizer) -> list[nn.Parameter]:
        """The shard parameters (holders of master pieces and sharded gradients) of ``optimizer``'s parameters."""
        return [self._shard_of[p][0] if p in self._shard_of else p for g in optimizer.param_groups for p in g["params"]]

    def after_optimizer_step(self, optimizer: Optimizer, wait: bool = False) -> None:
        """Spread the updated shards of ``optimizer``'s units to every rank: one all-gather per unit whose full
        parameters are kept (stages 1 and 2), issued and left in flight. The next ``begin_step`` waits for them,
        and so does anything that uses a parameter's values before it (see [Note: parameters whose values are on
        their way] in ``core/placeholder.py``). ``wait=True`` waits here."""
        for unit in self.units_of(optimizer):
            pending = unit.gather_updated_shards(async_op=True)
            if wait and pending is not None:
                pending.wait()
            else:
                unit.leave_in_flight(pending)

    def order_writes_after(self, join: Callable[[], None]) -> None:
        """Run ``join`` before the engine next writes the model's tensors: at the start of the next step or optimizer
        step, whichever comes first. ``join`` makes the compute stream wait for copies that still read them on a
        side stream (an asynchronous save's staging: see [Note: copies off the compute stream] in
        ``core/streams.py``), so that nothing is overwritten before it is copied."""
        self._before_writes.append(join)

    def _order_writes(self) -> None:
        if self._before_writes:
            joins, self._before_writes = self._before_writes, []
            for join in joins:
                join()

    def wait_for_parameters(self) -> None:
        """Wait for the post-step all-gathers still in flight (``after_optimizer_step``); free when there are none."""
        for unit in self.units:
            if unit.arriving:
                unit.wait_gather()

    def units_of(self, optimizer: Optimizer) -> list[ShardedUnit]:
        """The units whose parameters ``optimizer`` steps (worked out once per param-group shape: this
        runs after every optimizer step)."""
        shape = tuple(len(g["params"]) for g in optimizer.param_groups)
        cached = self._units_of_cache.get(id(optimizer))
        if cached is not None and cached[0] == shape:
            return cached[1]
        units = self._find_units_of(optimizer)
        self._units_of_cache[id(optimizer)] = (shape, units)
        return units

    def _find_units_of(self, optimizer: Optimizer) -> list[ShardedUnit]:
        check_optimizer_params(optimizer, self._own_ids, self.module)
        stepped = {id(self._unit_of[p]) for group in optimizer.param_groups for p in group["params"]}
        return [u for u in self.units if id(u) in stepped]

    def grad_norm(self, optimizer: Optimizer, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of ``optimizer``'s gradients over all ranks' shards (one all-reduce; same on every rank). Under
        hybrid sharding over the shard group only: its replicas hold the same shards."""
        self.reducer.settle()
        grads = [p.grad for p in self.shard_params_of(optimizer) if p.grad is not None and p.numel()]
        norm_type = float(norm_type)
        device = self.units[0].device  # where collectives run (gradients may be offloaded to the CPU)
        total = torch.zeros((), device=device)
        if norm_type == float("inf"):
            if grads:
                total = torch.stack([g.abs().max() for g in grads]).max().float().to(device)
            self.shard_comm.all_reduce(total, op=torch.distributed.ReduceOp.MAX)
            return total
        if grads:
            total = torch.stack([torch.linalg.vector_norm(g, norm_type).float() ** norm_type for g in grads]).sum()
            total = total.to(device)
        self.shard_comm.all_reduce(total)
        return total ** (1.0 / norm_type)

    def nonfinite_grads(self, optimizer: Optimizer) -> tuple[list[int], list[str]]:
        """Which ranks hold an ``inf``/``NaN`` in ``optimizer``'s sharded gradients (the same list on every
        rank, one all-reduce), and the names of this rank's offending parameters."""
        self.reducer.settle()
        with_grads = [u for u in self.units_of(optimizer) if any(p.grad is not None for p in u.shard_params)]
        if all(u.grads_finite is True for u in with_grads):
            # Known on every rank alike from the reduction's own all-reduce: no collective needed.
            return [], []
        shard_params = [p for p in self.shard_params_of(optimizer) if p.grad is not None and p.numel()]
        device = self.units[0].device
        flags = torch.zeros(self.comm.world_size, device=device)
        peaks: list[torch.Tensor] = []
        if shard_params:
            # One fused pass over all gradients (the largest magnitude of each is inf or NaN if any element is),
            # flagged on the device: the one read on the host is of the all-reduced flags.
            peaks = torch._foreach_norm([p.grad for p in shard_params], float("inf"))
            bad = ~torch.isfinite(torch.stack(peaks)).all()
            flags[self.comm.rank] = bad.to(device=device, dtype=flags.dtype)
        self.comm.all_reduce(flags)
        ranks = [r for r, flag in enumerate(read_on_host(self.comm, flags, "which ranks hold inf/NaN")) if flag > 0]
        local: list[str] = []
        if self.comm.rank in ranks:  # names are looked up only when something is wrong
            for shard_param, peak in zip(shard_params, peaks):
                if not bool(torch.isfinite(peak)):
                    param, _ = self._param_of[shard_param]
                    local.append(_name_in(self._unit_of[shard_param], param))
        return ranks, local

    def drop_grads(self, optimizer: Optimizer) -> None:
        """Forget ``optimizer``'s sharded gradients, so that its next ``step()`` changes nothing."""
        self.reducer.settle()
        for param in (p for g in optimizer.param_groups for p in g["params"]):
            self._shard_of[param][0].grad = None
            self.reducer.clear_marker(param)

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale ``optimizer``'s sharded gradients so that their global norm is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` does for full gradients; return the norm before clipping."""
        total = self.grad_norm(optimizer, norm_type)
        grads = [p.grad for p in self.shard_params_of(optimizer) if p.grad is not None]
        clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, clip_coef.to(device=grads[0].device, dtype=grads[0].dtype))
        return total

    # ------------------------------------------------------------------ user access to full parameters
    @contextmanager
    def gathered_parameters(self, module: nn.Module | None = None, writable: bool = True) -> Iterator[None]:
        """Inside, the parameters of ``module`` (default: the whole model) show their full values in the master
        dtype, as under DDP; on a normal exit, with ``writable``, what was written into them goes back to the
        shards. A collective (one all-gather per unit that needs it): call on every rank. Memory: those units'
        full parameters at once.

        Example::

            with sharded.gathered_parameters(model.backbone, writable=False):
                norms = {n: p.norm() for n, p in model.backbone.named_parameters()}
        """
        wanted = None if module is None else {id(p) for p in module.parameters()}
        units = [
            u
            for u in self.units
            if u.needs_gather_to_read and (wanted is None or any(id(p) in wanted for p in u.params))
        ]
        shown: list[tuple[ShardedUnit, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] = []
        failed = False
        try:
            for unit in units:
                unit.adopt_rebound_data()
                unit.check_no_hidden_writes()
                full = unit.full_flat()
                views = unit.full_views(full)
                shown.append((unit, full, views, unit.show(views)))
            shown_views = {id(unit): views for unit, _, views, _ in shown}
            for unit in self.units:  # memory that user code once rebound a parameter to sees its current values
                if id(unit) in shown_views:
                    unit.refresh_aliases(shown_views[id(unit)])
                elif wanted is None or any(id(p) in wanted for p in unit.params):
                    unit.adopt_rebound_data()
                    unit.refresh_aliases()
            yield
        except BaseException:
            failed = True  # restore locally; writes are not spread (peers may not be here)
            raise
        finally:
            for unit, full, views, previous in shown:
                for index, (param, view) in enumerate(zip(unit.params, views)):
                    if param.data_ptr() != view.data_ptr() and param.shape == view.shape:
                        with torch.no_grad():  # rebound inside (p.data = x, as ModelPruning does): keep its values
                            view.copy_(param.data)
                        unit.keep_alias(index, param.data)
                unit.hide_again(previous)
                if writable and not failed:
                    unit.take_writes(full)

    # ------------------------------------------------------------------ state dicts (see full_state.py)
    def full_state_dict(self) -> dict[str, Any]:
        """The module's full (unsharded) state dict, as DDP would return it: parameters in the master dtype
        (fp32 under mixed precision), one unit gathered at a time."""
        return full_state_dict(self.module, self.units)

    def load_full_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load a full state dict (any world size, any stage; e.g. pretrained weights) into the shards,
        one unit at a time; ``module.load_state_dict`` does the same (see ``ShardLoader``)."""
        self.module.load_state_dict(state_dict, strict=strict)

    def full_optimizer_state_dict(self, optimizer: Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` as if it had stepped full parameters (what DDP would save)."""
        return full_optimizer_state_dict(optimizer, self.units_of(optimizer), self.shard_comm)

    def load_full_optimizer_state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
        """Load a full (DDP-shaped) optimizer state dict into ``optimizer``'s shards."""
        load_full_optimizer_state_dict(optimizer, state_dict, self._param_of, lambda: self.on_shards(optimizer))

    # ------------------------------------------------------------------ lifecycle and accounting
    def release(self, gather: bool = True) -> str | None:
        """Remove every hook and make the module and its optimizers plain again: each parameter with
        its own full storage, each optimizer over the module's parameters with full per-parameter
        state (collectives: call on every rank). What does not fit stays sharded (see [Note: what fits at
        the end] in ``free_memory.py``): optimizer states that do not fit stay shard-shaped and guarded, and
        full parameters that do not fit are not gathered at all: the module then stays sharded, with its
        hooks, until ``resume`` (the next run) or ``release`` again; the reason is returned (else ``None``).
        ``gather=False`` (after a failure on some rank, when collectives could hang) uses no collective:
        stage-3 parameters, which only exist as shards, become NaN, and optimizers keep stepping shards."""
        if self._on_shards is not None:  # a step that raised
            self._exit_shards()
        self._order_writes()  # (what follows may write the model's tensors, and then the user's code does)
        for handles in self._step_hooks.values():
            for handle in handles:
                handle.remove()
        self._step_hooks.clear()
        if gather:
            self.adopt_rebound_data()  # e.g. ModelPruning's permanent weights, set with p.data = ... at the end of fit
            kept_sharded = self._optimizer_states_that_do_not_fit()
            for optimizer in self.optimizers:
                if kept_sharded is None:
                    self._unbind_optimizer(optimizer)
                else:
                    guard_sharded_state(optimizer, kept_sharded)
            self.optimizers.clear()
            too_big = self._parameters_that_do_not_fit()
            if too_big is not None:
                self.suspend(too_big)
                return too_big
        self.between_runs = None
        self.reducer.discard_unchecked()  # the sharded gradients go with the sharded module
        self.reducer.remove()
        self.reducer.drop_buffers()  # the reusable gradient buffers are not needed once the module is plain
        for unit in self.units:
            for param in unit.params:
                self.reducer.clear_marker(param)
        self.loader.remove()
        self.state_dict_gatherer.remove()
        if self.stage3 is not None:
            self.stage3.remove()
        if self.forward_waits is not None:
            self.forward_waits.remove()
        if not gather:
            for unit in self.units:
                unit.release_without_peers()
            return None
        for unit in self.units:
            unit.release()
        return None

    def suspend(self, reason: str) -> None:
        """Keep the module sharded between runs (``release`` found its full parameters would not fit: ``reason``):
        its collectives run unchecked (the run's control channel is closed), and reading a parameter raises an
        error that says why and how to get full weights (see [Note: reading a sharded parameter])."""
        self.between_runs = reason
        self.reducer.drop_buffers()
        for unit in self.units:
            unit.between_runs = reason
        for comm in self.comms().values():
            comm.control = None

    def resume(self, control: ControlChannel | None) -> None:
        """Use a module kept sharded by ``release`` in a new run, whose collectives ``control`` checks."""
        self.between_runs = None
        for unit in self.units:
            unit.between_runs = None
        for comm in self.comms().values():
            comm.control = control if not comm.skips_collectives else None

    def _parameters_that_do_not_fit(self) -> str | None:
        """Why the full parameters would not fit on some rank's device, or ``None`` (a collective)."""
        needed: dict[torch.device, int] = {}
        for unit in self.units:
            if unit.state is UnitState.UNSHARDED and not unit.separate_master:
                continue  # released in place
            size = unit.layout.padded_numel * torch.empty((), dtype=unit.master_dtype).element_size()
            needed[unit.device] = needed.get(unit.device, 0) + size
        return self._agree_on_fit(needed, "whether the full parameters fit")

    def _optimizer_states_that_do_not_fit(self) -> str | None:
        """Why the optimizers' full per-parameter states would not fit on some rank's device (see [Note: what fits
        at the end] in ``free_memory.py``), or ``None`` if they fit on every rank (a collective when there are
        optimizers)."""
        if not self.optimizers:
            return None
        needed: dict[torch.device, int] = {}
        for optimizer in self.optimizers:
            for held, entry in optimizer.state.items():
                param, _ = self._param_of[held]
                shard_param = self._shard_of[param][0]
                for key, value in entry.items():
                    if is_param_shaped(key, value, shard_param):
                        needed[value.device] = needed.get(value.device, 0) + param.numel() * value.element_size()
        return self._agree_on_fit(needed, "whether the full optimizer states fit")

    def _agree_on_fit(self, needed: dict[torch.device, int], name: str) -> str | None:
        """``None`` if ``needed`` bytes fit on every rank's devices, else why not (a collective)."""
        short = next(((d, n) for d, n in needed.items() if not fits(n, d)), None)
        flag = torch.tensor([0 if short else 1], dtype=torch.int64, device=self.units[0].device)
        self.comm.all_reduce(flag, op=dist.ReduceOp.MIN, name=name)
        if int(flag.item()) == 1:
            return None
        if short is None:
            return "they do not fit in the memory of another rank"
        device, count = short
        return (
            f"they need {describe_bytes(count)} of {device.type} memory on this rank, more than "
            f"{FIT_MARGIN:.0%} of the {describe_bytes(available_bytes(device) or 0)} that is free"
        )

    def _unbind_optimizer(self, optimizer: Optimizer) -> None:
        full = self.full_optimizer_state_dict(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        optimizer.state = defaultdict(dict)
        for index, state in full["state"].items():
            optimizer.state[params[index]] = state

    def comms(self) -> dict[str, Comm]:
        """The Comms whose ``stats`` count this model's collectives: ``{"world": ...}``, and under hybrid sharding
        also ``"shard"`` (inside shard groups) and ``"replicate"`` (across them)."""
        if self.replicate_comm is None and self.shard_comm is self.comm:
            return {"world": self.comm}
        comms = {"world": self.comm, "shard": self.shard_comm}
        if self.replicate_comm is not None:
            comms["replicate"] = self.replicate_comm
        return comms

    def memory_stats(self) -> dict[str, int]:
        """Bytes of model state this rank holds now: ``params`` (the persistent compute copy on the device),
        ``master_params`` (the master shard where it is kept apart: mixed precision, offload),
        ``gathered_params`` (stage 3, transient), ``grads`` (sharded gradients), ``optimizer_states`` and
        ``host_params`` (the compute shards in host memory under ``offload_params``, where they are tensors of
        their own; with the master's dtype the host shard is the master, counted once in ``master_params``).
        With ``offload_optimizer``, master shards, gradients and optimizer states are in CPU memory; with
        ``offload_params`` ``params`` is 0.

        Example::

            stats = sharded.memory_stats()
            device_bytes = stats["params"] + stats["gathered_params"]  # without offload add the other three
        """
        params = sum(u.persistent_param_bytes() for u in self.units)
        host = sum(u.host_param_bytes() for u in self.units)
        master = sum(u.master_bytes() for u in self.units)
        gathered = sum(
            u.layout.padded_numel * u.flat.element_size()
            for u in self.units
            if u.reshard_after_forward and u.is_unsharded
        )
        grads = _storage_bytes(p.grad for u in self.units for p in u.shard_params if p.grad is not None)
        states = _storage_bytes(
            v
            for opt in self.optimizers
            for s in opt.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        return {
            "params": params,
            "master_params": master,
            "gathered_params": gathered,
            "grads": grads,
            "optimizer_states": states,
            "host_params": host,
        }


def check_offload_params(stage: int, offload_params: object) -> None:
    """Refuse ``offload_params`` that is not a bool, or that is set for stage 1 or 2, saying what to use instead.

    Example::

        check_offload_params(3, True)   # fine
        check_offload_params(2, True)   # ValueError: offload_params=True needs stage 3: ...
    """
    if not isinstance(offload_params, bool):
        raise TypeError(f"offload_params must be True or False, got {offload_params!r}")
    if offload_params and stage != 3:
        raise ValueError(
            f"offload_params=True needs stage 3: stage {stage} keeps the full parameters on every device for its "
            "forward and backward, so there is no parameter shard to offload. Use offload_optimizer=True to move "
            "the master shards, gradients and optimizer states to the CPU, or stage 3 (ZeRO3Strategy) to offload "
            "the parameters as well."
        )


def _local_world_size() -> int | None:
    """Processes on this node, as torchrun and Lightning's launchers set it (for ``shard_size="node"``)."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value and value.isdigit() else None


def _storage_bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _name_in(unit: ShardedUnit, param: nn.Parameter) -> str:
    return next(name for p, name in zip(unit.params, unit.param_names) if p is param)


def check_quantize(stage: int, quantize_weights: object, quantize_grads: object) -> None:
    """Refuse a quantization the stage cannot apply, saying which stage can (see [Note: quantized collectives] in
    ``comm/quantized.py``).

    Example::

        check_quantize(3, "int8", "int8")   # fine
        check_quantize(2, "int8", None)     # ValueError: quantize_weights='int8' needs stage 3: ...
    """
    check_quantization("quantize_weights", quantize_weights)
    check_quantization("quantize_grads", quantize_grads)
    if quantize_weights is not None and stage != 3:
        raise ValueError(
            f"quantize_weights={quantize_weights!r} needs stage 3: stage {stage} gathers the parameters once after "
            "each optimizer step and keeps them, exactly, so no gather moves weights for compute. Use "
            "ZeRO3Strategy, or quantize_grads for the reduce-scatter of stage 2."
        )
    if quantize_grads is not None and stage == 1:
        raise ValueError(
            f"quantize_grads={quantize_grads!r} needs stage 2 or 3 (the gradients' reduce-scatter from backward); "
            "stage 1 reduces once per step, exactly. Use ZeRO2Strategy or ZeRO3Strategy."
        )
