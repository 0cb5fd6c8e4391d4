"""``ShardedModel``: a module's parameters, gradients and optimizer states sharded over ranks.

This is the engine's one entry point; the Lightning strategies drive it and nothing else.
It ties together the units (``unit.py``), gradient reduction (``grads.py``), stage-3 hooks
(``stage3.py``) and the user's optimizers (``optimizer.py``). Pure torch: no Lightning here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.engine.comm.comm import Comm
from lightning_zero.engine.comm.mesh import ShardGroups, resolve_shard_size
from lightning_zero.engine.core.grouping import ROOT_NAME, UnitPolicy
from lightning_zero.engine.core.ledger import GatherLedger
from lightning_zero.engine.core.optimizer import (
    guard_sharded_state,
)
from lightning_zero.engine.core.policy import EnginePolicy, Offload, check_offload_flag
from lightning_zero.engine.core.unit import ShardedUnit
from lightning_zero.engine.full_state import (
    ShardLoader,
    StateDictGatherer,
    full_optimizer_state_dict,
    full_state_dict,
    load_full_optimizer_state_dict,
)
from lightning_zero.engine.meta.init_trace import InitTrace
from lightning_zero.engine.model import grad_norms
from lightning_zero.engine.model.buffers import BufferBroadcast
from lightning_zero.engine.model.build import build_units, plan_model
from lightning_zero.engine.model.fits import optimizer_states_that_do_not_fit, parameters_that_do_not_fit
from lightning_zero.engine.model.gathered import gathered_parameters
from lightning_zero.engine.model.memory import memory_stats
from lightning_zero.engine.model.optimizer_steps import OptimizerSteps
from lightning_zero.engine.model.param_index import ParamIndex
from lightning_zero.engine.schedule.arrivals import ForwardWaits
from lightning_zero.engine.schedule.grads import GradReducer
from lightning_zero.engine.schedule.stage3 import Stage3Hooks

if TYPE_CHECKING:
    from lightning_zero.engine.comm.control import ControlChannel


class ShardedModel:
    """Shard ``module`` over the ranks of ``comm`` in place, as ``policy`` says (an ``EnginePolicy``: the stage and
    every option; see [Note: one policy] in ``core/policy.py``); ``units`` chooses the units (default: see
    [Note: default units] in ``grouping.py``). ``shard_model`` builds one from keyword options.

    Example::

        comm = Comm()                                     # after torch.distributed.init_process_group
        sharded = ShardedModel(model, comm, EnginePolicy(stage=3))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sharded.bind_optimizer(optimizer)                 # now steps this rank's shards
        with sharded.step_context():
            model(x).sum().backward()                     # gathers, reduce-scatters, frees
        optimizer.step()                                  # on this rank's master pieces
        sharded.after_optimizer_step(optimizer)
        optimizer.zero_grad()
        with sharded.gathered_parameters():               # full values, e.g. for an EMA copy
            ema.update_parameters(model)

    What each option does (hybrid sharding, offload, accumulation, quantization, the stage-3 schedule) is said
    once, in ``EnginePolicy``'s docstring and the notes it points to.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Comm,
        policy: EnginePolicy,
        units: UnitPolicy | None = None,
        device: torch.device | None = None,
        meta_init: InitTrace | None = None,
    ) -> None:
        # Checked before anything else, on every rank alike (see [Note: hybrid sharding] in mesh.py).
        size = resolve_shard_size(policy.shard_size, comm.world_size, _local_world_size())
        plans, planned_from = plan_model(module, policy, units)
        self.module = module
        self.policy = policy
        self.stage = stage = policy.stage
        self.comm = comm  # the world: agreements, flags, buffers
        where = device or next(module.parameters()).device
        groups = ShardGroups.create(comm, size, "cpu" if where.type == "meta" else where.type)
        self.shard_comm = groups.shard  # where states are sharded: ``comm`` itself unless hybrid
        self.replicate_comm = groups.replicate  # across shard groups (hybrid sharding only), else None
        self.shard_size = size
        self.units = build_units(module, plans, groups, policy, device, meta_init)
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
        self.root_unit = next((u for u in self.units if u.name == ROOT_NAME), None)
        self.index = ParamIndex.of(self.units)
        self._shard_of, self._param_of = self.index.shard_of, self.index.param_of
        # See [Note: buffer broadcast] in model/buffers.py.
        self.buffers = BufferBroadcast(module, comm, policy.broadcast_buffers)
        self.loader = ShardLoader(self.units)
        self.loader.install(module)
        self.state_dict_gatherer = StateDictGatherer(self.units)
        self.state_dict_gatherer.install(module)
        self.buffers.broadcast()

        self.stage3: Stage3Hooks | None = None
        self.reducer = GradReducer(self.units, reduce_every_micro_batch=policy.accumulate == "sharded", comm=comm)
        if stage == 3:
            self.stage3 = Stage3Hooks(
                self.units,
                self.reducer.queue_finish,
                prefetch=policy.prefetch,
                reshard_after_forward=policy.reshard_after_forward,
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
        self.steps = OptimizerSteps(self.units, self.index, self.reducer, groups, module, self._order_writes)
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
        [Note: buffer broadcast] in ``model/buffers.py``), the root unit held and the first units prefetched (stage
        3; see [Note: prefetch] in ``stage3.py``). Stages 1 and 2 wait here only for the post-step gathers of the units
        that are not waited for in their own forward (see [Note: each unit waits for its own gather] in
        ``arrivals.py``)."""
        self._order_writes()
        if self.forward_waits is not None:
            self.forward_waits.begin_forward()
        else:
            self.wait_for_parameters()
        self.adopt_rebound_data()
        self.buffers.before_forward(no_sync=self.reducer.no_sync_requested)
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

    @property
    def next_step_broadcasts_buffers(self) -> bool:
        """Whether the next ``begin_step`` begins with a broadcast of rank 0's buffers (see [Note: buffer
        broadcast] in ``model/buffers.py``)."""
        return self.buffers.next_forward_broadcasts

    # ------------------------------------------------------------------ optimizers
    @property
    def optimizers(self) -> list[Optimizer]:
        """The optimizers bound to this model, in binding order."""
        return self.steps.optimizers

    def bind_optimizer(self, optimizer: Optimizer) -> None:
        """Let ``optimizer`` (built over the module's parameters) step this rank's shards: its state is sliced,
        and each ``optimizer.step()`` runs on the master pieces (``on_shards``)."""
        self.steps.bind(optimizer)

    def on_shards(self, optimizer: Optimizer) -> AbstractContextManager[None]:
        """While inside: every parameter of ``optimizer``'s units is its 1-D master piece, with the sharded
        gradient as its ``.grad`` (see [Note: parameters outside their unit's use] in ``unit.py``), so the
        user's optimizer, a gradient scaler or a clipping function work on shards. ``optimizer.step()`` enters
        it by itself; re-entrant."""
        return self.steps.on_shards(optimizer)

    def settle_grads(self) -> None:
        """Read what the backward passes since the last step found (which gradients exist anywhere, whether any
        holds an inf or NaN) and act on it: the step's one host read (see [Note: flags read at the step] in
        ``grad_flags.py``). Every reader of the sharded gradients here calls it first; a precision plugin calls it
        before the hooks that precede the optimizer step. Call on every rank at the same point."""
        self.reducer.settle()

    def shard_params_of(self, optimizer: Optimizer) -> list[nn.Parameter]:
        """The shard parameters (holders of master pieces and sharded gradients) of ``optimizer``'s parameters."""
        return self.steps.shard_params_of(optimizer)

    def after_optimizer_step(self, optimizer: Optimizer, wait: bool = False) -> None:
        """Spread the updated shards of ``optimizer``'s units to every rank (see
        ``OptimizerSteps.after_optimizer_step``); ``wait=True`` waits here."""
        self.steps.after_optimizer_step(optimizer, wait=wait)

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
        """The units whose parameters ``optimizer`` steps."""
        return self.steps.units_of(optimizer)

    # ------------------------------------------------------------------ gradients (see model/grad_norms.py)
    def grad_norm(self, optimizer: Optimizer, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of ``optimizer``'s gradients over all ranks' shards (one all-reduce; same on every rank)."""
        return grad_norms.grad_norm(self.steps, optimizer, norm_type)

    def nonfinite_grads(self, optimizer: Optimizer) -> tuple[list[int], list[str]]:
        """Which ranks hold an ``inf``/``NaN`` in ``optimizer``'s sharded gradients, and this rank's offenders."""
        return grad_norms.nonfinite_grads(self.steps, optimizer)

    def drop_grads(self, optimizer: Optimizer) -> None:
        """Forget ``optimizer``'s sharded gradients, so that its next ``step()`` changes nothing."""
        grad_norms.drop_grads(self.steps, optimizer)

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale ``optimizer``'s sharded gradients to a global norm of at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` does for full gradients; return the norm before clipping."""
        return grad_norms.clip_grad_norm_(self.steps, optimizer, max_norm, norm_type)

    # ------------------------------------------------------------------ user access to full parameters
    def gathered_parameters(self, module: nn.Module | None = None, writable: bool = True) -> AbstractContextManager:
        """Inside, the parameters of ``module`` (default: the whole model) show their full values in the master
        dtype, as under DDP; on a normal exit, with ``writable``, what was written into them goes back to the
        shards. A collective (one all-gather per unit that needs it): call on every rank. Memory: those units'
        full parameters at once.

        Example::

            with sharded.gathered_parameters(model.backbone, writable=False):
                norms = {n: p.norm() for n, p in model.backbone.named_parameters()}
        """
        return gathered_parameters(self.units, module, writable)

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
        self.steps.remove_hooks()  # (and leaves a step that raised)
        self._order_writes()  # (what follows may write the model's tensors, and then the user's code does)
        if gather:
            self.adopt_rebound_data()  # e.g. ModelPruning's permanent weights, set with p.data = ... at the end of fit
            device = self.units[0].device
            kept_sharded = optimizer_states_that_do_not_fit(self.optimizers, self.index, self.comm, device)
            for optimizer in self.optimizers:
                if kept_sharded is None:
                    self.steps.unbind(optimizer, self.full_optimizer_state_dict(optimizer))
                else:
                    guard_sharded_state(optimizer, kept_sharded)
            self.optimizers.clear()
            too_big = parameters_that_do_not_fit(self.units, self.comm)
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
        """Bytes of model state this rank holds now, by kind (see ``model.memory.memory_stats``).

        Example::

            stats = sharded.memory_stats()
            device_bytes = stats["params"] + stats["gathered_params"]  # without offload add the other three
        """
        return memory_stats(self.units, self.optimizers)


def _local_world_size() -> int | None:
    """Processes on this node, as torchrun and Lightning's launchers set it (for ``shard_size="node"``)."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value and value.isdigit() else None


def shard_model(
    module: nn.Module,
    stage: int,
    comm: Comm,
    units: UnitPolicy | None = None,
    device: torch.device | None = None,
    meta_init: InitTrace | None = None,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    **options: Any,
) -> ShardedModel:
    """``ShardedModel(module, comm, EnginePolicy(stage, ...))`` from keyword options: ``EnginePolicy``'s fields, with
    ``offload`` given as the strategies' two flags.

    Example::

        sharded = shard_model(model, stage=3, comm=Comm(), offload_params=True, param_dtype=torch.bfloat16)
        sharded.policy.offload  # Offload.PARAMS
    """
    check_offload_flag("offload_optimizer", offload_optimizer)
    check_offload_flag("offload_params", offload_params)
    policy = EnginePolicy(stage=stage, offload=Offload.of(offload_optimizer, offload_params), **options)
    return ShardedModel(module, comm, policy, units=units, device=device, meta_init=meta_init)
