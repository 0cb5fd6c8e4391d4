"""``fabric.save`` / ``fabric.load`` under the ZeRO strategies: Fabric's state dict in, files out, and back.

The files are the Trainer strategies' (see ``lightning_zero/strategies/checkpointing.py``):

- ``"sharded"``: a directory in which every rank writes its pieces of the model's parameters and of
  the optimizers' states with ``torch.distributed.checkpoint`` (``engine/checkpoint/sharded.py``: names
  ``model/<param>`` and ``optim/<i>/<param>/<key>``); rank 0 adds ``meta.pt`` with every other entry
  of the state (step counters, RNG states, schedulers, other modules' full state dicts) and, under
  ``lightning_zero``, what the shards need to be reassembled plus which state keys held the model
  and the optimizers (``fabric``).
- ``"full"``: one file with the full state dict and full per-parameter optimizer states under the
  user's keys: what Fabric's ``DDPStrategy`` writes, loadable without this package.

Both load at any world size and under any stage; both are written atomically.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning
from lightning.fabric.strategies.strategy import _apply_filter, _validate_keys_for_strict_loading
from lightning.fabric.utilities.types import _Stateful
from torch.nn import Module
from torch.optim import Optimizer

from lightning_zero.engine.checkpoint.sharded import (
    CorruptCheckpointError,
    checkpoint_meta,
    load_sharded,
    sharded_model_state,
    sharded_optimizer_state,
    write_checkpoint_directory,
)
from lightning_zero.engine.io.files import atomic_torch_save, find_checkpoint, new_token
from lightning_zero.strategies.checkpointing import check_file_together, read_meta
from lightning_zero.strategies.saving import gather_from_every_rank

if TYPE_CHECKING:
    from lightning_zero.fabric.strategy import ZeROFabricStrategy

LAYOUT = "fabric"
VERSION_KEY = "pytorch-lightning_version"


def save_full_state(
    strategy: ZeROFabricStrategy, state: dict[str, Any], path: Path, filter: dict[str, Callable] | None
) -> None:
    """One file, as Fabric's ``DDPStrategy`` writes it (full module and optimizer states; a collective)."""
    converted = strategy._convert_stateful_objects_in_state(state, filter=filter or {})
    if strategy.is_global_zero:
        atomic_torch_save(converted, path)
    strategy.barrier("lightning_zero.save")


def save_sharded_state(
    strategy: ZeROFabricStrategy, state: dict[str, Any], path: Path, filter: dict[str, Callable] | None
) -> None:
    """A sharded checkpoint directory (a collective: call on every rank with the same keys)."""
    sharded = strategy.sharded_model
    shards: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    module_key: str | None = None
    optimizer_keys: list[str] = []
    for key, obj in state.items():
        if obj is sharded.module or getattr(obj, "module", None) is sharded.module:
            if filter and key in filter:
                raise ValueError(
                    f"fabric.save(filter={{{key!r}: ...}}) cannot filter the sharded model's entries; save with "
                    "checkpoint_format='full' to filter them"
                )
            module_key = key
            shards.update(sharded_model_state(sharded, strategy.device_mesh))
        elif isinstance(obj, Optimizer) and obj in sharded.optimizers:
            shards.update(sharded_optimizer_state(sharded, obj, len(optimizer_keys), strategy.device_mesh))
            optimizer_keys.append(key)
        else:
            converted = obj.state_dict() if isinstance(obj, (Module, Optimizer, _Stateful)) else obj
            _apply_filter(key, filter or {}, converted, meta)
    if module_key is None:
        raise ValueError(
            "fabric.save with a sharded checkpoint needs the model fabric.setup returned in the state "
            "(e.g. {'model': model, 'optimizer': optimizer}); without it, save with checkpoint_format='full'"
        )
    optimizers = [state[k] for k in optimizer_keys]
    zero_meta = checkpoint_meta(sharded, optimizers)
    zero_meta[LAYOUT] = {"module": module_key, "optimizers": optimizer_keys}
    meta["lightning_zero"] = zero_meta
    # What a Trainer checks first when it loads a checkpoint (ckpt_path=...): the directory is its format too.
    meta.setdefault(VERSION_KEY, lightning.__version__)
    token = strategy.broadcast(new_token())
    write_checkpoint_directory(
        shards, meta, path, token, strategy.is_global_zero, strategy.barrier, strategy.global_rank
    )


def load_state(
    strategy: ZeROFabricStrategy,
    path: Path,
    state: Module | Optimizer | dict[str, Any] | None,
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """Restore ``state`` in place from a checkpoint of either format; return what was not restored."""
    path = find_checkpoint(path)
    check_file_together(path, strategy.global_rank, strategy.world_size, lambda v: gather_from_every_rank(strategy, v))
    # Fabric's files hold the user's keys.
    checkpoint = read_meta(path, weights_only, lightning_file=False, checked=True)
    if isinstance(state, (Module, Optimizer)):  # fabric.load_raw
        if path.is_dir():
            raise ValueError(f"{str(path)!r} is a sharded checkpoint: load it with fabric.load(path, state_dict)")
        _restore(strategy, state, checkpoint, strict)
        return {}
    if not state:
        return checkpoint
    if path.is_dir():
        return _load_directory(strategy, path, state, checkpoint, strict)
    if "state_dict" in checkpoint and "state_dict" not in state:
        _from_trainer_layout(strategy, checkpoint, state)
    _validate_keys_for_strict_loading(state.keys(), checkpoint.keys(), strict=strict)
    for key, obj in list(state.items()):
        if key in checkpoint:
            state[key] = _restore(strategy, obj, checkpoint.pop(key), strict)
    return checkpoint


def _from_trainer_layout(strategy: ZeROFabricStrategy, checkpoint: dict[str, Any], state: dict[str, Any]) -> None:
    """A Trainer's full checkpoint (``state_dict``, ``optimizer_states``): renamed to the keys of ``state`` that
    hold the sharded model and its optimizers, in order."""
    module_key = next((k for k, v in state.items() if _is_sharded_module(strategy, v)), None)
    if module_key is None:
        return
    checkpoint[module_key] = checkpoint.pop("state_dict")
    sharded = strategy.sharded_model
    optimizer_keys = [k for k, v in state.items() if isinstance(v, Optimizer) and v in sharded.optimizers]
    saved = checkpoint.get("optimizer_states", [])
    if optimizer_keys and len(saved) != len(optimizer_keys):
        raise ValueError(
            f"the checkpoint has {len(saved)} optimizers, the state passed to fabric.load has {len(optimizer_keys)}"
        )
    if optimizer_keys:
        checkpoint.pop("optimizer_states")
        checkpoint.update(zip(optimizer_keys, saved))


def _restore(strategy: ZeROFabricStrategy, obj: Any, value: Any, strict: bool) -> Any:
    """Load ``value`` (a full state) into ``obj`` in place; the new value for plain entries."""
    sharded = strategy._sharded
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
    strategy: ZeROFabricStrategy, path: Path, state: dict[str, Any], meta: dict[str, Any], strict: bool
) -> dict[str, Any]:
    if "lightning_zero" not in meta:
        raise CorruptCheckpointError(
            f"{str(path)!r} is a sharded checkpoint written by another tool (no lightning_zero section)"
        )
    zero_meta = meta.pop("lightning_zero")
    sharded = strategy.sharded_model
    layout = zero_meta.get(LAYOUT)
    if layout is None:  # written by the Trainer strategies: the model and its optimizers, in order
        module_key = next((k for k, v in state.items() if _is_sharded_module(strategy, v)), None)
        saved_optimizers = [f"optimizer_states[{i}]" for i in range(len(zero_meta["optimizers"]))]
        wanted = [k for k, v in state.items() if isinstance(v, Optimizer) and v in sharded.optimizers]
        optimizer_keys = wanted if len(wanted) == len(saved_optimizers) else saved_optimizers
    else:
        module_key, optimizer_keys = layout["module"], layout["optimizers"]
        if VERSION_KEY not in state:
            meta.pop(VERSION_KEY, None)  # added by save_sharded_state for the Trainer, not one of the user's entries
    _validate_keys_for_strict_loading(state.keys(), [*meta, module_key, *optimizer_keys], strict=strict)
    if module_key not in state or not _is_sharded_module(strategy, state[module_key]):
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
    load_sharded(sharded, optimizers, path, zero_meta, strategy.device_mesh, strict=strict)
    for key, obj in list(state.items()):
        if key in meta:
            state[key] = _restore(strategy, obj, meta.pop(key), strict)
    return meta


def _is_sharded_module(strategy: ZeROFabricStrategy, obj: Any) -> bool:
    sharded = strategy._sharded
    return sharded is not None and (obj is sharded.module or getattr(obj, "module", None) is sharded.module)
