"""``fabric.save`` / ``fabric.load`` under the ZeRO strategies: Fabric's state dict in, files out, and back.

The files are the Trainer strategies' (see ``lightning_zero/driver/checkpointing.py``):

- ``"sharded"``: a directory in which every rank writes its pieces of the model's parameters and of
  the optimizers' states with ``torch.distributed.checkpoint`` (``engine/checkpoint/sharded.py``: names
  ``model/<param>`` and ``optim/<i>/<param>/<key>``); rank 0 adds ``meta.pt`` with every other entry
  of the state (step counters, RNG states, schedulers, other modules' full state dicts) and, under
  ``lightning_zero``, what the shards need to be reassembled plus which state keys held the model
  and the optimizers (``fabric``).
- ``"full"``: one file with the full state dict and full per-parameter optimizer states under the
  user's keys: what Fabric's ``DDPStrategy`` writes, loadable without this package. Every rank writes its own
  pieces of the sharded model's tensors into it, in parallel (see [Note: parallel full file] in
  ``engine/io/torch_file.py``); nothing is gathered, unless a ``filter`` needs to see the model's full tensors.

Both are written through the Trainer's save protocol (``ZeRODriver.save_sharded`` / ``save_full``: crash-safe,
every rank raises the same ``CheckpointSaveError`` on a failure, nothing partial is left), and both load at any
world size and under any stage.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning
from lightning.fabric.strategies.strategy import _apply_filter, _validate_keys_for_strict_loading
from lightning.fabric.utilities.types import _Stateful
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import Module
from torch.optim import Optimizer

from lightning_zero.driver.checkpointing import read_checked
from lightning_zero.driver.driver import ZeRODriver
from lightning_zero.engine.checkpoint.pieces import (
    piece_optimizer_state,
    piece_state_dict,
    sharded_model_state,
    sharded_optimizer_state,
)
from lightning_zero.engine.checkpoint.sharded import load_sharded
from lightning_zero.engine.errors import CorruptCheckpointError
from lightning_zero.engine.io.files import find_checkpoint

LAYOUT = "fabric"
VERSION_KEY = "pytorch-lightning_version"


def save_full_state(
    driver: ZeRODriver,
    state: dict[str, Any],
    path: Path,
    filter: dict[str, Callable] | None,
    convert: Callable[[dict[str, Any], dict[str, Callable]], dict[str, Any]],
) -> None:
    """One file, as Fabric's ``DDPStrategy`` writes it (full module and optimizer states; a collective). The sharded
    model and its optimizers enter it as this rank's pieces, written by every rank (``convert``: Fabric's own
    conversion of the other entries; with a ``filter`` on the model's key, the model's state is gathered for it)."""
    sharded = driver.sharded
    filter = filter or {}
    if sharded is None:
        driver.save_full(convert(state, filter), path)
        return
    converted: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    optimizers = list(sharded.optimizers)
    for key, obj in state.items():
        if _holds(sharded, obj) and key not in filter:
            converted[key] = piece_state_dict(sharded)
        elif isinstance(obj, Optimizer) and obj in optimizers and key not in filter:
            converted[key] = piece_optimizer_state(sharded, obj, optimizers.index(obj))
        else:
            rest[key] = obj
    converted.update(convert(rest, filter))
    driver.save_full({key: converted[key] for key in state if key in converted}, path)


def save_sharded_state(
    driver: ZeRODriver, mesh: DeviceMesh, state: dict[str, Any], path: Path, filter: dict[str, Callable] | None
) -> None:
    """A sharded checkpoint directory (a collective: call on every rank with the same keys)."""
    sharded = driver.sharded
    assert sharded is not None
    shards: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    module_key: str | None = None
    optimizer_keys: list[str] = []
    for key, obj in state.items():
        if _holds(sharded, obj):
            if filter and key in filter:
                raise ValueError(
                    f"fabric.save(filter={{{key!r}: ...}}) cannot filter the sharded model's entries; save with "
                    "checkpoint_format='full' to filter them"
                )
            module_key = key
            shards.update(sharded_model_state(sharded, mesh))
        elif isinstance(obj, Optimizer) and obj in sharded.optimizers:
            shards.update(sharded_optimizer_state(sharded, obj, len(optimizer_keys), mesh))
            optimizer_keys.append(key)
        else:
            converted = obj.state_dict() if isinstance(obj, (Module, Optimizer, _Stateful)) else obj
            _apply_filter(key, filter or {}, converted, meta)
    if module_key is None:
        raise ValueError(
            "fabric.save with a sharded checkpoint needs the model fabric.setup returned in the state "
            "(e.g. {'model': model, 'optimizer': optimizer}); without it, save with checkpoint_format='full'"
        )
    # What a Trainer checks first when it loads a checkpoint (ckpt_path=...): the directory is its format too.
    meta.setdefault(VERSION_KEY, lightning.__version__)
    optimizers = [state[k] for k in optimizer_keys]
    layout = {LAYOUT: {"module": module_key, "optimizers": optimizer_keys}}
    driver.save_sharded({"state_dict": shards}, meta, optimizers, path, layout=layout)


def _holds(sharded: Any, obj: Any) -> bool:
    """Whether ``obj`` is the sharded module, or the wrapper ``fabric.setup`` returned around it."""
    return obj is sharded.module or getattr(obj, "module", None) is sharded.module


def load_state(
    driver: ZeRODriver,
    mesh: Callable[[], DeviceMesh],
    path: Path,
    state: Module | Optimizer | dict[str, Any] | None,
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """Restore ``state`` in place from a checkpoint of either format; return what was not restored."""
    path = find_checkpoint(path)
    checkpoint = read_checked(driver.ranks(), path, weights_only, lightning_file=False)  # Fabric's: the user's keys
    if isinstance(state, (Module, Optimizer)):  # fabric.load_raw
        if path.is_dir():
            raise ValueError(f"{str(path)!r} is a sharded checkpoint: load it with fabric.load(path, state_dict)")
        _restore(driver, state, checkpoint, strict)
        return {}
    if not state:
        return checkpoint
    if path.is_dir():
        return _load_directory(driver, mesh(), path, state, checkpoint, strict)
    if "state_dict" in checkpoint and "state_dict" not in state:
        _from_trainer_layout(driver, checkpoint, state)
    _validate_keys_for_strict_loading(state.keys(), checkpoint.keys(), strict=strict)
    for key, obj in list(state.items()):
        if key in checkpoint:
            state[key] = _restore(driver, obj, checkpoint.pop(key), strict)
    return checkpoint


def _from_trainer_layout(driver: ZeRODriver, checkpoint: dict[str, Any], state: dict[str, Any]) -> None:
    """A Trainer's full checkpoint (``state_dict``, ``optimizer_states``): renamed to the keys of ``state`` that
    hold the sharded model and its optimizers, in order."""
    module_key = next((k for k, v in state.items() if _is_sharded_module(driver, v)), None)
    if module_key is None:
        return
    checkpoint[module_key] = checkpoint.pop("state_dict")
    sharded = driver.sharded
    assert sharded is not None
    optimizer_keys = [k for k, v in state.items() if isinstance(v, Optimizer) and v in sharded.optimizers]
    saved = checkpoint.get("optimizer_states", [])
    if optimizer_keys and len(saved) != len(optimizer_keys):
        raise ValueError(
            f"the checkpoint has {len(saved)} optimizers, the state passed to fabric.load has {len(optimizer_keys)}"
        )
    if optimizer_keys:
        checkpoint.pop("optimizer_states")
        checkpoint.update(zip(optimizer_keys, saved))


def _restore(driver: ZeRODriver, obj: Any, value: Any, strict: bool) -> Any:
    """Load ``value`` (a full state) into ``obj`` in place; the new value for plain entries."""
    sharded = driver.sharded
    module = getattr(obj, "module", None)
    if sharded is not None and (obj is sharded.module or module is sharded.module):
        sharded.load_full_state_dict(value, strict=strict)
    elif sharded is not None and isinstance(obj, Optimizer) and obj in sharded.optimizers:
        sharded.load_full_optimizer_state_dict(obj, value)
    elif isinstance(obj, Module):
        obj.load_state_dict(value, strict=strict)
    elif isinstance(obj, (Optimizer, _Stateful)):
        obj.load_state_dict(value)
    else:
        return value
    return obj


def _load_directory(
    driver: ZeRODriver, mesh: DeviceMesh, path: Path, state: dict[str, Any], meta: dict[str, Any], strict: bool
) -> dict[str, Any]:
    if "lightning_zero" not in meta:
        raise CorruptCheckpointError(
            f"{str(path)!r} is a sharded checkpoint written by another tool (no lightning_zero section)"
        )
    zero_meta = meta.pop("lightning_zero")
    sharded = driver.sharded
    assert sharded is not None
    layout = zero_meta.get(LAYOUT)
    if layout is None:  # written by the Trainer strategies: the model and its optimizers, in order
        module_key = next((k for k, v in state.items() if _is_sharded_module(driver, v)), None)
        saved_optimizers = [f"optimizer_states[{i}]" for i in range(len(zero_meta["optimizers"]))]
        wanted = [k for k, v in state.items() if isinstance(v, Optimizer) and v in sharded.optimizers]
        optimizer_keys = wanted if len(wanted) == len(saved_optimizers) else saved_optimizers
    else:
        module_key, optimizer_keys = layout["module"], layout["optimizers"]
        if VERSION_KEY not in state:
            meta.pop(VERSION_KEY, None)  # added by save_sharded_state for the Trainer, not one of the user's entries
    _validate_keys_for_strict_loading(state.keys(), [*meta, module_key, *optimizer_keys], strict=strict)
    if module_key not in state or not _is_sharded_module(driver, state[module_key]):
        raise ValueError(
            f"the checkpoint holds the sharded model under {module_key!r}: pass the model fabric.setup returned under "
            f"that key (fabric.load(path, {{{module_key!r}: model, ...}}))"
        )
    requested = [k for k in optimizer_keys if k in state]
    if requested and requested != optimizer_keys:
        raise ValueError(f"the checkpoint holds the optimizers {optimizer_keys}: pass all of them or none")
    optimizers = [state[k] for k in requested]
    for key, optimizer in zip(requested, optimizers):
        if not (isinstance(optimizer, Optimizer) and optimizer in sharded.optimizers):
            raise ValueError(f"state[{key!r}] must be an optimizer set up with this model (fabric.setup)")
    if not optimizers:
        zero_meta = {**zero_meta, "optimizers": []}
    load_sharded(sharded, optimizers, path, zero_meta, mesh, strict=strict)
    for key, obj in list(state.items()):
        if key in meta:
            state[key] = _restore(driver, obj, meta.pop(key), strict)
    return meta


def _is_sharded_module(driver: ZeRODriver, obj: Any) -> bool:
    return driver.sharded is not None and _holds(driver.sharded, obj)
