"""``ZeROStrategy``: the Trainer's door, shared by the three stages.

A thin adapter over the ``ZeRODriver`` Fabric's strategies use too (see [Note: one driver, two doors] in
``driver/driver.py``). Lightning owns processes (its launchers and cluster environments, exactly as for
``DDPStrategy``), the loops, logging and checkpoint files; the driver owns the process group, the
``ShardedModel``, saves and failures. This class translates the hooks Lightning offers: ``setup`` shards the
module and binds the optimizers, the ``*_step`` hooks bracket user code so stage 3 can hold the root unit (the
evaluation steps in ``evaluation.py``), ``optimizer_step`` spreads updated shards, ``block_backward_sync``
defers stage-1 reduction; the state-dict and checkpoint hooks convert between shards and the full, DDP-shaped
state (``checkpoints.py``), and ``full_model.py`` serves what user code asks of the whole model.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import contextmanager
from functools import partial
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.driver import agreement as driver_agreement
from lightning_zero.driver.config import CheckpointFormat
from lightning_zero.driver.door_calls import module_to_device
from lightning_zero.driver.options import ZeROOptions
from lightning_zero.driver.precision import param_dtype_for
from lightning_zero.driver.topology import ProcessTopology
from lightning_zero.engine.core.placeholder import has_hidden_parameters, refuse_module_sharded_elsewhere
from lightning_zero.engine.meta.materialize import has_meta_tensors
from lightning_zero.engine.sharded_model import ShardedModel
from lightning_zero.strategies import agreement
from lightning_zero.strategies.callbacks import bracket_full_parameter_callbacks, unbracket
from lightning_zero.strategies.checkpoints import CheckpointHooks
from lightning_zero.strategies.evaluation import EvaluationSteps
from lightning_zero.strategies.full_model import FullModelAccess, unwrap_optimizer
from lightning_zero.strategies.precision import TRAINER_WORDS, ZeROPrecision
from lightning_zero.strategies.stats import StepStats

log = logging.getLogger(__name__)
LIGHTNING_REDUCE = "Lightning's reduce (self.log(..., sync_dist=True))"


class ZeROStrategy(ZeROOptions, EvaluationSteps, FullModelAccess, CheckpointHooks, ProcessTopology, ParallelStrategy):
    """Shared base of ``ZeRO1Strategy``, ``ZeRO2Strategy`` and ``ZeRO3Strategy``; use those.

    Args:
        unit_modules: Which modules form a *unit*, the parameters gathered and reduced together
            (one collective each): module classes, or class names as strings (``"Block"`` or
            ``"my_pkg.model.Block"``). ``None`` (default): the model's repeated blocks and its
            largest leaves, small modules joining the root unit (``engine.default_unit_policy``; see
            ``docs/stages.md``). The ``LightningModule`` itself is always a unit.
        broadcast_buffers: Copy rank 0's buffers (e.g. BatchNorm statistics) to every rank before
            each training step, as ``DDPStrategy`` does by default.
        process_group_backend: ``"gloo"``, ``"nccl"``, ... Default: NCCL on CUDA, gloo on CPU.
        timeout: How long a collective may wait for the other ranks before failing.
        checkpoint_format: ``"full"`` (default): ``trainer.save_checkpoint`` / ``ModelCheckpoint`` write one
            ordinary ``.ckpt`` file, exactly what ``DDPStrategy`` writes (``load_from_checkpoint``
            reads it), into which every rank writes its own shards in parallel (no gather).
            ``"sharded"``: a directory with one file of shards per rank (``torch.distributed.checkpoint``).
            While sharded, ``lightning_module_state_dict()`` returns this rank's pieces. Both load
            at any world size and under any stage; see ``docs/checkpoints.md``.
        log_stats: Log, through the Trainer's loggers, after every optimizer step: bytes sent and seconds
            spent per kind of collective (this rank), the longest time any rank spent in collectives,
            and this rank's model-state bytes (parameters, gathered parameters, gradients, optimizer
            states). Costs one small all-reduce per step.
        nonfinite_grads: What to do when a gradient holds ``inf`` or ``NaN`` before an optimizer step
            (checked across all ranks): ``"raise"`` (default) stops with an error naming the ranks and
            parameters, ``"skip"`` skips that step on every rank (counted in
            ``strategy.skipped_steps``, warned), ``"ignore"`` steps anyway as DDP does.
        collective_checks: Ranks agree, on a CPU gloo group and without a device synchronisation, on what they
            are about to do, and otherwise raise ``CollectiveMismatchError`` on every rank, naming what each rank
            was doing, instead of deadlocking or exchanging the wrong data. ``"auto"`` (default): the trainable
            set at setup, every step, saves, barriers, broadcasts, the teardown, and the collectives that leave
            the previous step's track (one agreement per step in a steady run); ``"all"``: every collective too
            (debugging); ``"off"``: none. Whatever the setting, ranks that wait for each other in different
            collectives raise within seconds (see ``docs/faults.md``).
        param_dtype: Mixed precision only (``precision="bf16-mixed"`` / ``"16-mixed"``): the dtype parameters
            are gathered and computed in (``torch.bfloat16``, ``torch.float16``, ``torch.float32``, or their
            names as strings). Default: the half type, so that stage 3 gathers half the bytes; fp32 master
            shards are kept for the optimizer either way. ``torch.float32`` gives Lightning's own mixed
            precision (fp32 parameters under autocast), identical to ``DDPStrategy``'s.
        reduce_dtype: The dtype gradients are reduce-scattered in. Default: ``torch.float32`` (accurate;
            the gradients of half-precision parameters are upcast before the reduction).
        offload_optimizer: Keep the fp32 master shards, sharded gradients and optimizer states in (pinned)
            CPU memory and run the optimizer step there (ZeRO-Offload): only the compute copy of the
            parameters stays on the accelerator.
        offload_params: Stage 3 only (stages 1 and 2 refuse it at construction): keep the parameter shards in
            (pinned) CPU memory too, copied to the device each time their unit is gathered, so that the device
            holds only the units in flight (DeepSpeed's ``offload_param``, FSDP2's ``CPUOffloadPolicy``).
            Implies ``offload_optimizer`` (``strategy.offload_optimizer`` then reads ``True``). Costs one
            host-to-device copy of each unit's shard per gather; results are the same as without it. Example:
            ``ZeRO3Strategy(offload_params=True)``. See ``docs/memory.md``.
        meta_init: Build the layers of ``LightningModule.configure_model`` on the ``meta`` device and create
            them one unit at a time, already sharded, with each module's ``reset_parameters()``, so that
            the full model never exists on one rank. Default: ``True`` for stage 3, ``False`` otherwise.
        bucket_size_mb: Stages 1 and 2: units are merged (in registration order) into buckets of at most this
            many megabytes (2^20 bytes; a larger unit stays alone), one reduce-scatter and one all-gather each,
            as ``DDPStrategy``'s ``bucket_cap_mb`` caps its buckets. Default: 25 without ``unit_modules``, no
            merging with it.
            Stage 3 gathers per unit, so its units follow ``unit_modules`` instead.
        prefetch: Stage 3: how many units ahead to all-gather while the current one computes (``0``: none),
            in the order recorded on the first training step. Default 1.
        reshard_after_forward: Stage 3: ``True`` (default) frees each unit after its forward and gathers it
            again in backward (``3Ψ`` communication, least memory); ``False`` keeps it gathered until its
            gradients are reduced (``2Ψ``, as stages 1 and 2, for the memory of every unit at once).
        shard_size: Hybrid sharding: ``None`` (default) shards over all ranks; a number ``S`` shards every state
            over groups of ``S`` consecutive ranks and replicates it across the groups (FSDP's HYBRID_SHARD,
            ZeRO++ hpZ); ``"node"`` is the processes of one node. Parameter gathers stay inside a group; each
            group's reduced gradient shard is all-reduced across groups. ``S`` must divide the world size.
            Example: ``ZeRO3Strategy(shard_size="node")`` on 8 nodes of 8 GPUs holds ``16Ψ/8`` bytes per GPU
            and gathers over the node's links only. See ``docs/multinode.md``.
        start_method: How Lightning starts processes when it launches them itself: ``"popen"``
            (re-runs the script, the default, as for ``DDPStrategy``), ``"spawn"``, ``"fork"``
            or ``"forkserver"``.
        activation_checkpointing_policy: Recompute the activations of the selected modules in backward instead of
            keeping them, as on Lightning's ``FSDPStrategy``: a set of module classes (or class names), one of
            torch's FSDP policies (``ModuleWrapPolicy({Block})``), or ``fn(module) -> bool``. Every stage; names
            and checkpoints unchanged. Example: ``ZeRO3Strategy(activation_checkpointing_policy={Block})``. See
            ``docs/memory.md``.
        accumulate: Stages 2 and 3 under ``accumulate_grad_batches``: ``"sharded"`` (default) reduce-scatters every
            micro-batch into the sharded gradient; ``"local"`` adds up the full gradients on each rank and
            reduce-scatters once per optimizer step, as DDP and stage 1 do (a k-th of the traffic, DDP's bits, the
            full gradients' memory during the step). Stage 1 always accumulates locally and refuses ``"sharded"``.
        async_save: Write checkpoints in the background (also turned on by Lightning's ``AsyncCheckpointIO``).
        quantize_weights: ``"int8"`` (stage 3): every gather of a unit for compute moves int8 values with one fp32
            scale per 256 elements; masters, optimizer and checkpoints stay exact. Example:
            ``ZeRO3Strategy(quantize_weights="int8", quantize_grads="int8")``. See ``docs/performance.md``.
        quantize_grads: ``"int8"`` (stages 2 and 3): each unit's reduce-scatter moves int8 chunks, summed in fp32.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            As for any Lightning ``ParallelStrategy``; normally left to the ``Trainer``.
    """

    stage: ClassVar[int]
    default_checkpoint_format: ClassVar[CheckpointFormat] = "full"

    @override
    def init_door(self) -> None:
        self._steps: dict[str, int] = {}
        # The evaluation loop under way or last run since the last training step: its phase, and this rank's batches
        # in it so far (see [Note: uneven evaluation] in strategies/agreement.py).
        self._evaluation: tuple[str, int] | None = None
        self._step_agreement = agreement.StepAgreement()  # see [Note: the start of a training batch]
        self._step_stats = StepStats()
        self._inserted_callbacks: list[pl.Callback] = []

    # ------------------------------------------------------------------ processes
    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to give each rank its own part of the data (a ``DistributedSampler``)."""
        return True

    @override
    def _configure_launcher(self) -> None:
        self.configure_zero_launcher(_MultiProcessingLauncher, _SubprocessScriptLauncher)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.connect_ranks()

    # ------------------------------------------------------------------ precision
    @property
    @override
    def precision_plugin(self) -> ZeROPrecision:
        if self._precision_plugin is None:
            # Not stored: the Trainer treats a strategy's stored plugin as the user's choice and would
            # ignore Trainer(precision=...).
            return self._default_precision
        assert isinstance(self._precision_plugin, ZeROPrecision)
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._default_precision = ZeROPrecision()
        self._precision_plugin = None if plugin is None else ZeROPrecision.from_lightning(plugin)

    # ------------------------------------------------------------------ setup and teardown
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        self.accelerator.setup(trainer)
        assert isinstance(self.precision_plugin, ZeROPrecision)
        precision = self.precision_plugin
        param_dtype = param_dtype_for(precision.precision, self.param_dtype, TRAINER_WORDS)
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            # Trainer(sync_batchnorm=True): BatchNorm layers become SyncBatchNorm, as DDPStrategy does when fitting.
            self.model = self._layer_sync.apply(self.model)
            if self.root_device.type == "cpu" and any(
                isinstance(m, torch.nn.SyncBatchNorm) for m in self.model.modules()
            ):
                # DDPStrategy refuses this at the same point, with the same words (SyncBatchNorm needs a GPU).
                raise ValueError(
                    "SyncBatchNorm layers only work with GPU modules: Trainer(sync_batchnorm=True) converted the "
                    "BatchNorm layers, but this run is on the CPU. Use accelerator='gpu', or leave sync_batchnorm off."
                )
        driver = self.driver
        kept = driver.sharded if driver.sharded is not None and driver.sharded.between_runs is not None else None
        if kept is not None and kept.module is not self.model:
            kept = driver.sharded = None  # another module: the kept one stays as it is (its reads say why)
        if kept is None:
            refuse_module_sharded_elsewhere(self.model)
            self._shard_model(precision, param_dtype)
        else:  # kept sharded after the previous run (see ``teardown``): used as it is
            driver.init_trace = None
            kept.resume(driver.control)
            driver_agreement.agree_on_trainable_set(kept.comm, self.model)
        self._steps = {}
        self._evaluation = None
        self._step_stats = StepStats()
        if self.log_stats:
            self._step_stats.start(self.sharded_model)
        precision.nonfinite_grads = self.nonfinite_grads
        precision.attach(self.sharded_model)
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                self.sharded_model.bind_optimizer(unwrap_optimizer(optimizer))
            self._inserted_callbacks = bracket_full_parameter_callbacks(self.gathered_parameters, trainer.callbacks)
            if driver.control is not None:  # where a report says this rank is, after the training loop
                driver.control.context = partial(agreement.after_training, trainer)
            if driver.control is not None and self.collective_checks != "off":
                self._step_agreement.install(trainer, self._agree_on_next_batch)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self.offload_optimizer:
            _optimizers_to_device(self.optimizers, self.root_device)
        if trainer.state.fn == TrainerFn.FITTING and self.is_global_zero and log.isEnabledFor(logging.INFO):
            log.info("lightning_zero: model-state memory per rank\n%s", self.memory_report())

    def _shard_model(self, precision: ZeROPrecision, param_dtype: torch.dtype | None) -> ShardedModel:
        def prepare(module: Module) -> Module:
            self.model = precision.convert_module(module)  # a cast of meta layers is replayed too
            self.model_to_device()
            return self.model

        assert self.model is not None
        return self.driver.shard(
            self.model,
            device=self.root_device,
            param_dtype=param_dtype,
            shard_size=self.resolved_shard_size(),
            prepare=prepare,
        )

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        module_to_device(self.model, self.root_device)  # built by configure_model on meta: the engine creates the rest

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Around ``configure_model``: with ``meta_init``, layers are created on the ``meta`` device (no
        memory) and materialized already sharded at setup, one unit at a time."""
        with self.driver.recording_init(self.root_device):
            yield

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._step_agreement.forget(self.driver.sharded)
        # Another rank may not reach the collectives that a full teardown needs: do not wait for it, unless the
        # error is one that every rank raises at the same point (ours, checked everywhere, or rank 0's SIGTERM,
        # announced in the step agreement: see [Note: the start of a training batch]).
        self.driver.on_exception(exception, raised_on_every_rank=(SIGTERMException,))

    @override
    def teardown(self) -> None:
        self._step_agreement.forget(self.driver.sharded)
        if self._inserted_callbacks and self._lightning_module is not None:
            unbracket(self._lightning_module.trainer.callbacks, self._inserted_callbacks)
        self._inserted_callbacks = []
        self._step_agreement.remove()
        self.driver.teardown(self._describe_end)
        module = self._lightning_module
        kept_sharded = self.driver.sharded is not None
        if module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING:
            if self._layer_sync and self.model is not None and not kept_sharded:
                self.model = self._layer_sync.revert(self.model)
        if isinstance(self._precision_plugin, ZeROPrecision):
            self._precision_plugin.attach(None)
        module = self._lightning_module
        if module is not None and (kept_sharded or has_meta_tensors(module) or has_hidden_parameters(module)):
            # Refused at setup while still on the meta device: there is nothing to move to the CPU (and
            # moving would fail, hiding the error that stopped the run). Sharded (kept after a run, here or by
            # another strategy): moving would read it whole.
            self._lightning_module = None
            try:
                super().teardown()
            finally:
                self._lightning_module = module
            return
        super().teardown()

    def _describe_end(self) -> str:
        """What this rank is at the end of, for the teardown's agreement."""
        fn = self.lightning_module.trainer.state.fn if self._lightning_module is not None else None
        what = f"trainer.{fn.value}()" if fn is not None else "the run"
        if self._evaluation is not None:  # see [Note: uneven evaluation] in strategies/agreement.py
            what += f", after this rank's {self._evaluation[1]} {self._evaluation[0]} batches"
        return f"teardown at the end of {what}"

    # ------------------------------------------------------------------ steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        self._step_agreement.settle()
        module = self.lightning_module
        assert module is not None
        step = self._count_step("training")
        self._evaluation = None
        sharded = self.sharded_model
        self._step_agreement.begin_training_step(sharded, module.trainer, step)
        sharded.begin_step()
        try:
            return super().training_step(*args, **kwargs)
        finally:
            assert self.lightning_module is not None
            if not self.lightning_module.automatic_optimization:
                self.sharded_model.end_step()

    def _agree_on_next_batch(self, sigterm: bool) -> agreement.BatchStart:
        """Agree on the next training step where Lightning starts its batch (see [Note: the start of a training
        batch] in ``strategies/agreement.py``), with this rank's SIGTERM flag."""
        module = self.lightning_module
        assert module is not None
        step = self._steps.get("training", 0) + 1
        return self._step_agreement.start_batch(self.sharded_model, module.trainer, step, sigterm)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        self._step_agreement.settle()  # the fetch is done: see [Note: the start of a training batch]
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self.driver.sharded is not None:  # gathered for a batch that was then skipped (see gather_for_next_step)
            self.driver.sharded.free_unused_units()

    def _count_step(self, phase: str) -> int:
        self._steps[phase] = self._steps.get(phase, 0) + 1
        return self._steps[phase]

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Any,
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        module = self.lightning_module
        assert module is not None
        sharded = self.sharded_model
        if module.automatic_optimization:
            sharded.end_step()
        sharded.after_optimizer_step(unwrap_optimizer(optimizer))
        if sharded.stage3 is not None and module.automatic_optimization and _another_step_follows(module.trainer):
            sharded.gather_for_next_step()  # every rank has just stepped: see its docstring
            self._step_agreement.gathered_ahead = True
        if self.log_stats:
            trainer = self.lightning_module.trainer
            self._step_stats.log(trainer, self.sharded_model, self.root_device, self.skipped_steps)
        return output

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        with self.sharded_model.no_sync():
            yield

    # ------------------------------------------------------------------ state
    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite gradients (``nonfinite_grads="skip"``)."""
        return self.precision_plugin.skipped_steps if isinstance(self.precision_plugin, ZeROPrecision) else 0

    # ------------------------------------------------------------------ collectives for Lightning
    @override
    def barrier(self, name: str | None = None) -> None:
        self.driver.barrier(name, self.root_device)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return self.driver.broadcast(obj, src)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            # Logging with sync_dist=True, reduce_boolean_decision: counted and checked as the engine's own, and
            # agreed where it comes outside a step (after an evaluation loop: see [Note: uneven evaluation]).
            return self.driver.reduce(tensor, group, reduce_op, LIGHTNING_REDUCE, guard=True)
        return tensor


def _another_step_follows(trainer: pl.Trainer) -> bool:
    """Whether the fit loop has optimizer steps left after this one, as every rank alike knows it (``max_steps``
    and the step count; not the epoch's batches, which a rank with less data counts differently). After the last
    one, the next step's first gathers would stay gathered through the end-of-training hooks for a step that does
    not come (see [Note: gathers at the start of a batch])."""
    return trainer.max_steps == -1 or trainer.global_step + 1 < trainer.max_steps
