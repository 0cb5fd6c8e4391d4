"""The Trainer's checkpoint hooks under ZeRO: what Lightning's checkpoint connector asks a strategy for (the state of
the model and of each optimizer, a save, a load, a removal), translated into the driver's formats.

While sharded, a rank hands Lightning its pieces (``FlatPiece``s in DDP's shape for ``"full"``, DTensors for
``"sharded"``), which every rank writes in parallel through the driver's save protocol (see [Note: save protocol]
in ``engine/checkpoint/saving.py``); a load goes straight into the shards, after setup. Not sharded, Lightning's
defaults apply.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.driver import checkpointing
from lightning_zero.driver.config import CheckpointFormat
from lightning_zero.driver.door_calls import begin_load, begin_save, refuse_storage_options
from lightning_zero.driver.driver import ZeRODriver
from lightning_zero.engine.checkpoint.pieces import (
    piece_optimizer_state,
    piece_state_dict,
    sharded_model_state,
    sharded_optimizer_state,
)
from lightning_zero.engine.io.files import find_checkpoint, remove_checkpoint
from lightning_zero.strategies.full_model import unwrap_optimizer

# The entries of Lightning's checkpoint dict that a sharded directory holds as shards; the rest goes to meta.pt.
_SHARDED_KEYS = ("state_dict", "optimizer_states")


class CheckpointHooks(ParallelStrategy):
    """Lightning's checkpoint hooks for ``ZeROStrategy``, which lists this class before Lightning's
    ``ParallelStrategy`` among its bases; it provides ``driver``, ``checkpoint_format`` and
    ``unwrapped_optimizers``.

    Example::

        class ZeROStrategy(ZeROOptions, EvaluationSteps, CheckpointHooks, ..., ParallelStrategy): ...
    """

    driver: ZeRODriver
    checkpoint_format: CheckpointFormat
    unwrapped_optimizers: list[Optimizer]

    @property
    def writes_sharded_checkpoints(self) -> bool:
        """Whether ``save_checkpoint`` writes a sharded directory now: the ``"sharded"`` format, during a run or after
        it (from the whole module, once its process group exists)."""
        if self.checkpoint_format != "sharded":
            return False
        return self.driver.sharded is not None or (self._lightning_module is not None and dist.is_initialized())

    @property
    def writes_parallel_checkpoints(self) -> bool:
        """Whether ``save_checkpoint`` writes one full file from every rank now (sharded model, ``"full"``)."""
        return self.driver.sharded is not None and self.checkpoint_format == "full"

    @property
    def device_mesh(self) -> DeviceMesh:
        """A 1-D mesh over all ranks, for ``torch.distributed.checkpoint``."""
        return self.driver.device_mesh(self.root_device)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # checkpoints load straight into the shards, which exist only after setup

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizers itself

    def full_state_dict(self) -> dict[str, Any]:
        """The full, unsharded state dict (as ``DDPStrategy`` returns it); a collective: call on all ranks.

        Example::

            state = trainer.strategy.full_state_dict()  # on every rank
        """
        if self.driver.sharded is None:
            return super().lightning_module_state_dict()
        return self.driver.sharded.full_state_dict()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """While sharded, this rank's pieces of the parameters, as the checkpoint writer takes them (DTensors
        with ``"sharded"``, ``FlatPiece``s with ``"full"``); the full state dict otherwise. For full tensors
        while sharded, call ``full_state_dict()``."""
        sharded = self.driver.sharded
        if sharded is None:
            return self.full_state_dict()
        if self.writes_sharded_checkpoints:
            return sharded_model_state(sharded, self.device_mesh)
        return piece_state_dict(sharded)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.driver.sharded is None:
            super().load_model_state_dict(checkpoint, strict=strict)
        # Otherwise load_checkpoint has already put the weights into the shards.

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's pieces of the optimizer state, as the checkpoint writer takes them: DTensors
        (``"sharded"``), or the per-parameter state ``DDPStrategy`` saves with ``FlatPiece``s (``"full"``)."""
        sharded = self.driver.sharded
        if sharded is None:
            return super().optimizer_state(optimizer)
        raw = unwrap_optimizer(optimizer)
        index = self.unwrapped_optimizers.index(raw)
        if self.checkpoint_format == "sharded":
            return sharded_optimizer_state(sharded, raw, index, self.device_mesh)
        return piece_optimizer_state(sharded, raw, index)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self.driver.sharded is None:
            super().load_optimizer_state_dict(checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint directory or a full ``.ckpt`` file, atomically; call on all ranks."""
        refuse_storage_options(self, storage_options)
        driver = self.driver
        path = begin_save(driver, "save_checkpoint", filepath)
        # Decided from the strategy, the same on every rank: a rank whose shards happen to be empty (tiny
        # parameters, many ranks) must still join the collective save.
        if self.writes_sharded_checkpoints:
            shards = {k: checkpoint[k] for k in _SHARDED_KEYS if k in checkpoint}
            meta = {k: v for k, v in checkpoint.items() if k not in _SHARDED_KEYS}
            optimizers = self.unwrapped_optimizers[: len(checkpoint.get("optimizer_states", []))]
            whole = self.lightning_module if driver.sharded is None else None  # a run has ended: whole again
            driver.save_sharded(shards, meta, optimizers, path, whole_module=whole)
        else:
            driver.save_full(checkpoint, path)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        driver = self.driver
        path = begin_load(driver, checkpoint_path)  # (the save in flight may be the checkpoint asked for)
        if driver.sharded is None:
            return checkpointing.read_meta(find_checkpoint(path), weights_only)
        module = self.lightning_module
        fitting = module is not None and module.trainer.state.fn == TrainerFn.FITTING
        strict = True if module is None else module.strict_loading
        return checkpointing.load(
            driver.sharded,
            driver.ranks(),
            self.device_mesh,
            path,
            weights_only,
            self.unwrapped_optimizers,
            with_optimizers=fitting,
            strict=strict,
        )

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self.driver.finish_saves(Path(filepath))  # a save of that path in the background: done first, every rank
        if self.is_global_zero:
            remove_checkpoint(Path(filepath))

    def finish_saves(self) -> None:
        """Wait for the checkpoint being written in the background (``async_save=True`` or ``AsyncCheckpointIO``) and
        raise what its save raised; nothing to do without one. Call on every rank. The next save, loading a
        checkpoint and the end of the run wait by themselves.

        Example::

            trainer.save_checkpoint("model.ckpt")
            trainer.strategy.finish_saves()  # model.ckpt is complete from here on
        """
        self.driver.finish_saves()
