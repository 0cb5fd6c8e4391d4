"""``ZeRODriver``: what a ZeRO run does, whichever front door (the Trainer's strategy or Fabric's) started it.

[Note: one driver, two doors]
Lightning offers two APIs with different hooks: the Trainer calls ``setup``, ``training_step``,
``optimizer_step``, ``on_exception``, ``teardown``; Fabric calls ``setup_module``, ``setup_optimizer``,
``backward``, ``optimizer_step``, ``save_checkpoint``. Each door is a thin adapter that translates its hooks
into the driver's calls; the driver owns what must behave the same behind both:

- the process group (Lightning's own ``_init_dist_connection``, its cluster environments) and the control
  channel the ranks agree on (see [Note: agreements] in ``engine/comm/control.py``);
- meta-device construction (``recording_init``) and building the ``ShardedModel`` from the ``ZeROConfig``;
- saves and loads: one save protocol (see [Note: save protocol] in ``engine/checkpoint/saving.py``), the same
  crash safety and failure reports for ``trainer.save_checkpoint`` and ``fabric.save``;
- failures: whether the other ranks can still take part in a clean teardown (``on_exception``), the report that
  stops the ranks waiting for this one, and a teardown that gathers nothing after a failure;
- the collectives Lightning and user code ask for (barrier, broadcast, reduce), checked like the engine's own.

What stays in a door is only what its API requires: the Trainer's loops (step agreements, uneven evaluation,
SIGTERM, callbacks that need full parameters), Fabric's wrapper around the module's forward and its state-dict
layout under user keys.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn import Module
from torch.optim import Optimizer

from lightning_zero.driver import agreement
from lightning_zero.driver.config import ZeROConfig
from lightning_zero.driver.failures import RAISED_ON_EVERY_RANK, explain_peer_failure, peer_went_away
from lightning_zero.engine.checkpoint.background import BackgroundSaves, stage_on_host
from lightning_zero.engine.checkpoint.pieces import checkpoint_meta, plain_module_checkpoint
from lightning_zero.engine.checkpoint.saving import save_full, save_sharded_directory
from lightning_zero.engine.comm.advice import EXPORT_CALL
from lightning_zero.engine.comm.comm import Comm
from lightning_zero.engine.comm.control import ControlChannel, abort_if_broken
from lightning_zero.engine.comm.process_exit import destroy_at_exit, mark_failed
from lightning_zero.engine.core.grouping import module_class_policy
from lightning_zero.engine.errors import CheckpointSaveError, PeerFailureError
from lightning_zero.engine.free_memory import kept_sharded_text
from lightning_zero.engine.hf.export import save_with_transformers, write_hf_checkpoint
from lightning_zero.engine.hf.peft_export import (
    check_mergeable,
    holds_adapter_layers,
    is_peft_model,
    write_adapter,
    write_merged,
)
from lightning_zero.engine.io.files import atomic_torch_save
from lightning_zero.engine.io.ranks import Ranks
from lightning_zero.engine.meta.continued import ContinuedRecording
from lightning_zero.engine.meta.init_trace import InitTrace, record_meta_init, refuse_plain_from_pretrained
from lightning_zero.engine.meta.materialize import has_meta_tensors
from lightning_zero.engine.schedule.recompute import apply_activation_checkpointing
from lightning_zero.engine.sharded_model import ShardedModel


class ZeRODriver:
    """The state of one ZeRO strategy's runs: its config, process group and control channel, the ``ShardedModel``
    while one exists, and whether the run failed. Each front door holds one (``strategy.driver``).

    Example::

        driver = ZeRODriver(ZeROConfig(stage=3))
        driver.connect(cluster_environment, torch.device("cpu"))
        sharded = driver.shard(model, device=torch.device("cpu"), param_dtype=None)
    """

    def __init__(self, config: ZeROConfig) -> None:
        self.config = config
        self.process_group_backend = config.process_group_backend
        self.sharded: ShardedModel | None = None
        self.control: ControlChannel | None = None
        self.init_trace: InitTrace | None = None
        self._continued: ContinuedRecording | None = None  # see [Note: writes after the build block]
        self.failed = False
        self._handled: BaseException | None = None  # the exception on_exception last handled
        self._mesh: DeviceMesh | None = None
        self.saves = BackgroundSaves()  # see [Note: asynchronous saves] in engine/checkpoint/background.py

    # ------------------------------------------------------------------ processes
    def connect(self, cluster_environment: ClusterEnvironment, device: torch.device) -> None:
        """Create the default process group (as Lightning's ``DDPStrategy`` does) and the control channel."""
        self.process_group_backend = self.process_group_backend or _get_default_process_group_backend_for_device(device)
        created = not (dist.is_available() and dist.is_initialized())
        _init_dist_connection(
            cluster_environment,
            self.process_group_backend,
            timeout=self.config.timeout,
            device_id=device if device.type != "cpu" else None,
        )
        if created:  # see [Note: the process group at exit] in engine/comm/process_exit.py
            destroy_at_exit()
        self.control = ControlChannel.create()  # see [Note: agreements] in engine/comm/control.py

    def ranks(self) -> Ranks:
        """This rank and the world, for the save protocol (``Ranks``)."""
        initialized = dist.is_available() and dist.is_initialized()
        rank, world_size = (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)
        return Ranks(rank, world_size, self.broadcast)

    def device_mesh(self, device: torch.device) -> DeviceMesh:
        """A 1-D mesh over all ranks, for ``torch.distributed.checkpoint``."""
        if self._mesh is None:
            self._mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        return self._mesh

    # ------------------------------------------------------------------ the model
    @contextmanager
    def recording_init(
        self, device: torch.device, empty_init: bool = False, until_setup: bool = False
    ) -> Generator[None, None, None]:
        """With ``meta_init``, layers built inside are recorded on the ``meta`` device and created at ``shard``, one
        unit at a time, already sharded (``configure_model``, ``fabric.init_module()``). ``empty_init``: the
        ``torch.nn.init`` calls Lightning's ``empty_init=True`` skips are skipped. ``until_setup`` (Fabric): what
        runs after the block until ``shard`` is recorded too (see [Note: writes after the build block] in
        ``engine/meta/continued.py``)."""
        if not self.config.meta_init:
            yield
            return
        self.end_recording()
        with refuse_plain_from_pretrained(), record_meta_init(device, empty_init=empty_init) as recording:
            yield
        self.init_trace = recording
        if until_setup:
            self._continued = ContinuedRecording(recording)

    def end_recording(self) -> None:
        """Stop recording a build that continued past its block (at setup, at the next build, at teardown)."""
        if self._continued is not None:
            self._continued.stop()
            self._continued = None

    def shard(
        self,
        module: Module,
        device: torch.device,
        param_dtype: torch.dtype | None,
        shard_size: int | None = None,
        prepare: Callable[[Module], Module] | None = None,
    ) -> ShardedModel:
        """Shard ``module`` (in place; it keeps its parameter objects) after every rank has agreed on its trainable
        set. ``prepare`` runs first, inside the meta-init recording when the module was built on ``meta`` (a
        precision cast of meta layers is replayed too) and returns the module to shard."""
        self.end_recording()
        trace, self.init_trace = self.init_trace, None
        if prepare is not None:
            built_on_meta = trace is not None and has_meta_tensors(module)
            with record_meta_init(device, trace) if built_on_meta else nullcontext():
                module = prepare(module)
        config = self.config
        comm = Comm(checks=config.collective_checks, control=self.control, stage=config.stage)
        agreement.agree_on_trainable_set(comm, module)
        # Before the engine's hooks, so that the recomputation runs inside them (see [Note: activation checkpointing]).
        apply_activation_checkpointing(module, config.activation_checkpointing_policy)
        self.sharded = ShardedModel(
            module,
            comm,
            config.engine_policy(param_dtype, shard_size),
            units=None if config.unit_modules is None else module_class_policy(config.unit_modules),
            device=device,
            meta_init=trace,
        )
        return self.sharded

    def gathered_parameters(self, module: Module | None, writable: bool) -> AbstractContextManager:
        """See ``ShardedModel.gathered_parameters``; nothing to do when the model is not sharded."""
        if self.sharded is None:
            return nullcontext()
        return self.sharded.gathered_parameters(module, writable=writable)

    # ------------------------------------------------------------------ failures and the end
    def on_exception(
        self, exception: BaseException, raised_on_every_rank: tuple[type[BaseException], ...] = ()
    ) -> None:
        """``exception`` stops this rank's run. Unless every rank raises it at the same point (ours, checked
        everywhere, or one of ``raised_on_every_rank``), another rank may never reach the collectives a clean
        teardown needs: the run is marked failed (teardown then gathers nothing) and the ranks waiting for this
        one are told at once. Idempotent: Fabric's door may see one exception twice (in the strategy call that
        raised it, then leaving ``fabric.launch(fn)``), and it is reported once."""
        if exception is self._handled:
            return
        self._handled = exception
        broken = self.sharded is not None and self.sharded.comm.broken
        self.failed = self.failed or broken or not isinstance(exception, RAISED_ON_EVERY_RANK + raised_on_every_rank)
        if self.failed:
            mark_failed()
        if self.control is not None:
            self.control.explain(exception)
            if self.failed:
                # The ranks waiting for this one stop at once; they know already when a peer went away.
                secondary = isinstance(exception, PeerFailureError) or peer_went_away(exception)
                self.control.report_failure(exception, secondary=secondary)
        if broken:
            assert self.sharded is not None
            abort_if_broken(self.sharded.comm)
        explain_peer_failure(exception)
        self._finish_save_after_failure()

    def _finish_save_after_failure(self) -> None:
        """A failure waits for the save in flight (bounded by the group's timeout); what went wrong with it is
        warned about, the failure that ended the run being the one raised."""
        problem = self.saves.wait_after_failure(self.config.timeout.total_seconds())
        if problem is not None:
            rank_zero_warn(str(problem))

    def teardown(self, describe_end: Callable[[], str], fabric: bool = False) -> bool:
        """End the run: every rank agrees it is at the end (unless it failed), the module gets its full parameters
        back (gathered; nothing is gathered after a failure) and the control channel closes. Returns whether the
        model stays sharded (its full parameters would not fit: see [Note: what fits at the end] in
        ``engine/free_memory.py``; rank 0 is warned)."""
        self.end_recording()
        kept = False
        save_error: BaseException | None = None
        if not self.failed:  # after a failure, on_exception has waited for the save in flight
            try:
                self.saves.wait()  # raised after the teardown is done: every rank raises it
            except CheckpointSaveError as error:
                save_error = error
        self.saves.close()
        if self.sharded is not None:
            if not self.failed:
                self.sharded.comm.agree_event("teardown", describe_end)
            reason = self.sharded.release(gather=not self.failed)
            if reason is None:
                self.sharded = None
            else:
                kept = True
                rank_zero_warn(kept_sharded_text(reason, fabric=fabric))
        if self.control is not None:  # see [Note: nothing outlives teardown] in engine/comm/control.py
            self.control.close(destroy_group=not self.failed)
            self.control = None
        self.failed = False
        self._handled = None
        if save_error is not None:
            raise save_error
        return kept

    # ------------------------------------------------------------------ collectives Lightning and user code ask for
    def barrier(self, name: str | None, device: torch.device) -> None:
        comm = self.sharded.comm if self.sharded is not None else None
        agreement.barrier(self.control, comm, self.config.collective_checks, name, device)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return agreement.broadcast(self.sharded.comm if self.sharded is not None else None, obj, src)

    def reduce(self, tensor: Tensor, group: Any, reduce_op: Any, name: str, guard: bool = False) -> Tensor:
        """Lightning's ``_sync_ddp``; on the default group while sharded (``None``, or the world group that
        ``fabric.all_reduce`` passes), counted and checked as the engine's own collectives (see
        ``agreement.reduce_like_lightning``)."""
        if self.sharded is not None and (group is None or group is dist.group.WORLD):
            return agreement.reduce_like_lightning(self.sharded.comm, tensor, reduce_op, name, guard=guard)
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    # ------------------------------------------------------------------ saving
    def save_sharded(
        self,
        shards: dict[str, Any],
        meta: dict[str, Any],
        optimizers: list[Optimizer],
        path: Path,
        layout: dict[str, Any] | None = None,
        whole_module: Module | None = None,
    ) -> None:
        """A sharded checkpoint directory through the save protocol: ``shards`` are this rank's pieces (or, with
        ``whole_module``, the entries of a module that is whole again after its run), ``meta`` the rest."""
        if whole_module is not None:
            converted, zero_meta = plain_module_checkpoint(whole_module, optimizers, shards)
            shards = converted
        else:
            assert self.sharded is not None
            zero_meta = checkpoint_meta(self.sharded, optimizers)
        if layout is not None:
            zero_meta.update(layout)
        flat: dict[str, Any] = dict(shards.get("state_dict", {}))
        for optimizer_state in shards.get("optimizer_states", []):
            flat.update(optimizer_state)
        state = {"shards": flat, "meta": meta, "zero_meta": zero_meta}
        self._save(
            path,
            state,
            lambda ranks, s: save_sharded_directory(ranks, s["shards"], s["meta"], s["zero_meta"], path),
            in_background=whole_module is None,
        )

    def save_full(self, checkpoint: dict[str, Any], path: Path) -> None:
        """One ordinary ``torch.save`` file through the save protocol: every rank writes the ``FlatPiece``s it
        holds into it; a file without pieces is written by rank 0 alone."""
        sharded = self.sharded is not None

        def write(ranks: Ranks, state: dict[str, Any]) -> None:
            if sharded:
                save_full(ranks, state, path)
            elif ranks.is_zero:
                atomic_torch_save(state, path)

        self._save(path, checkpoint, write, in_background=sharded)

    def _save(self, path: Path, state: Any, write: Callable[[Ranks, Any], None], in_background: bool) -> None:
        """``write(ranks, state)`` now, or (``async_save``, during a run) on a copy of ``state`` staged in host memory
        and written in the background (see [Note: asynchronous saves] in ``engine/checkpoint/background.py``).
        Either way the previous background save is finished first."""
        saves = self.saves
        if not (self.config.async_save and in_background):
            saves.wait()
            write(self.ranks(), state)
            return
        ranks = saves.prepare(self.config.timeout)
        # The copies run on a side stream; the compute stream waits for them before the engine next writes the model.
        join_later = self.sharded.order_writes_after if self.sharded is not None else None
        staged = stage_on_host(state, saves.pinned, saves.cpu_mesh, join_later=join_later)
        saves.start(path, lambda background: write(background, staged.state), staged, ranks)

    def finish_saves(self, path: Path | None = None) -> None:
        """Wait for the save in flight (only if it writes ``path``, when given) and raise what it raised."""
        if path is None or self.saves.writing(path):
            self.saves.wait()

    def save_pretrained(self, root: Module, module: Module, path: str | Path, merged: bool = False) -> None:
        """``module`` (part of ``root``) as a Hugging Face checkpoint folder in place of the one ``path`` holds, every
        rank writing its share (see [Note: writing a Hugging Face checkpoint] and [Note: save_pretrained into a
        folder] in ``engine/hf/export.py``); rank 0 calls ``module.save_pretrained`` when the model is
        not sharded. A peft ``PeftModel``: its adapter, as peft writes it, or with ``merged`` the model with the
        adapter merged in (see [Note: saving a peft model] in ``engine/hf/peft_export.py``). Every rank
        agrees first that it is here, before anything is gathered or written: called on one rank only, it raises
        ``CollectiveMismatchError`` and leaves nothing behind. What cannot be saved so is refused next, on every
        rank, with ``CheckpointSaveError``."""
        ranks = self.ranks()
        if self.sharded is not None:
            describe = f"{EXPORT_CALL}{str(path)!r})"  # the advice (engine/comm/advice.py) names the fix from it
            self.sharded.comm.agree_event("save_pretrained", lambda: describe)
        peft = is_peft_model(module)
        if merged and not peft:
            raise CheckpointSaveError(
                f"save_pretrained(..., merged=True) merges a peft adapter into its base model, and the "
                f"{type(module).__name__} given is not a peft PeftModel: pass the PeftModel (get_peft_model's), or "
                "leave merged out to save this module as it is"
            )
        if merged:
            check_mergeable(module)
        if not peft and holds_adapter_layers(module):
            raise CheckpointSaveError(
                f"the {type(module).__name__} given holds peft's adapter layers (it is the model inside a PeftModel), "
                "whose names no loader reads: pass the PeftModel itself, to save its adapter (or with merged=True "
                "the model with the adapter merged in)"
            )
        target = Path(ranks.broadcast(str(path)))
        units = self.sharded.units if self.sharded is not None else []
        if peft and merged:
            gathered = partial(self.gathered_parameters, writable=False)
            write_merged(root, units, module, target, ranks, gathered)
        elif peft:
            write_adapter(root, units, module, target, ranks)
        elif self.sharded is None:
            save_with_transformers(module, target, ranks)
        else:
            write_hf_checkpoint(root, self.sharded.units, module, target, ranks)
