"""``ZeROFabricStrategy``: the Fabric glue shared by the three stages.

The same split as the Trainer strategies (``lightning_zero/strategies/base.py``): Fabric owns
processes (its launchers and cluster environments, as for its ``DDPStrategy``) and the user owns the
loop; the engine (``lightning_zero.engine.ShardedModel``) owns parameters, gradients and optimizer
states. This class connects them at the hooks Fabric calls:

- ``setup_module`` shards the module and returns a wrapper whose ``forward`` brackets the user's
  forward (see [Note: Fabric steps] in ``wrapper.py``); ``setup_optimizer`` binds each optimizer to the shards;
- ``backward`` ends the step, ``optimizer_step`` steps this rank's master pieces and all-gathers the
  updated shards, ``no_backward_sync`` defers the reduction, ``clip_gradients_*`` clip with the
  global norm;
- ``save_checkpoint`` / ``load_checkpoint`` (``lightning_zero/fabric/checkpoint.py``) write and read the
  same sharded directories (or full files) as the Trainer strategies;
- ``module_init_context`` records a meta-device construction so stage 3 creates the model sharded.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed
import torch.distributed as dist
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import TBroadcast
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.init import _EmptyInit
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.engine import Comm, ShardedModel, module_class_policy
from lightning_zero.engine.checkpoint.hf_export import write_hf_checkpoint
from lightning_zero.engine.comm.control import ControlChannel
from lightning_zero.engine.comm.mesh import ShardSize, check_shard_size
from lightning_zero.engine.comm.process_exit import destroy_at_exit
from lightning_zero.engine.comm.sequence import CollectiveChecks
from lightning_zero.engine.core.placeholder import refuse_module_sharded_elsewhere
from lightning_zero.engine.free_memory import kept_sharded_text
from lightning_zero.engine.meta.init_trace import InitTrace, record_meta_init, refuse_plain_from_pretrained
from lightning_zero.engine.meta.materialize import has_meta_tensors
from lightning_zero.engine.sharded_model import check_offload_params
from lightning_zero.fabric import checkpoint
from lightning_zero.fabric.precision import check_precision, shard_scaler, skip_nonfinite_step
from lightning_zero.fabric.wrapper import ShardedForward, StepBracket, ZeROBackwardSyncControl
from lightning_zero.strategies import agreement
from lightning_zero.strategies.options import (
    CheckpointFormat,
    StartMethod,
    bucket_numel,
    check_option_names,
    default_bucket_size_mb,
    parse_dtype,
    validate_options,
    validate_overlap_options,
)
from lightning_zero.strategies.precision import NonFinitePolicy
from lightning_zero.strategies.topology import ProcessTopology

USER_REDUCE = "fabric.all_reduce in user code"


class ZeROFabricStrategy(ProcessTopology, ParallelStrategy):
    """Shared base of the Fabric ``ZeRO1Strategy``, ``ZeRO2Strategy`` and ``ZeRO3Strategy``; use those.

    The options mean what they mean for the Trainer strategies (``lightning_zero.ZeROStrategy``), with
    the same defaults and the same errors for bad values: ``unit_modules``, ``broadcast_buffers``,
    ``process_group_backend``, ``timeout``, ``checkpoint_format`` (what ``fabric.save`` writes:
    ``"sharded"`` directory or ``"full"`` file), ``nonfinite_grads``, ``collective_checks``,
    ``param_dtype``, ``reduce_dtype``, ``offload_optimizer``, ``offload_params`` (stage 3 only; implies
    ``offload_optimizer``), ``meta_init`` (what
    ``fabric.init_module()`` does), ``bucket_size_mb``, ``prefetch``, ``reshard_after_forward``,
    ``shard_size`` (hybrid sharding: ``None``, a number of ranks per shard group, or ``"node"``) and
    ``start_method``. ``accelerator``, ``parallel_devices``, ``cluster_environment``,
    ``checkpoint_io`` and ``precision`` are normally left to ``Fabric``.
    """

    stage: ClassVar[int]

    def __new__(cls, *args: Any, **kwargs: Any) -> ZeROFabricStrategy:
        check_option_names(cls, kwargs)  # a misspelt option lists the valid ones
        return super().__new__(cls)

    def __init__(
        self,
        unit_modules: Sequence[type[Module] | str] | None = None,
        broadcast_buffers: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta = default_pg_timeout,
        checkpoint_format: CheckpointFormat = "sharded",
        nonfinite_grads: NonFinitePolicy = "raise",
        collective_checks: CollectiveChecks = "auto",
        param_dtype: torch.dtype | str | None = None,
        reduce_dtype: torch.dtype | str | None = None,
        offload_optimizer: bool = False,
        offload_params: bool = False,
        meta_init: bool | None = None,
        bucket_size_mb: float | None = None,
        prefetch: int = 1,
        reshard_after_forward: bool = True,
        shard_size: ShardSize = None,
        start_method: StartMethod = "popen",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
    ) -> None:
        validate_options(
            unit_modules=unit_modules,
            broadcast_buffers=broadcast_buffers,
            process_group_backend=process_group_backend,
            timeout=timeout,
            checkpoint_format=checkpoint_format,
            start_method=start_method,
            log_stats=False,
            nonfinite_grads=nonfinite_grads,
            collective_checks=collective_checks,
            offload_optimizer=offload_optimizer,
            meta_init=meta_init,
        )
        validate_overlap_options(self.stage, bucket_size_mb, prefetch, reshard_after_forward)
        check_offload_params(self.stage, offload_params)
        check_shard_size(shard_size)
        self.shard_size = shard_size
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self.unit_modules = None if unit_modules is None else list(unit_modules)
        self.broadcast_buffers = broadcast_buffers
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.checkpoint_format = checkpoint_format
        self.nonfinite_grads = nonfinite_grads
        self.collective_checks = collective_checks
        self.param_dtype = parse_dtype("param_dtype", param_dtype)
        self.reduce_dtype = parse_dtype("reduce_dtype", reduce_dtype)
        self.offload_params = offload_params
        self.offload_optimizer = (
            offload_optimizer or offload_params
        )  # see [Note: parameter offload] in engine/core/unit.py
        self.meta_init = self.stage == 3 if meta_init is None else meta_init
        self.bucket_size_mb = default_bucket_size_mb(self.stage, unit_modules, bucket_size_mb)
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self._start_method = start_method
        self._num_nodes = 1
        self._backward_sync_control = ZeROBackwardSyncControl()
        self._sharded: ShardedModel | None = None
        self._meta_init: InitTrace | None = None
        self._control: ControlChannel | None = None
        self._steps: StepBracket | None = None
        self._mesh: DeviceMesh | None = None
        self.skipped_steps = 0

    # ------------------------------------------------------------------ processes (as Fabric's DDPStrategy)
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        self.resolved_shard_size()  # a shard_size that does not divide the world fails here, on every rank
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        created = not (dist.is_available() and dist.is_initialized())
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )
        if created:  # see [Note: the process group at exit] in engine/comm/process_exit.py
            destroy_at_exit()
        self._control = ControlChannel.create()  # see [Note: agreements] in engine/comm/control.py

    # ------------------------------------------------------------------ model and optimizers
    @property
    def sharded_model(self) -> ShardedModel:
        """The engine that holds the shards (after ``fabric.setup`` / ``fabric.setup_module``)."""
        if self._sharded is None:
            raise RuntimeError(f"{type(self).__name__} has no model yet: call fabric.setup(model, ...) first")
        return self._sharded

    @override
    @contextmanager
    def module_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``fabric.init_module()``: with ``meta_init`` (stage 3's default), the model is built on the ``meta``
        device and created at ``fabric.setup`` one unit at a time, already sharded, with the initial values an
        ordinary construction gives (``empty_init=False`` turns this off)."""
        with ExitStack() as stack:
            stack.enter_context(self.root_device)
            stack.enter_context(self.precision.module_init_context())
            if self.meta_init and empty_init is not False:
                stack.enter_context(refuse_plain_from_pretrained())
                self._meta_init = stack.enter_context(record_meta_init(self.root_device))
            else:
                stack.enter_context(_EmptyInit(enabled=bool(empty_init)))
            yield

    @override
    def module_to_device(self, module: Module) -> None:
        if has_meta_tensors(module):  # built by init_module on meta: the engine creates it on the device
            for tensor in [*module.parameters(), *module.buffers()]:
                if not tensor.is_meta and tensor.device != self.root_device:
                    tensor.data = tensor.data.to(self.root_device)
        else:
            module.to(self.root_device)

    @override
    def setup_module(self, module: Module) -> Module:
        """Shard ``module`` (in place: it keeps its parameters, which become views of the shards) and return a
        wrapper whose forward brackets the step (see [Note: Fabric steps] in ``wrapper.py``)."""
        if self._sharded is not None:
            raise RuntimeError(
                f"{type(self).__name__} shards one model per Fabric; set up the other modules as submodules of one "
                "nn.Module, or use another Fabric for them"
            )
        refuse_module_sharded_elsewhere(module)
        param_dtype = check_precision(self.precision, self.param_dtype)
        trace = self._meta_init if has_meta_tensors(module) else None
        policy = None if self.unit_modules is None else module_class_policy(self.unit_modules)
        comm = Comm(checks=self.collective_checks, control=self._control, stage=self.stage)
        agreement.agree_on_trainable_set(comm, module)
        self._sharded = ShardedModel(
            module,
            stage=self.stage,
            comm=comm,
            policy=policy,
            broadcast_buffers=self.broadcast_buffers,
            param_dtype=param_dtype,
            reduce_dtype=self.reduce_dtype,
            offload_optimizer=self.offload_optimizer,
            offload_params=self.offload_params,
            device=self.root_device,
            meta_init=trace,
            prefetch=self.prefetch,
            reshard_after_forward=self.reshard_after_forward,
            bucket_numel=bucket_numel(self.bucket_size_mb, module),
            shard_size=self.resolved_shard_size(),
        )
        self._meta_init = None
        shard_scaler(self.precision, self._sharded, self.root_device.type)
        # The nonfinite policy reads every step whether any rank's gradients hold inf/NaN: the backward pass's
        # flags answer it without a collective of its own (see ``GradReducer.check_finite``).
        has_scaler = getattr(self.precision, "scaler", None) is not None
        self._sharded.reducer.check_finite = not has_scaler and self.nonfinite_grads != "ignore"
        self._steps = StepBracket(self._sharded)
        return ShardedForward(module, self._steps)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Let ``optimizer`` (over the module's parameters, built before or after ``setup_module``) step this
        rank's shards: the same object comes back, with the same param groups."""
        self.sharded_model.bind_optimizer(optimizer)
        if not self.offload_optimizer:
            _optimizers_to_device([optimizer], self.root_device)
        return optimizer

    def _end_step(self) -> None:
        if self._steps is not None:
            self._steps.end()

    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        try:
            super().backward(tensor, module, *args, **kwargs)
        finally:
            self._end_step()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step this rank's master pieces, then spread the updated shards to every rank. Before the step, every
        rank learns whether any rank's gradients hold ``inf``/``NaN`` (``nonfinite_grads``; with a loss scaler,
        the scaler decides)."""
        self._end_step()
        sharded = self.sharded_model
        scaler = getattr(self.precision, "scaler", None)
        if scaler is None and self.nonfinite_grads != "ignore":
            self.skipped_steps += skip_nonfinite_step(sharded, optimizer, self.nonfinite_grads, self.skipped_steps)
        with sharded.on_shards(optimizer):
            output = self.precision.optimizer_step(optimizer, **kwargs)
        sharded.after_optimizer_step(optimizer)
        return output

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Scale the sharded gradients so that their global norm (the one DDP computes over full gradients) is at
        most ``max_norm``; return that norm before clipping (one all-reduce)."""
        sharded = self.sharded_model
        with sharded.on_shards(optimizer):
            self.precision.unscale_gradients(optimizer)
        total = sharded.grad_norm(optimizer, norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
                "set `error_if_nonfinite=False`"
            )
        return sharded.clip_grad_norm_(optimizer, float(max_norm), norm_type)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Clamp every gradient element to ``[-clip_val, clip_val]``: element-wise, so done on the shards."""
        sharded = self.sharded_model
        with sharded.on_shards(optimizer):
            self.precision.unscale_gradients(optimizer)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_value_(params, clip_value=clip_val)

    def gathered_parameters(self, module: Module | None = None, writable: bool = True) -> AbstractContextManager:
        """Inside, the parameters of ``module`` (default: the whole model) hold their full values, as under DDP; a
        collective (call on every rank). See ``ShardedModel.gathered_parameters``.

        Example::

            with fabric.strategy.gathered_parameters(writable=False):
                norm = torch.cat([p.flatten() for p in model.parameters()]).norm()
        """
        if self._sharded is None:
            return nullcontext()
        return self._sharded.gathered_parameters(module, writable=writable)

    def grad_norm(self, optimizer: Optimizer, norm_type: float = 2.0) -> Tensor:
        """The global norm of ``optimizer``'s (sharded) gradients, the same on every rank; a collective."""
        return self.sharded_model.grad_norm(getattr(optimizer, "optimizer", optimizer), norm_type)

    def save_pretrained(self, module: Module, path: str | Path) -> None:
        """Write ``module`` (a transformers model, or a part of the model set up) to ``path`` as a Hugging Face
        checkpoint, every rank writing its own file (see ``ZeROStrategy.save_pretrained``). A collective.

        Example::

            fabric.strategy.save_pretrained(model, "finetuned")
        """
        module = getattr(module, "_original_module", module)  # a module returned by fabric.setup
        if self._sharded is None:
            if self.is_global_zero:
                module.save_pretrained(path)
            self.barrier("save_pretrained")
            return
        write_hf_checkpoint(self._sharded.module, self._sharded.units, module, path, self.global_rank, self.world_size)
        self.barrier("save_pretrained")

    @override
    def teardown(self) -> None:
        """Make the module and its optimizers plain again (full parameters and per-parameter optimizer
        states, gathered: call on every rank; what would not fit stays sharded), then Fabric's own teardown."""
        if self._sharded is not None:
            kept = self._sharded.release()
            if kept is not None:  # see [Note: what fits at the end] in engine/free_memory.py
                rank_zero_warn(kept_sharded_text(kept, fabric=True))
            self._sharded = None
            self._steps = None
        if self._control is not None:  # see [Note: nothing outlives teardown] in engine/comm/control.py
            self._control.close()
            self._control = None
        super().teardown()

    # ------------------------------------------------------------------ checkpoints
    @property
    def device_mesh(self) -> DeviceMesh:
        """A 1-D mesh over all ranks, for ``torch.distributed.checkpoint``."""
        if self._mesh is None:
            self._mesh = init_device_mesh(self.root_device.type, (self.world_size,))
        return self._mesh

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """The full (DDP-shaped) state dict of the sharded module; a collective: call on every rank."""
        module = module.module if isinstance(module, ShardedForward) else module
        if self._sharded is not None and module is self._sharded.module:
            return self._sharded.full_state_dict()
        return module.state_dict()

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The full, per-parameter optimizer state DDP would save; a collective: call on every rank."""
        if self._sharded is not None and optimizer in self._sharded.optimizers:
            return self._sharded.full_optimizer_state_dict(optimizer)
        return optimizer.state_dict()

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """``fabric.save``: a sharded directory (``checkpoint_format="sharded"``) or one full file, atomically;
        call on every rank (see ``lightning_zero/fabric/checkpoint.py``)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        if self._sharded is not None:
            self._sharded.comm.agree_event("save_checkpoint", lambda: f"fabric.save({str(path)!r})")
        target = Path(self.broadcast(str(path)))
        if self._sharded is not None and self.checkpoint_format == "sharded":
            checkpoint.save_sharded_state(self, state, target, filter)
        else:
            checkpoint.save_full_state(self, state, target, filter)

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """``fabric.load``: either format, written at any world size under any stage, into the shards; the
        entries not restored into ``state`` are returned."""
        return checkpoint.load_state(self, Path(self.broadcast(str(path))), state, strict, weights_only)

    # ------------------------------------------------------------------ collectives for user code
    @override
    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            if self._sharded is not None and group is None:
                # Where ranks that ran different code meet: counted and checked like the engine's own collectives.
                return agreement.reduce_like_lightning(self._sharded.comm, tensor, reduce_op, USER_REDUCE)
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        name = args[0] if args else kwargs.get("name")
        agreement.barrier(
            self._control, self._sharded and self._sharded.comm, self.collective_checks, name, self.root_device
        )

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return agreement.broadcast(self._sharded.comm if self._sharded is not None else None, obj, src)
