"""Full (unsharded, DDP-shaped) state of a sharded model: gathered one unit at a time for saving, and
written into the shards one unit at a time when loading, so that no rank ever holds the whole model.

- ``full_state_dict``: the module's state dict with every parameter gathered, in the master dtype.
- ``StateDictGatherer``: ``state_dict`` hooks that make ``module.state_dict()``, called by user code or a
  callback on any module of a sharded model, return the same values DDP's would.
- ``ShardLoader``: ``load_state_dict`` hooks that stream a full state dict into the shards (pretrained
  weights, full checkpoints), whichever module it is called on.
- ``full_optimizer_state_dict`` / ``load_full_optimizer_state_dict``: the optimizer's per-parameter
  state as DDP would save it, and back into shards.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.engine.comm.comm import Comm
from lightning_zero.engine.core.hooks import EngineHook
from lightning_zero.engine.core.layout import ParamShard
from lightning_zero.engine.core.optimizer import is_param_shaped, slice_state
from lightning_zero.engine.core.placeholder import passthrough
from lightning_zero.engine.core.unit import ShardedUnit


def _keys_of(module: nn.Module) -> tuple[dict[str, Any], dict[int, list[str]]]:
    state = module.state_dict(keep_vars=True)  # reads no parameter data
    keys_of: dict[int, list[str]] = {}
    for key, value in state.items():
        keys_of.setdefault(id(value), []).append(key)
    return state, keys_of


def full_state_dict(module: nn.Module, units: list[ShardedUnit]) -> dict[str, Any]:
    """``module``'s full state dict, as DDP would return it: parameters in the master dtype, one unit
    gathered at a time (a collective)."""
    state, keys_of = _keys_of(module)
    for key, value in list(state.items()):
        if isinstance(value, torch.Tensor):
            state[key] = value.detach()
    for unit in units:
        full = unit.full_flat()
        for param, offset, numel in zip(unit.params, unit.layout.offsets, unit.layout.numels):
            copy = full[offset : offset + numel].view(param.shape).clone()
            for key in keys_of.get(id(param), []):
                state[key] = copy
    return state


class StateDictGatherer:
    """``state_dict`` pre- and post-hooks on every module of a sharded model: an entry for a parameter that does
    not show its master values (a stage-3 placeholder, a half-precision compute copy; see [Note: parameters
    outside their unit's use] in ``unit.py``) is replaced by the gathered value, one unit at a time, each unit
    gathered at most once per ``state_dict()`` call. ``keep_vars=True`` returns the parameters themselves,
    untouched. A collective whenever such a unit is involved: call ``state_dict()`` on every rank, as with
    FSDP's full state dicts.

    Example::

        gatherer = StateDictGatherer(units)
        gatherer.install(model)
        model.state_dict()["layer.weight"]     # DDP's values, on every rank
    """

    def __init__(self, units: list[ShardedUnit]) -> None:
        self._where = {
            id(p): (unit, i) for unit in units if unit.needs_gather_to_read for i, p in enumerate(unit.params)
        }
        self._units = units
        self._handles: list[Any] = []
        self._depth = 0
        self._gathered: dict[ShardedUnit, list[torch.Tensor]] = {}
        # ``_save_to_state_dict`` detaches every parameter: the placeholders are taken as they are and replaced in
        # ``_fill`` (see [Note: reading a sharded parameter] in placeholder.py), not gathered one read at a time.
        self._plain: Any = None

    def install(self, root: nn.Module) -> None:
        if not self._where:
            return
        for module in root.modules():
            # Not bound methods: a copy of the module must not take the gatherer along (see [Note: copies of a
            # sharded module]), and torch marks public post-hooks with an attribute, which a method cannot take.
            self._handles.append(module.register_state_dict_pre_hook(EngineHook(self._enter)))
            self._handles.append(module.register_state_dict_post_hook(EngineHook(self._fill)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._gathered.clear()

    def _enter(self, _module: nn.Module, _prefix: str, _keep_vars: bool) -> None:
        if self._depth == 0:
            self._gathered.clear()  # a previous call that raised half-way must not leave stale values
            self._leave_plain()
            for unit in self._units:
                unit.adopt_rebound_data()
            self._plain = passthrough()
            self._plain.__enter__()
        self._depth += 1

    def _leave_plain(self) -> None:
        plain, self._plain = self._plain, None
        if plain is not None:
            plain.__exit__(None, None, None)

    def _fill(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, _local_metadata: Any) -> None:
        try:
            for name, param in module._parameters.items():
                where = self._where.get(id(param)) if param is not None else None
                key = prefix + name
                if where is None or key not in state_dict or isinstance(state_dict[key], nn.Parameter):
                    continue
                unit, index = where
                views = self._gathered.get(unit)
                if views is None:
                    views = self._gathered[unit] = unit.full_views(unit.full_flat("state_dict()"))
                state_dict[key] = views[index]
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._gathered.clear()
                self._leave_plain()


class ShardLoader:
    """``load_state_dict`` pre- and post-hooks on every module of a sharded model.

    [Note: loading into the shards]
    The entries of sharded parameters are taken out of the state dict by each module's pre-hook, as the
    module sees them: torch runs a module's ``load_state_dict`` pre-hooks inside ``Module._load_from_state_dict``,
    so after any renaming the module's own override did first (LitGPT's LoRA layers load ``qkv.weight`` as
    ``qkv.linear.weight`` that way), and each child gets its own filtered copy of the dict. The module the user
    called ``load_state_dict`` on (its prefix is empty) opens the load; its post-hook, which torch runs after
    every module below it, writes what was taken into the shards one unit at a time, in unit order (the same
    collectives on every rank), so that memory never holds more than one full unit besides the state dict, and
    takes the keys it loaded out of ``missing_keys``. A stage-3 parameter, whose storage is freed, is never
    written directly. A source that is not a tensor yet (Lightning's and LitGPT's ``lazy_load``) is read from
    its file when it is copied.

    Example::

        loader = ShardLoader(units)
        loader.install(model)
        model.load_state_dict(pretrained)      # streamed into the shards, one unit at a time
        loader.remove()
    """

    def __init__(self, units: list[ShardedUnit]) -> None:
        self.units = units
        self._where = {id(p): (unit, i) for unit in units for i, p in enumerate(unit.params)}
        self._handles: list[Any] = []
        self._load: _Load | None = None

    def install(self, root: nn.Module) -> None:
        for module in root.modules():
            self._handles.append(module.register_load_state_dict_pre_hook(EngineHook(self._take_sharded)))
            self._handles.append(module.register_load_state_dict_post_hook(EngineHook(self._stream_into_shards)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _take_sharded(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *_args: Any, **_kwargs: Any
    ) -> None:
        """Pre-hook of every module: take the entries of this module's own sharded parameters (see the note)."""
        if not prefix:
            self._load = _Load(module)
        load = self._load
        if load is None:  # ``_load_from_state_dict`` called outside a load_state_dict: left to torch
            return
        for name, param in module._parameters.items():
            where = self._where.get(id(param)) if param is not None else None
            key = prefix + name
            if where is None or key not in state_dict:
                continue
            source = state_dict.pop(key)
            if tuple(source.shape) != tuple(param.shape):
                raise RuntimeError(
                    f"size mismatch for {key}: the state dict holds shape {tuple(source.shape)}, the model's "
                    f"parameter has shape {tuple(param.shape)}"
                )
            unit, index = where
            load.sources.setdefault(unit, {})[index] = source
            load.keys.add(key)

    def _stream_into_shards(self, module: nn.Module, incompatible: Any) -> None:
        """Post-hook of every module; on the one the load was called on, write what was taken into the shards."""
        load = self._load
        if load is None or module is not load.root:
            return
        self._load = None
        for unit in self.units:  # in unit order: the same collectives on every rank
            sources = load.sources.get(unit)
            if not sources:
                continue
            if len(sources) < len(unit.params):
                full = unit.full_flat()
            else:
                full = torch.zeros(unit.layout.padded_numel, dtype=unit.master_dtype, device=unit.device)
            for index, source in sources.items():
                offset, numel = unit.layout.offsets[index], unit.layout.numels[index]
                with torch.no_grad():  # ``source`` as an argument: a lazily loaded one is read by the copy
                    full[offset : offset + numel].view(tuple(source.shape)).copy_(source)
            unit.load_full_flat(full)
            del full
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in load.keys]


@dataclass
class _Load:
    """One ``load_state_dict`` call in progress (see [Note: loading into the shards])."""

    root: nn.Module
    sources: dict[ShardedUnit, dict[int, Any]] = field(default_factory=dict)  # unit -> parameter index -> value
    keys: set[str] = field(default_factory=set)


def full_optimizer_state_dict(optimizer: Optimizer, units: list[ShardedUnit], comm: Comm) -> dict[str, Any]:
    """``optimizer.state_dict()`` as if it had stepped full parameters (what DDP would save)."""
    state_dict = optimizer.state_dict()
    # state_dict() shares the per-parameter dicts with optimizer.state: copy before replacing entries.
    state_dict["state"] = {idx: dict(entry) for idx, entry in state_dict["state"].items()}
    index_of = {p: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    for unit in units:
        entries = [(index_of[p], i) for i, p in enumerate(unit.params) if p in index_of]
        keys = sorted(
            {
                key
                for idx, i in entries
                for key, value in state_dict["state"].get(idx, {}).items()
                if is_param_shaped(key, value, unit.shard_params[i])
            }
        )
        for key in keys:
            full = _gather_state(unit, entries, state_dict["state"], key, comm)
            for idx, i in entries:
                if key in state_dict["state"].get(idx, {}):
                    offset, numel = unit.layout.offsets[i], unit.layout.numels[i]
                    state_dict["state"][idx][key] = full[offset : offset + numel].view(unit.params[i].shape).clone()
    return state_dict


def _gather_state(unit: ShardedUnit, entries: list[tuple[int, int]], state: dict, key: str, comm: Comm) -> torch.Tensor:
    sample = next(state[idx][key] for idx, _ in entries if key in state.get(idx, {}))
    shard = torch.zeros(unit.layout.shard_numel, dtype=sample.dtype, device=unit.device)
    for idx, i in entries:
        value = state.get(idx, {}).get(key)
        if value is not None:
            piece = unit.param_shards[i]
            shard[piece.shard_offset : piece.shard_offset + piece.numel].copy_(value)
    full = torch.empty(unit.layout.padded_numel, dtype=sample.dtype, device=unit.device)
    comm.all_gather(full, shard, name=f"{unit.name} optimizer state {key!r}")
    return full


def load_full_optimizer_state_dict(
    optimizer: Optimizer,
    state_dict: dict[str, Any],
    param_of: dict[nn.Parameter, tuple[nn.Parameter, ParamShard]],
    on_shards: Callable[[], AbstractContextManager[None]],
) -> None:
    """Load a full (DDP-shaped) optimizer state dict into ``optimizer``'s shards. ``on_shards()`` is entered around
    ``optimizer.load_state_dict``, which casts each state to its parameter's dtype and device: the master's."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    sliced = {"param_groups": state_dict["param_groups"], "state": {}}
    for idx, entry in state_dict["state"].items():
        if not 0 <= int(idx) < len(params):
            raise ValueError(
                f"optimizer state has an entry for parameter {idx}, but the optimizer has "
                f"{len(params)} parameters: the checkpoint is from another model"
            )
        param, piece = param_of[params[int(idx)]]
        sliced["state"][idx] = {k: slice_state(k, v, param, piece) for k, v in entry.items()}
    with on_shards():
        optimizer.load_state_dict(sliced)
