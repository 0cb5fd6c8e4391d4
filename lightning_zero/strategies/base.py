"""``ZeROStrategy``: the Lightning glue shared by the three stages.

Lightning owns processes (its launchers and cluster environments, exactly as for
``DDPStrategy``), the loops, logging and checkpoint files; the engine
(``lightning_zero.engine.ShardedModel``) owns parameters, gradients and optimizer states. This
class connects the two at the hooks Lightning offers: ``setup`` shards the module and binds the
optimizers, the ``*_step`` hooks bracket user code so stage 3 can hold the root unit,
``optimizer_step`` spreads updated shards, ``block_backward_sync`` defers stage-1 reduction, and
the state-dict hooks convert between shards and the full, DDP-shaped state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.distributed
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.engine import Comm, CommStats, ShardedModel, module_class_policy
from lightning_zero.engine.checkpoint.hf_export import write_hf_checkpoint
from lightning_zero.engine.checkpoint.sharded import (
    piece_optimizer_state,
    piece_state_dict,
    sharded_model_state,
    sharded_optimizer_state,
)
from lightning_zero.engine.comm.control import ControlChannel, PeerFailureError, abort_if_broken
from lightning_zero.engine.comm.mesh import ShardSize, check_shard_size
from lightning_zero.engine.comm.process_exit import destroy_at_exit, mark_failed
from lightning_zero.engine.comm.sequence import CollectiveChecks
from lightning_zero.engine.core.placeholder import has_hidden_parameters, refuse_module_sharded_elsewhere
from lightning_zero.engine.free_memory import kept_sharded_text
from lightning_zero.engine.io.files import find_checkpoint, remove_checkpoint
from lightning_zero.engine.meta.init_trace import InitTrace, record_meta_init, refuse_plain_from_pretrained
from lightning_zero.engine.meta.materialize import has_meta_tensors
from lightning_zero.engine.sharded_model import check_offload_params
from lightning_zero.strategies import agreement, checkpointing
from lightning_zero.strategies.callbacks import bracket_full_parameter_callbacks, unbracket
from lightning_zero.strategies.errors import RAISED_ON_EVERY_RANK, explain_peer_failure, peer_went_away
from lightning_zero.strategies.memory_report import MemoryReport, memory_report
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
from lightning_zero.strategies.precision import NonFinitePolicy, ZeROPrecision
from lightning_zero.strategies.stats import log_step_stats
from lightning_zero.strategies.topology import ProcessTopology

log = logging.getLogger(__name__)
LIGHTNING_REDUCE = "Lightning's reduce (self.log(..., sync_dist=True))"


class ZeROStrategy(ProcessTopology, ParallelStrategy):
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
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            As for any Lightning ``ParallelStrategy``; normally left to the ``Trainer``.
    """

    stage: ClassVar[int]

    def __new__(cls, *args: Any, **kwargs: Any) -> ZeROStrategy:
        # Before __init__, so that a misspelt option lists the valid ones instead of Python's bare TypeError.
        check_option_names(cls, kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        unit_modules: Sequence[type[Module] | str] | None = None,
        broadcast_buffers: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta = default_pg_timeout,
        checkpoint_format: CheckpointFormat = "full",
        log_stats: bool = False,
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
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        validate_options(
            unit_modules=unit_modules,
            broadcast_buffers=broadcast_buffers,
            process_group_backend=process_group_backend,
            timeout=timeout,
            checkpoint_format=checkpoint_format,
            start_method=start_method,
            log_stats=log_stats,
            nonfinite_grads=nonfinite_grads,
            collective_checks=collective_checks,
            offload_optimizer=offload_optimizer,
            meta_init=meta_init,
        )
        validate_overlap_options(self.stage, bucket_size_mb, prefetch, reshard_after_forward)
        check_offload_params(self.stage, offload_params)
        check_shard_size(shard_size)
        self.shard_size = shard_size
        self.bucket_size_mb = default_bucket_size_mb(self.stage, unit_modules, bucket_size_mb)
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = parse_dtype("param_dtype", param_dtype)
        self.reduce_dtype = parse_dtype("reduce_dtype", reduce_dtype)
        self.offload_params = offload_params
        self.offload_optimizer = (
            offload_optimizer or offload_params
        )  # see [Note: parameter offload] in engine/core/unit.py
        self.meta_init = self.stage == 3 if meta_init is None else meta_init
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.unit_modules = None if unit_modules is None else list(unit_modules)
        self.broadcast_buffers = broadcast_buffers
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self.checkpoint_format = checkpoint_format
        self.log_stats = log_stats
        self.nonfinite_grads = nonfinite_grads
        self.collective_checks = collective_checks
        self._mesh: DeviceMesh | None = None
        self._num_nodes = 1
        self._sharded: ShardedModel | None = None
        self._failed = False
        self._control: ControlChannel | None = None
        self._steps: dict[str, int] = {}
        # The evaluation loop under way or last run since the last training step: its phase, and this rank's batches
        # in it so far (see [Note: uneven evaluation] in strategies/agreement.py).
        self._evaluation: tuple[str, int] | None = None
        self._agreed_step: tuple[int, Callable[[], str]] | None = None  # the step agreed at its batch's start
        self._unwrap_batch_start: Callable[[], None] | None = None
        self._stats_logged_until: dict[str, CommStats] | None = None
        self._meta_init: InitTrace | None = None
        self._inserted_callbacks: list[pl.Callback] = []

    # ------------------------------------------------------------------ processes
    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to give each rank its own part of the data (a ``DistributedSampler``)."""
        return True

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
        self.set_world_ranks()
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

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

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
    @property
    def sharded_model(self) -> ShardedModel:
        """The engine that holds this run's shards (available after setup)."""
        if self._sharded is None:
            raise RuntimeError(f"{type(self).__name__} has not been set up yet: call trainer.fit/validate/... first")
        return self._sharded

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        assert self.model is not None
        self.accelerator.setup(trainer)
        assert isinstance(self.precision_plugin, ZeROPrecision)
        precision = self.precision_plugin
        if self.param_dtype is not None and not precision.is_mixed:
            raise ValueError(
                f"param_dtype={self.param_dtype} applies to mixed precision (Trainer(precision='bf16-mixed' or "
                f"'16-mixed')); with precision={precision.precision!r} parameters keep the module's dtype. Remove "
                "param_dtype or choose a mixed precision."
            )
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
        kept = self._sharded if self._sharded is not None and self._sharded.between_runs is not None else None
        if kept is not None and kept.module is not self.model:
            kept = self._sharded = None  # another module: the kept one stays as it is (its reads say why)
        if kept is None:
            refuse_module_sharded_elsewhere(self.model)
            self._sharded = self._shard_model(precision)
        else:  # kept sharded after the previous run (see ``teardown``): used as it is
            kept.resume(self._control)
            agreement.agree_on_trainable_set(kept.comm, self.model)
        self._steps = {}
        self._evaluation = None
        self._meta_init = None
        self._stats_logged_until = None
        precision.nonfinite_grads = self.nonfinite_grads
        precision.attach(self._sharded)
        if trainer.state.fn == TrainerFn.FITTING:
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:
                self._sharded.bind_optimizer(_unwrap(optimizer))
            self._inserted_callbacks = bracket_full_parameter_callbacks(self, trainer.callbacks)
            if self._control is not None and self.collective_checks != "off":
                self._unwrap_batch_start = agreement.wrap_batch_start(trainer, self._agree_on_next_batch)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self.offload_optimizer:
            _optimizers_to_device(self.optimizers, self.root_device)
        if trainer.state.fn == TrainerFn.FITTING and self.is_global_zero and log.isEnabledFor(logging.INFO):
            log.info("lightning_zero: model-state memory per rank\n%s", self.memory_report())

    def _shard_model(self, precision: ZeROPrecision) -> ShardedModel:
        assert self.model is not None
        built_on_meta = self._meta_init is not None and has_meta_tensors(self.model)
        with record_meta_init(self.root_device, self._meta_init) if built_on_meta else nullcontext():
            self.model = precision.convert_module(self.model)  # a cast of meta layers is replayed too
        self.model_to_device()
        policy = None if self.unit_modules is None else module_class_policy(self.unit_modules)
        comm = Comm(checks=self.collective_checks, control=self._control, stage=self.stage)
        agreement.agree_on_trainable_set(comm, self.model)
        return ShardedModel(
            self.model,
            stage=self.stage,
            comm=comm,
            policy=policy,
            broadcast_buffers=self.broadcast_buffers,
            param_dtype=self.param_dtype or precision.default_param_dtype,
            reduce_dtype=self.reduce_dtype,
            offload_optimizer=self.offload_optimizer,
            offload_params=self.offload_params,
            device=self.root_device,
            meta_init=self._meta_init,
            prefetch=self.prefetch,
            reshard_after_forward=self.reshard_after_forward,
            bucket_numel=bucket_numel(self.bucket_size_mb, self.model),
            shard_size=self.resolved_shard_size(),
        )

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if has_meta_tensors(self.model):  # created by configure_model under meta_init: the engine materializes
            _move_real_tensors(self.model, self.root_device)
        else:
            self.model.to(self.root_device)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Around ``configure_model``: with ``meta_init``, layers are created on the ``meta`` device (no
        memory) and materialized already sharded at setup, one unit at a time."""
        if self.meta_init:
            with refuse_plain_from_pretrained(), record_meta_init(self.root_device) as recording:
                yield
            self._meta_init = recording
        else:
            yield

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Another rank may not reach the collectives that a full teardown needs: do not wait for it,
        # unless the error is one that every rank raises at the same point (ours, checked everywhere).
        broken = self._sharded is not None and self._sharded.comm.broken
        self._failed = broken or not isinstance(exception, RAISED_ON_EVERY_RANK)
        if self._failed:
            mark_failed()
        if self._control is not None:
            self._control.explain(exception)
            if self._failed:
                # The ranks waiting for this one stop at once; they know already when a peer went away.
                secondary = isinstance(exception, PeerFailureError) or peer_went_away(exception)
                self._control.report_failure(exception, linger=not secondary)
        if broken:
            abort_if_broken(self._sharded.comm)
        explain_peer_failure(exception)

    @override
    def teardown(self) -> None:
        if self._inserted_callbacks and self._lightning_module is not None:
            unbracket(self._lightning_module.trainer.callbacks, self._inserted_callbacks)
        self._inserted_callbacks = []
        if self._unwrap_batch_start is not None:
            self._unwrap_batch_start()
            self._unwrap_batch_start = None
        if self._sharded is not None:
            if not self._failed:
                fn = self.lightning_module.trainer.state.fn if self._lightning_module is not None else None
                what = f"trainer.{fn.value}()" if fn is not None else "the run"
                if self._evaluation is not None:  # see [Note: uneven evaluation] in strategies/agreement.py
                    what += f", after this rank's {self._evaluation[1]} {self._evaluation[0]} batches"
                self._sharded.comm.agree_event("teardown", lambda: f"teardown at the end of {what}")
            kept = self._sharded.release(gather=not self._failed)
            if kept is None:
                self._sharded = None
            else:  # see [Note: what fits at the end] in engine/free_memory.py
                rank_zero_warn(kept_sharded_text(kept))
        if self._control is not None:  # see [Note: nothing outlives teardown] in engine/comm/control.py
            self._control.close(destroy_group=not self._failed)
            self._control = None
        module = self._lightning_module
        kept_sharded = self._sharded is not None
        if module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING:
            if self._layer_sync and self.model is not None and not kept_sharded:
                self.model = self._layer_sync.revert(self.model)
        self._failed = False
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

    # ------------------------------------------------------------------ steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        module = self.lightning_module
        assert module is not None
        step = self._count_step("training")
        self._evaluation = None
        accumulating = self.sharded_model.reducer.no_sync_requested
        agreed = self._agreed_step[1] if self._agreed_step is not None and self._agreed_step[0] == step else None
        self._agreed_step = None
        sharded = self.sharded_model
        agreement.begin_training_step(sharded.comm, module.trainer, sharded.params, accumulating, step, agreed)
        sharded.begin_step()
        try:
            return super().training_step(*args, **kwargs)
        finally:
            assert self.lightning_module is not None
            if not self.lightning_module.automatic_optimization:
                self.sharded_model.end_step()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._eval_step():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._eval_step():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._eval_step():
            return super().predict_step(*args, **kwargs)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._start_evaluation()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._start_evaluation()

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._start_evaluation()

    def _start_evaluation(self) -> None:
        """An evaluation loop starts: its steps count from 1 (see [Note: uneven evaluation])."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        self._evaluation = (_eval_phase(trainer), 0)

    @contextmanager
    def _eval_step(self) -> Generator[None, None, None]:
        """Around ``validation_step``, ``test_step``, ``predict_step``: see [Note: uneven evaluation] in
        ``strategies/agreement.py``."""
        sharded = self.sharded_model
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        phase = _eval_phase(trainer)
        step = (self._evaluation[1] if self._evaluation is not None else 0) + 1
        self._evaluation = (phase, step)
        trained = self._steps.get("training", 0)
        after = f"after {trained} training steps" if trained else "no training steps yet"
        joined = sharded.stage3 is not None  # only stage 3 gathers in forward
        agreement.begin_eval_step(sharded.comm, phase, step, lambda: f"{phase} step {step} ({after})", joined)
        with self._evaluation_forward():
            yield
        if not joined:
            sharded.comm.end_sequence()  # the next step may run on some ranks only
        elif _is_last_eval_batch(trainer):
            describe = partial(agreement.describe_serving, phase, step, after)
            served = agreement.serve_eval_steps(sharded.comm, phase, step, describe, self._replay_eval_forward)
            self._steps[f"{phase} served"] = self._steps.get(f"{phase} served", 0) + served  # since setup

    @contextmanager
    def _evaluation_forward(self) -> Generator[None, None, None]:
        sharded = self.sharded_model
        held_already = sharded.root_held  # validation in the middle of gradient accumulation keeps the hold
        sharded.begin_step(training=False)
        try:
            yield
        finally:
            if not held_already:
                sharded.end_step()

    def _replay_eval_forward(self) -> None:
        with self._evaluation_forward():
            self.sharded_model.replay_eval_forward()

    def _agree_on_next_batch(self, sigterm: bool) -> bool | None:
        """See [Note: the start of a training batch] in ``strategies/agreement.py``: returns whether any rank
        received SIGTERM (``None`` if nothing was agreed)."""
        module = self.lightning_module
        assert module is not None
        step = self._steps.get("training", 0) + 1
        sharded = self.sharded_model
        describe, sigterm = agreement.before_training_batch(sharded.comm, module.trainer, sharded.params, step, sigterm)
        self._agreed_step = (step, describe)
        if sigterm is False:  # every rank starts this training step: see [Note: gathers at the start of a batch]
            sharded.gather_for_next_step()
        return sigterm

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if self._sharded is not None:  # gathered for a batch that was then skipped (see gather_for_next_step)
            self._sharded.free_unused_units()

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
        assert self.lightning_module is not None
        if self.lightning_module.automatic_optimization:
            self.sharded_model.end_step()
        self.sharded_model.after_optimizer_step(_unwrap(optimizer))
        if self.log_stats:
            log_step_stats(self)
        return output

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        with self.sharded_model.no_sync():
            yield

    def gathered_parameters(self, module: Module | None = None, writable: bool = True) -> AbstractContextManager:
        """A context in which the parameters of ``module`` (default: the whole ``LightningModule``) hold their full
        values, in the master dtype, as under ``DDPStrategy``; with ``writable`` (default), what user code writes
        into them is kept. Outside a forward, a stage-3 parameter gathers its unit for each read and refuses
        writes (see ``docs/troubleshooting.md``): this context gathers once and keeps writes. A collective: call
        it on every rank. Lightning's weight-averaging callbacks get this automatically; ``module.state_dict()``
        gathers by itself.

        Example::

            def on_train_epoch_end(self):
                with self.trainer.strategy.gathered_parameters(self.encoder):
                    self.log("encoder_norm", torch.cat([p.flatten() for p in self.encoder.parameters()]).norm())
        """
        if self._sharded is None:
            return nullcontext()
        return self._sharded.gathered_parameters(module, writable=writable)

    def grad_norm(self, optimizer: Optimizer | None = None, norm_type: float = 2.0) -> Tensor:
        """The global norm of the current (sharded) gradients; call it on every rank.

        Lightning's ``grad_norm`` utility reads ``param.grad`` of the module, which ZeRO frees; use
        this instead, e.g. in ``on_before_optimizer_step``::

            self.log("grad_norm", self.trainer.strategy.grad_norm())
        """
        optimizers = [_unwrap(optimizer)] if optimizer is not None else [_unwrap(o) for o in self.optimizers]
        norms = [self.sharded_model.grad_norm(o, norm_type) for o in optimizers]
        if len(norms) == 1:
            return norms[0]
        return torch.linalg.vector_norm(torch.stack(norms), norm_type)

    # ------------------------------------------------------------------ state and checkpoints
    @property
    def unwrapped_optimizers(self) -> list[Optimizer]:
        return [_unwrap(o) for o in self.optimizers]

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite gradients (``nonfinite_grads="skip"``)."""
        return self.precision_plugin.skipped_steps if isinstance(self.precision_plugin, ZeROPrecision) else 0

    @property
    def writes_sharded_checkpoints(self) -> bool:
        """Whether ``save_checkpoint`` writes a sharded directory now: the ``"sharded"`` format, during a run or after
        it (from the whole module, once its process group exists)."""
        if self.checkpoint_format != "sharded":
            return False
        return self._sharded is not None or (self._lightning_module is not None and dist.is_initialized())

    @property
    def writes_parallel_checkpoints(self) -> bool:
        """Whether ``save_checkpoint`` writes one full file from every rank now (sharded model, ``"full"``)."""
        return self._sharded is not None and self.checkpoint_format == "full"

    @property
    def device_mesh(self) -> DeviceMesh:
        """A 1-D mesh over all ranks, for ``torch.distributed.checkpoint``."""
        if self._mesh is None:
            self._mesh = init_device_mesh(self.root_device.type, (self.world_size,))
        return self._mesh

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # checkpoints load straight into the shards, which exist only after setup

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizers itself

    def memory_report(self) -> MemoryReport:
        """The memory ``lightning_zero.estimate_memory`` predicts for this model, world size, precision and
        options, next to the bytes this rank holds now (``print(strategy.memory_report())``). Rank 0 logs it
        at setup. Call after setup, on any rank (no collective).

        Example::

            class Report(Callback):
                def on_train_batch_end(self, trainer, *args):
                    if trainer.global_step == 1:
                        print(trainer.strategy.memory_report())
        """
        return memory_report(self)

    def full_state_dict(self) -> dict[str, Any]:
        """The full, unsharded state dict (as ``DDPStrategy`` returns it); a collective: call on all ranks."""
        if self._sharded is None:
            return super().lightning_module_state_dict()
        return self._sharded.full_state_dict()

    def save_pretrained(self, module: Module, path: str | Path) -> None:
        """Write ``module`` (the transformers model the ``LightningModule`` holds, or any part of it) to the directory
        ``path`` as a Hugging Face checkpoint that plain ``from_pretrained`` loads: sharded safetensors with their
        index and the model's ``config.json``, each rank writing the tensors dealt to it, never the whole model on
        one rank (see [Note: writing a Hugging Face checkpoint] in ``engine/checkpoint/hf_export.py``). A collective:
        call it on every rank. When the module is not sharded (after ``fit``), rank 0 calls
        ``module.save_pretrained(path)``.

        Example::

            def on_train_end(self):
                self.trainer.strategy.save_pretrained(self.model, "finetuned")
        """
        if self._sharded is None:
            if self.is_global_zero:
                module.save_pretrained(path)
            self.barrier("save_pretrained")
            return
        write_hf_checkpoint(self.model, self._sharded.units, module, path, self.global_rank, self.world_size)
        self.barrier("save_pretrained")

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """While sharded, this rank's pieces of the parameters, as the checkpoint writer takes them (DTensors
        with ``"sharded"``, ``FlatPiece``s with ``"full"``); the full state dict otherwise. For full tensors
        while sharded, call ``full_state_dict()``."""
        if self._sharded is None:
            return self.full_state_dict()
        if self.writes_sharded_checkpoints:
            return sharded_model_state(self._sharded, self.device_mesh)
        return piece_state_dict(self._sharded)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._sharded is None:
            super().load_model_state_dict(checkpoint, strict=strict)
        # Otherwise load_checkpoint has already put the weights into the shards.

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's pieces of the optimizer state, as the checkpoint writer takes them: DTensors
        (``"sharded"``), or the per-parameter state ``DDPStrategy`` saves with ``FlatPiece``s (``"full"``)."""
        if self._sharded is None:
            return super().optimizer_state(optimizer)
        raw = _unwrap(optimizer)
        index = self.unwrapped_optimizers.index(raw)
        if self.checkpoint_format == "sharded":
            return sharded_optimizer_state(self._sharded, raw, index, self.device_mesh)
        return piece_optimizer_state(self._sharded, raw, index)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._sharded is None:
            super().load_optimizer_state_dict(checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint directory or a full ``.ckpt`` file, atomically; call on all ranks."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        if self._sharded is not None:
            self._sharded.comm.agree_event("save_checkpoint", lambda: f"save_checkpoint({str(filepath)!r})")
        checkpointing.save(self, checkpoint, Path(self.broadcast(str(filepath))))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if self._sharded is None:
            return checkpointing.read_meta(find_checkpoint(path), weights_only)
        fitting = self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        return checkpointing.load(self, path, weights_only, with_optimizers=fitting)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove_checkpoint(Path(filepath))

    # ------------------------------------------------------------------ collectives for Lightning
    @override
    def barrier(self, name: str | None = None) -> None:
        agreement.barrier(
            self._control, self._sharded and self._sharded.comm, self.collective_checks, name, self.root_device
        )

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return agreement.broadcast(self._sharded.comm if self._sharded is not None else None, obj, src)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            if self._sharded is not None and group is None:
                # Logging with sync_dist=True, reduce_boolean_decision: counted and checked as the engine's own, and
                # agreed where it comes outside a step (after an evaluation loop: see [Note: uneven evaluation]).
                return agreement.reduce_like_lightning(
                    self._sharded.comm, tensor, reduce_op, LIGHTNING_REDUCE, guard=True
                )
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor


_EVALUATION_LOOPS = {
    TrainerFn.VALIDATING: "validate_loop",
    TrainerFn.TESTING: "test_loop",
    TrainerFn.PREDICTING: "predict_loop",
}


def _is_last_eval_batch(trainer: Any) -> bool:
    """Whether the batch of the evaluation step under way is this rank's last of the loop (``False`` if unknown:
    a step that takes ``dataloader_iter``)."""
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    if fn == TrainerFn.FITTING:
        loop = trainer.fit_loop.epoch_loop.val_loop  # validation and the sanity check
    else:
        loop = getattr(trainer, _EVALUATION_LOOPS.get(fn, ""), None)
    return bool(getattr(getattr(loop, "batch_progress", None), "is_last_batch", False))


def _eval_phase(trainer: Any) -> str:
    stage = getattr(getattr(trainer, "state", None), "stage", None)
    value = getattr(stage, "value", "")
    return {"sanity_check": "sanity check", "validate": "validation", "test": "test", "predict": "predict"}.get(
        value, "validation"
    )


def _move_real_tensors(module: Module, device: torch.device) -> None:
    """``module.to(device)`` for every parameter and buffer that is not on the ``meta`` device."""
    for mod in module.modules():
        for param in mod._parameters.values():
            if param is not None and not param.is_meta and param.device != device:
                param.data = param.data.to(device)
        for name, buf in mod._buffers.items():
            if buf is not None and not buf.is_meta and buf.device != device:
                mod._buffers[name] = buf.to(device)


def _unwrap(optimizer: Optimizer | LightningOptimizer) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
