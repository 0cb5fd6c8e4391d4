"""Checkpoint files for the ZeRO strategies: Lightning's checkpoint dict in, files out, and back.

Two formats (``checkpoint_format=``):

- ``"sharded"`` (default): a directory. Every rank writes its own shards of the parameters and
  optimizer states in parallel with ``torch.distributed.checkpoint`` (see [Note: checkpoint
  layout] in ``engine/checkpoint.py``); rank 0 adds ``meta.pt`` with Lightning's part (loops,
  callbacks, LR schedulers, hyper-parameters, precision state) and what the shards need to be
  reassembled. No rank ever holds a full parameter.
- ``"full"``: one ordinary ``.ckpt`` file, exactly what ``DDPStrategy`` writes (full state dict,
  full per-parameter optimizer states), loadable without this package.

Either kind loads at any world size, under any stage. Writes are atomic (``engine/files.py``);
reads use ``weights_only=True`` unless the caller passes ``weights_only=False`` explicitly.
"""

from __future__ import annotations

import pickle
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_zero.engine.checkpoint import (
    META_FILE,
    CorruptCheckpointError,
    checkpoint_meta,
    consolidate_state,
    load_sharded,
    write_checkpoint_directory,
)
from lightning_zero.engine.files import atomic_torch_save, find_checkpoint, replace_directory, temporary_path

if TYPE_CHECKING:
    from lightning_zero.strategies.base import ZeROStrategy

SHARDED_KEYS = ("state_dict", "optimizer_states")


class UnsafeCheckpointError(pickle.UnpicklingError):
    """The file holds objects only arbitrary pickled code can rebuild; it was not loaded."""


class WeightsOnlyCheckpointError(KeyError):
    """``fit`` was asked to resume from a checkpoint that holds the model only."""


def save(strategy: ZeROStrategy, checkpoint: dict[str, Any], path: Path) -> None:
    """Write ``checkpoint`` at ``path`` (call on every rank)."""
    # Decided from the strategy, the same on every rank: a rank whose shards happen to be empty
    # (tiny parameters, many ranks) must still join the collective save.
    if not strategy.writes_sharded_checkpoints:
        if strategy.is_global_zero:
            atomic_torch_save(checkpoint, path)
        return
    # Built on every rank (it is cheap), so that a problem raises everywhere instead of stranding the others.
    optimizers = strategy.unwrapped_optimizers[: len(checkpoint.get("optimizer_states", []))]
    zero_meta = checkpoint_meta(strategy.sharded_model, optimizers)
    token = strategy.broadcast(uuid.uuid4().hex)
    shards: dict[str, Any] = dict(checkpoint["state_dict"])
    for optimizer_state in checkpoint.get("optimizer_states", []):
        shards.update(optimizer_state)
    meta = {k: v for k, v in checkpoint.items() if k not in SHARDED_KEYS}
    meta["lightning_zero"] = zero_meta
    write_checkpoint_directory(shards, meta, path, token, strategy.is_global_zero, strategy.barrier)


def read_meta(path: Path, weights_only: bool | None) -> dict[str, Any]:
    """``meta.pt`` of a sharded checkpoint, or the whole dict of a full one (tensors on the CPU)."""
    file = path / META_FILE if path.is_dir() else path
    if path.is_dir() and not file.exists():
        raise FileNotFoundError(f"{str(path)!r} is a directory without {META_FILE}: not a lightning_zero checkpoint")
    try:
        return torch.load(file, map_location="cpu", weights_only=weights_only is not False)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f"{str(file)!r} holds objects that only arbitrary pickle code can rebuild, so it was not loaded "
            f"({err}). If you trust the file, pass weights_only=False (e.g. trainer.fit(..., weights_only=False))."
        ) from err
    except (RuntimeError, EOFError) as err:
        raise RuntimeError(f"{str(file)!r} is corrupted or truncated and was not loaded: {err}") from err


def load(strategy: ZeROStrategy, path: Path, weights_only: bool | None, with_optimizers: bool) -> dict[str, Any]:
    """Load a checkpoint of either format into the strategy's shards; return the rest for Lightning."""
    path = find_checkpoint(path)
    checkpoint = read_meta(path, weights_only)
    module = strategy.lightning_module
    strict = True if module is None else module.strict_loading
    sharded_model = strategy.sharded_model
    optimizers = strategy.unwrapped_optimizers if with_optimizers else []
    if path.is_dir():
        if "lightning_zero" not in checkpoint:
            raise CorruptCheckpointError(
                f"{str(path)!r} is a sharded checkpoint written by another tool (its {META_FILE} has no "
                "lightning_zero section); convert it to a full checkpoint with that tool first"
            )
        zero_meta = checkpoint.pop("lightning_zero")
        if with_optimizers and not zero_meta["optimizers"]:
            raise WeightsOnlyCheckpointError(
                "Trying to restore optimizer state but checkpoint contains only the model. This is probably due to "
                "`ModelCheckpoint.save_weights_only` being set to `True`."
            )
        if with_optimizers and len(zero_meta["optimizers"]) != len(optimizers):
            raise ValueError(
                f"the checkpoint has {len(zero_meta['optimizers'])} optimizers, configure_optimizers returned "
                f"{len(optimizers)}: resume with the same optimizers"
            )
        load_sharded(sharded_model, optimizers, path, zero_meta, strategy.device_mesh, strict=strict)
        return checkpoint
    sharded_model.load_full_state_dict(checkpoint["state_dict"], strict=strict)
    if optimizers and "optimizer_states" in checkpoint:
        states = checkpoint["optimizer_states"]
        if len(states) != len(optimizers):
            raise ValueError(
                f"the checkpoint has {len(states)} optimizers, configure_optimizers returned {len(optimizers)}"
            )
        for optimizer, state in zip(optimizers, states):
            sharded_model.load_full_optimizer_state_dict(optimizer, state)
    return checkpoint


def consolidate(
    checkpoint: str | Path, output: str | Path | None = None, weights_only: bool | None = None
) -> dict[str, Any]:
    """The full, DDP-shaped checkpoint dict of a sharded checkpoint, built on one process without a
    process group or GPU; written to ``output`` if given (``.safetensors``: the weights only).

    The ``.ckpt`` it writes is what ``DDPStrategy`` would have saved: ``LightningModule.load_from_checkpoint``
    reads it, and ``trainer.fit(ckpt_path=...)`` resumes from it under any strategy.

    Example::

        from lightning_zero import consolidate_checkpoint

        checkpoint = consolidate_checkpoint("runs/epoch=3-step=400.ckpt", "model.ckpt")
        model = MyModule.load_from_checkpoint("model.ckpt")
    """
    path = find_checkpoint(Path(checkpoint))
    meta = read_meta(path, weights_only)
    result = consolidate_state(path, meta) if path.is_dir() else meta
    if output is not None:
        output = Path(output)
        if output.suffix == ".safetensors":
            save_safetensors(result["state_dict"], output)
        else:
            atomic_torch_save(result, output)
    return result


def save_safetensors(state_dict: dict[str, Any], output: Path) -> None:
    """The tensors of ``state_dict`` as a ``.safetensors`` file (tied weights stored once per name)."""
    try:
        from safetensors.torch import save_file
    except ImportError as err:
        raise ImportError("writing .safetensors needs the safetensors package: pip install safetensors") from err
    tensors = {k: v.detach().clone().contiguous() for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(output, uuid.uuid4().hex)
    save_file(tensors, str(tmp))
    replace_directory(tmp, output)
