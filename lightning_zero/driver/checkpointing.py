"""Checkpoint files for both front doors: what is read back, checked by every rank together, and consolidated.

Two formats (``checkpoint_format=``):

- ``"full"`` (default): one ordinary ``.ckpt`` file, exactly what ``DDPStrategy`` writes (full state
  dict, full per-parameter optimizer states), loadable without this package, e.g. by
  ``LightningModule.load_from_checkpoint``. Every rank writes its own shards into it, in parallel;
  nothing is gathered (see [Note: parallel full file] in ``engine/io/torch_file.py``).
- ``"sharded"``: a directory. Every rank writes its own file of shards with
  ``torch.distributed.checkpoint`` (see [Note: checkpoint layout] in ``engine/checkpoint/pieces.py`` and
  [Note: sharded layout] in ``engine/checkpoint/sharded.py``); rank 0 adds ``meta.pt`` with Lightning's part
  (loops, callbacks, LR schedulers, hyper-parameters, precision state) and what the shards need to be reassembled.

Either kind loads at any world size, under any stage. Saves follow [Note: save protocol] in
``engine/checkpoint/saving.py`` (crash-safe, cleaned up on failure; ``ZeRODriver.save_sharded`` / ``save_full``);
reads follow [Note: checkpoint trust] in
``engine/io/safe_read.py`` (``weights_only=True`` unless the caller passes ``weights_only=False``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_zero.engine.checkpoint.sharded import META_FILE, consolidate_state, load_sharded
from lightning_zero.engine.errors import CheckpointSaveError, WeightsOnlyCheckpointError
from lightning_zero.engine.io.files import (
    atomic_torch_save,
    commit,
    find_checkpoint,
    hold,
    new_token,
    release,
    remove,
    temporary_path,
)
from lightning_zero.engine.io.ranks import Ranks, gather_from_every_rank
from lightning_zero.engine.io.safe_read import (
    CorruptCheckpointError,
    UnsafeCheckpointError,
    check_records,
    load_torch_file,
    regular_file,
)
from lightning_zero.engine.sharded_model import ShardedModel

__all__ = [
    "CheckpointSaveError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "WeightsOnlyCheckpointError",
    "consolidate",
    "load",
    "read_checked",
    "read_meta",
]


def check_checkpoint_io(io: Any) -> bool:
    """Whether the ``checkpoint_io`` plugin asks for asynchronous saves (Lightning's ``AsyncCheckpointIO`` around the
    default writer: the strategies then save with ``async_save``); any plugin other than Lightning's default
    ``TorchCheckpointIO`` is refused, since the strategies write and read checkpoints themselves (every rank its own
    pieces, through the save protocol) and would never call it: a plugin for remote storage or encryption would
    not see the files. ``None`` (the default) passes."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    if io is None or type(io) is TorchCheckpointIO:
        return False
    name = type(io).__name__
    if name == "AsyncCheckpointIO":
        inner = getattr(io, "_checkpoint_io", None)  # the writer it wraps (Lightning sets its default one later)
        if inner is None or type(inner) is TorchCheckpointIO:
            return True
        raise ValueError(
            f"AsyncCheckpointIO({type(inner).__name__}(...)) would never call {type(inner).__name__}: "
            "lightning_zero's strategies write checkpoints themselves, every rank its own shards in parallel and "
            "crash-safe (docs/checkpoints.md). Use AsyncCheckpointIO() alone (or async_save=True) for "
            "asynchronous saves."
        )
    raise ValueError(
        f"the checkpoint_io plugin {name} would never be called: lightning_zero's strategies write and read "
        "checkpoints themselves, every rank its own shards in parallel and crash-safe (docs/checkpoints.md). "
        "Remove the plugin (for asynchronous saves, use AsyncCheckpointIO() or async_save=True); to hand a "
        "checkpoint to your own code, consolidate it into one file with python -m lightning_zero consolidate "
        "CHECKPOINT OUT.ckpt and process that file."
    )


def check_file_together(path: Path, rank: int, world_size: int, gather: Callable[[Any], list[Any]]) -> None:
    """Every rank checks its share of a full checkpoint file's checksums (``check_records``) and every rank raises
    the same ``CorruptCheckpointError`` if any share failed (``gather``: every rank's value, on every rank). A
    sharded checkpoint's ``meta.pt`` is small: ``read_meta`` checks it whole."""
    problem = None
    if not path.is_dir():
        try:
            problem = check_records(path.resolve(), rank, world_size)
        except CorruptCheckpointError as err:
            problem = str(err)
    found = [p for p in gather(problem) if p]
    if found:
        raise CorruptCheckpointError(found[0])


def read_meta(
    path: Path, weights_only: bool | None, lightning_file: bool = True, checked: bool = False
) -> dict[str, Any]:
    """``meta.pt`` of a sharded checkpoint, or the whole dict of a full one (tensors memory-mapped, on the CPU).
    ``checked``: the ranks have checked the full file's checksums together (``check_file_together``)."""
    if path.is_dir():
        root = path.resolve()
        try:
            file = regular_file(root, META_FILE)
        except CorruptCheckpointError as err:
            if (root / META_FILE).exists() or (root / META_FILE).is_symlink():
                raise
            raise CorruptCheckpointError(
                f"{str(path)!r} is a directory without {META_FILE}, so it is not a lightning_zero checkpoint "
                "(a sharded checkpoint of another tool? convert it to a full checkpoint with that tool)"
            ) from err
        meta = load_torch_file(file, weights_only)
        if not isinstance(meta, dict) or not isinstance(meta.get("lightning_zero"), dict):
            raise CorruptCheckpointError(
                f"{str(path)!r} is a sharded checkpoint written by another tool (its {META_FILE} has no "
                "lightning_zero section); convert it to a full checkpoint with that tool first"
            )
        return meta
    # The path may be a link (save_last="link").
    checkpoint = load_torch_file(path.resolve(), weights_only, verify=not checked)
    if not isinstance(checkpoint, dict) or (lightning_file and not isinstance(checkpoint.get("state_dict"), dict)):
        raise CorruptCheckpointError(
            f"{str(path)!r} is not a Lightning checkpoint (it has no 'state_dict' entry). A plain state dict "
            "loads with model.load_state_dict(torch.load(path)); a checkpoint of another library needs that "
            "library's converter"
        )
    return checkpoint


def read_checked(ranks: Ranks, path: Path, weights_only: bool | None, lightning_file: bool = True) -> dict[str, Any]:
    """``read_meta`` of the checkpoint at ``path`` (or the one it names) after every rank has checked its share of
    the file's checksums (``check_file_together``)."""
    check_file_together(path, ranks.rank, ranks.world_size, lambda value: gather_from_every_rank(ranks, value))
    return read_meta(path, weights_only, lightning_file=lightning_file, checked=True)


def load(
    sharded_model: ShardedModel,
    ranks: Ranks,
    mesh: Any,
    path: Path,
    weights_only: bool | None,
    optimizers: list[Any],
    with_optimizers: bool,
    strict: bool,
) -> dict[str, Any]:
    """Load a Lightning checkpoint (``state_dict``, ``optimizer_states``) of either format into ``sharded_model``'s
    shards and, ``with_optimizers`` (when fitting), into ``optimizers``; return the rest for Lightning."""
    path = find_checkpoint(path)
    checkpoint = read_checked(ranks, path, weights_only)
    path = path.resolve() if path.is_dir() else path
    optimizers = optimizers if with_optimizers else []
    if path.is_dir():
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
        load_sharded(sharded_model, optimizers, path, zero_meta, mesh, strict=strict)
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
    result = consolidate_state(path.resolve(), meta) if path.is_dir() else meta
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
    tmp = temporary_path(output, new_token())
    lock = hold(tmp)
    try:
        save_file(tensors, str(tmp))
        commit(tmp, output)
    except BaseException:
        remove(tmp)
        raise
    finally:
        release(lock)
