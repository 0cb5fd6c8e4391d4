"""``ZeROFabricStrategy``: Fabric's door, shared by the three stages.

A thin adapter over the ``ZeRODriver`` the Trainer's strategies use too (see [Note: one driver, two doors] in
``driver/driver.py``): Fabric owns processes (its launchers and cluster environments, as for its
``DDPStrategy``) and the user owns the loop; the driver owns the process group, the ``ShardedModel``, saves and
failures. This class translates the hooks Fabric calls:

- ``setup_module`` shards the module and returns a wrapper whose ``forward`` brackets the user's
  forward (see [Note: Fabric steps] in ``wrapper.py``); ``setup_optimizer`` binds each optimizer to the shards;
- ``backward`` ends the step, ``optimizer_step`` steps this rank's master pieces and all-gathers the
  updated shards, ``no_backward_sync`` defers the reduction, ``clip_gradients_*`` clip with the
  global norm;
- ``save_checkpoint`` / ``load_checkpoint`` (``lightning_zero/fabric/checkpoint.py``) write, through the
  driver's save protocol, and read the same sharded directories (or full files) as the Trainer strategies;
- ``module_init_context`` records a meta-device construction so stage 3 creates the model sharded;
- what the strategy's calls raise, and what escapes ``fabric.launch(fn)``, goes to ``on_exception``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import torch
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import TBroadcast
from lightning.fabric.utilities.init import _EmptyInit
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH, ReduceOp
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.driver.config import CheckpointFormat
from lightning_zero.driver.door_calls import begin_load, begin_save, module_to_device, refuse_storage_options
from lightning_zero.driver.options import ZeROOptions
from lightning_zero.driver.precision import arm_finite_check, checks_finite
from lightning_zero.driver.topology import ProcessTopology
from lightning_zero.engine.comm.device_wait import read_on_host
from lightning_zero.engine.core.placeholder import refuse_module_sharded_elsewhere
from lightning_zero.fabric import checkpoint
from lightning_zero.fabric.precision import check_precision, has_scaler, shard_scaler, skip_nonfinite
from lightning_zero.fabric.wrapper import ShardedForward, StepBracket, ZeROBackwardSyncControl

USER_REDUCE = "fabric.all_reduce in user code"


class ZeROFabricStrategy(ZeROOptions, ProcessTopology, ParallelStrategy):
    """Shared base of the Fabric ``ZeRO1Strategy``, ``ZeRO2Strategy`` and ``ZeRO3Strategy``; use those.

    The options mean what they mean for the Trainer strategies (``lightning_zero.ZeROStrategy``), with
    the same defaults and the same errors for bad values: ``unit_modules``, ``broadcast_buffers``,
    ``process_group_backend``, ``timeout``, ``checkpoint_format`` (what ``fabric.save`` writes:
    ``"sharded"`` directory or ``"full"`` file), ``nonfinite_grads``, ``collective_checks``,
    ``param_dtype``, ``reduce_dtype``, ``offload_optimizer``, ``offload_params`` (stage 3 only; implies
    ``offload_optimizer``), ``meta_init`` (what
    ``fabric.init_module()`` does), ``bucket_size_mb``, ``prefetch``, ``reshard_after_forward``,
    ``shard_size`` (hybrid sharding: ``None``, a number of ranks per shard group, or ``"node"``),
    ``start_method``, ``activation_checkpointing_policy``, ``accumulate`` (``"local"``: the micro-batches run
    under ``fabric.no_backward_sync(model)`` add up full gradients and reduce once), ``async_save``,
    ``quantize_weights`` and ``quantize_grads`` (``"int8"`` collectives). ``accelerator``,
    ``parallel_devices``, ``cluster_environment``,
    ``checkpoint_io`` and ``precision`` are normally left to ``Fabric``.
    """

    stage: ClassVar[int]
    default_checkpoint_format: ClassVar[CheckpointFormat] = "sharded"
    unsupported_options: ClassVar[tuple[str, ...]] = ("log_stats",)  # Fabric's loop logs; the strategy cannot
    set_up_by: ClassVar[str] = "fabric.setup(model, ...)"

    @override
    def init_door(self) -> None:
        self._backward_sync_control = ZeROBackwardSyncControl()
        self._steps: StepBracket | None = None
        self.skipped_steps = 0

    # ------------------------------------------------------------------ processes (as Fabric's DDPStrategy)
    @override
    def _configure_launcher(self) -> None:
        self.configure_zero_launcher(_ReportingMultiProcessingLauncher, _ReportingSubprocessScriptLauncher)
        assert isinstance(self._launcher, (_ReportingMultiProcessingLauncher, _ReportingSubprocessScriptLauncher))
        self._launcher.reporting_to = self

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.connect_ranks()

    # ------------------------------------------------------------------ failures
    def on_exception(self, exception: BaseException) -> None:
        """``exception`` ends this rank's run (as the Trainer's ``on_exception`` hook): unless every rank raises it
        at the same point, the ranks waiting for this one are told at once, and ``teardown`` then gathers nothing.
        Called for what the strategy's own calls raise (forward, backward, steps, saves, loads) and for what
        escapes the function given to ``fabric.launch(fn)``; a script that calls ``fabric.launch()`` with no
        function can call it in its ``except`` block.

        Example::

            try:
                train(fabric)
            except BaseException as error:
                fabric.strategy.on_exception(error)
                raise
        """
        self.driver.on_exception(exception)

    @contextmanager
    def _reporting_failures(self) -> Iterator[None]:
        try:
            yield
        except BaseException as error:
            self.on_exception(error)
            raise

    # ------------------------------------------------------------------ model and optimizers
    @override
    @contextmanager
    def module_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``fabric.init_module()``: with ``meta_init`` (stage 3's default), the model is built on the ``meta``
        device and created at ``fabric.setup`` one unit at a time, already sharded, with the initial values DDP's
        construction gives, including what code between the block and ``fabric.setup`` writes (see [Note: writes
        after the build block] in ``engine/meta/continued.py``); ``empty_init=True`` skips what Lightning's skips;
        ``empty_init=False`` builds for real."""
        with ExitStack() as stack:
            stack.enter_context(self.root_device)
            stack.enter_context(self.precision.module_init_context())
            if self.meta_init and empty_init is not False:
                recording = self.driver.recording_init(self.root_device, empty_init=bool(empty_init), until_setup=True)
                stack.enter_context(recording)
            else:
                stack.enter_context(_EmptyInit(enabled=bool(empty_init)))
            yield

    @override
    def module_to_device(self, module: Module) -> None:
        module_to_device(module, self.root_device)  # built by init_module on meta: the engine creates the rest

    @override
    def setup_module(self, module: Module) -> Module:
        """Shard ``module`` (in place: it keeps its parameter objects, whose data become views of the shards) and
        return a wrapper whose forward brackets the step (see [Note: Fabric steps] in ``wrapper.py``)."""
        if self.driver.sharded is not None:
            raise RuntimeError(
                f"{type(self).__name__} shards one model per Fabric; set up the other modules as submodules of one "
                "nn.Module, or use another Fabric for them"
            )
        with self._reporting_failures():
            refuse_module_sharded_elsewhere(module)
            param_dtype = check_precision(self.precision, self.param_dtype)
            sharded = self.driver.shard(
                module, device=self.root_device, param_dtype=param_dtype, shard_size=self.resolved_shard_size()
            )
            shard_scaler(self.precision, sharded, self.root_device.type)
        arm_finite_check(sharded, self.nonfinite_grads, has_scaler(self.precision))
        self._steps = StepBracket(sharded, on_failure=self.on_exception)
        return ShardedForward(module, self._steps)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Let ``optimizer`` (over the module's parameters, built before or after ``setup_module``) step this
        rank's shards: the same object comes back, with the same param groups."""
        with self._reporting_failures():
            self.sharded_model.bind_optimizer(optimizer)
        if not self.offload_optimizer:
            _optimizers_to_device([optimizer], self.root_device)
        return optimizer

    def _end_step(self) -> None:
        if self._steps is not None:
            self._steps.end()

    def _end_evaluation(self) -> None:
        """End the no-grad step left open, if any (see [Note: Fabric steps] in ``wrapper.py``): what every call of
        the strategy does first, other than a forward."""
        if self._steps is not None:
            self._steps.end_evaluation()

    def _between_steps(self) -> bool:
        """End the no-grad step left open, and, if no training step is open either, the sequence of collectives of
        the last step (local): whether no step is open, so that what follows is agreed as outside a step."""
        self._end_evaluation()
        if self._steps is None or self._steps.open:
            return False
        self.sharded_model.comm.end_sequence()
        return True

    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        with self._reporting_failures():
            try:
                super().backward(tensor, module, *args, **kwargs)
            finally:
                self._end_step()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step this rank's master pieces, then spread the updated shards to every rank. Before the step, every
        rank learns whether any rank's gradients hold ``inf``/``NaN`` (``nonfinite_grads``; with a loss scaler,
        the scaler decides)."""
        with self._reporting_failures():
            self._end_step()
            sharded = self.sharded_model
            if checks_finite(self.nonfinite_grads, has_scaler(self.precision)):
                self.skipped_steps += skip_nonfinite(sharded, optimizer, self.nonfinite_grads, self.skipped_steps)
            with sharded.on_shards(optimizer):
                output = self.precision.optimizer_step(optimizer, **kwargs)
            sharded.after_optimizer_step(optimizer)
            sharded.gather_for_next_step()  # every rank has just stepped (see its docstring)
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
        with self._reporting_failures():
            self._end_evaluation()
            with sharded.on_shards(optimizer):
                self.precision.unscale_gradients(optimizer)
            total = sharded.grad_norm(optimizer, norm_type)
        # Every rank has the same norm; reading it waits for the device (as torch's clip_grad_norm_ does with
        # error_if_nonfinite), through the stall report (see [Note: waits for the device] in device_wait.py).
        if error_if_nonfinite and not read_on_host(sharded.comm, torch.isfinite(total).reshape(1), "the norm")[0]:
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
                "set `error_if_nonfinite=False`"
            )
        with self._reporting_failures():
            return sharded.clip_grad_norm_(optimizer, float(max_norm), norm_type)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Clamp every gradient element to ``[-clip_val, clip_val]``: element-wise, so done on the shards."""
        sharded = self.sharded_model
        self._end_evaluation()
        with self._reporting_failures(), sharded.on_shards(optimizer):
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
        self._end_evaluation()
        return self.driver.gathered_parameters(module, writable)

    def grad_norm(self, optimizer: Optimizer, norm_type: float = 2.0) -> Tensor:
        """The global norm of ``optimizer``'s (sharded) gradients, the same on every rank; a collective."""
        self._end_evaluation()
        return self.sharded_model.grad_norm(getattr(optimizer, "optimizer", optimizer), norm_type)

    def save_pretrained(self, module: Module, path: str | Path, merged: bool = False) -> None:
        """Write ``module`` (a transformers model, or a part of the model set up) to ``path`` as a Hugging Face
        checkpoint in place of the one the folder holds, every rank writing its own file; a peft ``PeftModel``: its
        adapter, or with ``merged=True`` the model with the adapter merged in (see
        ``ZeROStrategy.save_pretrained``). A collective.

        Example::

            fabric.strategy.save_pretrained(model, "finetuned")
        """
        module = getattr(module, "_original_module", module)  # a module returned by fabric.setup
        root = self.driver.sharded.module if self.driver.sharded is not None else module
        with self._reporting_failures():
            self._end_evaluation()
            self.driver.save_pretrained(root, module, path, merged)

    @override
    def teardown(self) -> None:
        """Make the module and its optimizers plain again (full parameters and per-parameter optimizer states,
        gathered: call on every rank; what would not fit stays sharded; after a failure nothing is gathered), then
        Fabric's own teardown."""
        steps = self._steps.counts if self._steps is not None else {}
        self._end_evaluation()
        self.driver.teardown(lambda: f"teardown after {steps.get('training', 0)} training steps", fabric=True)
        self.driver.sharded = None  # a Fabric shards one model, once: what stayed sharded is the user's now
        self._steps = None
        super().teardown()

    # ------------------------------------------------------------------ checkpoints
    @property
    def device_mesh(self) -> DeviceMesh:
        """A 1-D mesh over all ranks, for ``torch.distributed.checkpoint``."""
        return self.driver.device_mesh(self.root_device)

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """The full (DDP-shaped) state dict of the sharded module; a collective: call on every rank."""
        module = module.module if isinstance(module, ShardedForward) else module
        sharded = self.driver.sharded
        self._end_evaluation()
        if sharded is not None and module is sharded.module:
            return sharded.full_state_dict()
        return module.state_dict()

    @override
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The full, per-parameter optimizer state DDP would save; a collective: call on every rank."""
        self._end_evaluation()
        sharded = self.driver.sharded
        if sharded is not None and optimizer in sharded.optimizers:
            return sharded.full_optimizer_state_dict(optimizer)
        return optimizer.state_dict()

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """``fabric.save``: a sharded directory (``checkpoint_format="sharded"``) or one full file that every rank
        writes its pieces into, through the save protocol of the Trainer's strategies (crash-safe, the same
        failure reports; see [Note: save protocol] in ``engine/checkpoint/saving.py``); call on every rank."""
        refuse_storage_options(self, storage_options)
        with self._reporting_failures():
            self._end_evaluation()
            target = begin_save(self.driver, "fabric.save", path)
            if self.driver.sharded is not None and self.checkpoint_format == "sharded":
                checkpoint.save_sharded_state(self.driver, self.device_mesh, state, target, filter)
            else:
                checkpoint.save_full_state(self.driver, state, target, filter, self._convert_stateful_objects_in_state)
            self.barrier("lightning_zero.save")

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
        with self._reporting_failures():
            self._end_evaluation()
            target = begin_load(self.driver, path)
            return checkpoint.load_state(self.driver, lambda: self.device_mesh, target, state, strict, weights_only)

    def finish_saves(self) -> None:
        """Wait for the checkpoint being written in the background (``async_save=True``) and raise what its save
        raised; call on every rank. The next ``fabric.save``, ``fabric.load``, ``teardown`` and the end of the
        function given to ``fabric.launch`` wait by themselves.

        Example::

            fabric.save("state.ckpt", {"model": model, "optimizer": optimizer})
            fabric.strategy.finish_saves()  # state.ckpt is complete from here on
        """
        with self._reporting_failures():
            self.driver.finish_saves()

    # ------------------------------------------------------------------ collectives for user code
    @override
    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            # Where ranks that ran different code meet: counted and checked like the engine's own collectives.
            with self._reporting_failures():
                # Between steps, agreed: a rank that is elsewhere (in a no-grad step of its own) is served here.
                between = self._between_steps()
                return self.driver.reduce(tensor, group, reduce_op, USER_REDUCE, guard=between)
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        with self._reporting_failures():
            self._end_evaluation()
            self.driver.barrier(args[0] if args else kwargs.get("name"), self.root_device)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        with self._reporting_failures():
            self._end_evaluation()
            return self.driver.broadcast(obj, src)


class _ReportingMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's launcher, with the function given to ``fabric.launch(fn)`` run so that what escapes it reaches
    ``strategy.on_exception`` (the Trainer calls its strategy's ``on_exception`` the same way)."""

    reporting_to: ZeROFabricStrategy

    @override
    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        return super().launch(partial(_run_reporting_failures, self.reporting_to, function), *args, **kwargs)


class _ReportingSubprocessScriptLauncher(_SubprocessScriptLauncher):
    """As ``_ReportingMultiProcessingLauncher``, for processes started by re-running the script."""

    reporting_to: ZeROFabricStrategy

    @override
    def launch(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        return super().launch(partial(_run_reporting_failures, self.reporting_to, function), *args, **kwargs)


def _run_reporting_failures(strategy: ZeROFabricStrategy, function: Callable, *args: Any, **kwargs: Any) -> Any:
    try:
        result = function(*args, **kwargs)
        strategy.driver.finish_saves()  # a checkpoint still being written is complete when the function returns
        return result
    except BaseException as error:
        strategy.on_exception(error)
        raise
