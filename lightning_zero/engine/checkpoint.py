"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), and their consolidation.

[Note: checkpoint layout]
Each parameter is saved under its name as a *flattened* 1-D tensor of ``param.numel()``
elements. A rank contributes exactly the piece its shard holds (see [Note: flat layout]), as a
DTensor whose local tensor is a ``LocalShardsWrapper`` that records the piece's offset; DCP writes
every rank's pieces in parallel and stores where each one lies. Loading asks, per parameter,
for the piece the *loading* rank's layout needs, so a checkpoint loads at any world size, under
any stage and with any unit policy: only names and shapes must match. Per-element optimizer
states (``exp_avg``, ...) are saved the same way under ``optim/<i>/<name>/<key>``; scalar states
(``step``) and buffers are plain replicated tensors. What is not a tensor (param groups, shapes,
the names of tied aliases, Lightning's loops and callbacks) goes into ``meta.pt``.

Saving moves shards only; nothing gathers a full parameter. Loading reads each rank's pieces
straight into its shards; under stages 1 and 2 one all-gather per unit then refreshes the full
parameters every rank keeps anyway.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.optim import Optimizer

from lightning_zero.engine.files import atomic_torch_save, replace_directory, temporary_path
from lightning_zero.engine.optimizer import is_param_shaped
from lightning_zero.engine.sharded_model import ShardedModel

FORMAT_VERSION = 1
META_FILE = "meta.pt"
MODEL_PREFIX = "model/"


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the model (names or shapes differ)."""


def _piece(local: torch.Tensor, offset: int, numel: int, mesh: DeviceMesh) -> DTensor:
    """A 1-D DTensor of ``numel`` elements of which this rank holds ``local`` at ``offset``."""
    wrapper = LocalShardsWrapper([local], [(offset,)])
    return DTensor.from_local(wrapper, mesh, [Shard(0)], run_check=False, shape=torch.Size([numel]), stride=(1,))


def _param_pieces(model: ShardedModel):
    for unit in model.units:
        for index, (param, piece) in enumerate(zip(unit.params, unit.param_shards)):
            yield unit, index, param, piece


def param_names(model: ShardedModel) -> dict[nn.Parameter, str]:
    return {param: unit.param_names[i] for unit, i, param, _ in _param_pieces(model)}


def _optim_key(index: int, name: str, key: str) -> str:
    return f"optim/{index}/{name}/{key}"


def sharded_model_state(model: ShardedModel, mesh: DeviceMesh) -> dict[str, Any]:
    """This rank's part of the model state, ready for ``dcp.save``: parameter pieces (views of the
    live shards, no copies) and the buffers."""
    state: dict[str, Any] = {}
    for unit, index, param, piece in _param_pieces(model):
        if piece.numel:
            view = unit.master[piece.shard_offset : piece.shard_offset + piece.numel]
            state[MODEL_PREFIX + unit.param_names[index]] = _piece(view, piece.param_offset, param.numel(), mesh)
    params = {id(p) for p in param_names(model)}
    for name, value in model.module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor) and id(value) not in params:
            state[MODEL_PREFIX + name] = value.detach()
    return state


def sharded_optimizer_state(model: ShardedModel, optimizer: Optimizer, index: int, mesh: DeviceMesh) -> dict[str, Any]:
    """This rank's part of ``optimizer``'s state, ready for ``dcp.save``."""
    names = param_names(model)
    state: dict[str, Any] = {}
    for held, entry in optimizer.state.items():  # keyed by the module's parameters
        param, piece = model._param_of[held]
        shard_param = model._shard_of[param][0]
        for key, value in entry.items():
            if is_param_shaped(key, value, shard_param):
                if piece.numel:
                    state[_optim_key(index, names[param], key)] = _piece(value, piece.param_offset, param.numel(), mesh)
            elif isinstance(value, torch.Tensor):
                state[_optim_key(index, names[param], key)] = value
    return state


def checkpoint_meta(model: ShardedModel, optimizers: list[Optimizer]) -> dict[str, Any]:
    """What a sharded checkpoint needs besides tensors: shapes, tied aliases, optimizer structure."""
    names = param_names(model)
    full_keys = list(model.module.state_dict(keep_vars=True))
    aliases = {}
    state = model.module.state_dict(keep_vars=True)
    by_id = {id(p): n for p, n in names.items()}
    for key in full_keys:
        value = state[key]
        if isinstance(value, nn.Parameter) and by_id.get(id(value), key) != key:
            aliases[key] = by_id[id(value)]
    extra = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    optim_meta = []
    for optimizer in optimizers:
        groups = []
        for group in optimizer.param_groups:
            entry = {k: v for k, v in group.items() if k != "params"}
            entry["params"] = [names[model._param_of[p][0]] for p in group["params"]]
            groups.append(entry)
        optim_meta.append({"param_groups": groups})
    return {
        "format_version": FORMAT_VERSION,
        "params": {name: list(param.shape) for param, name in names.items()},
        "aliases": aliases,
        "state_dict_keys": full_keys,
        "extra_state": extra,
        "optimizers": optim_meta,
    }


class CorruptCheckpointError(RuntimeError):
    """A checkpoint's files are missing, truncated or not what a checkpoint holds; nothing was loaded."""


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: rebuild only the plain records it is made of, never other code."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module == "torch.distributed.checkpoint.metadata"
            or (module, name) in _ALLOWED_CLASSES
            or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)))
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"the checkpoint's metadata asks for {module}.{name}, which checkpoint metadata never needs; "
                "refusing to run it (the file may be tampered with)"
            )
        return super().find_class(module, name)


_ALLOWED_CLASSES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with the metadata read by ``_MetadataUnpickler`` and the files it points to
    checked before anything is loaded: plain file names inside the directory, present, long enough."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
        except FileNotFoundError as err:
            raise CorruptCheckpointError(
                f"{str(self.path)!r} has no {Path(path).name}: not a complete checkpoint"
            ) from err
        except (EOFError, pickle.UnpicklingError, AttributeError, ValueError) as err:
            raise CorruptCheckpointError(f"{str(path)!r} is damaged or not checkpoint metadata: {err}") from err
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        _check_files(Path(self.path), metadata)
        return metadata


def _check_files(directory: Path, metadata: Metadata) -> None:
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        if not name or Path(name).name != name or name in (".", ".."):
            raise CorruptCheckpointError(
                f"the checkpoint in {str(directory)!r} points to {name!r}, outside its directory: refusing to read it"
            )
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, size in needed.items():
        file = directory / name
        if not file.is_file():
            raise CorruptCheckpointError(f"{str(file)!r} is missing: the checkpoint is incomplete")
        if file.stat().st_size < size:
            raise CorruptCheckpointError(
                f"{str(file)!r} is truncated ({file.stat().st_size} bytes, {size} needed): the checkpoint is incomplete"
            )


def _tensor_keys_only(keys: Any, saved: dict[str, Any]) -> None:
    """Refuse to read a requested entry that the metadata describes as pickled bytes (DCP would unpickle it)."""
    for key in keys:
        if key in saved and not isinstance(saved[key], TensorStorageMetadata):
            raise CorruptCheckpointError(f"checkpoint entry {key!r} should be a tensor but is stored as pickled bytes")


def save_sharded(state: dict[str, Any], directory: Path) -> None:
    """Every rank writes its pieces of ``state`` into ``directory`` (a collective)."""
    dcp.save(state, storage_writer=dcp.FileSystemWriter(directory))


def write_checkpoint_directory(
    shards: dict[str, Any],
    meta: dict[str, Any],
    path: Path,
    token: str,
    is_global_zero: bool,
    barrier: Callable[[str], None],
) -> None:
    """Write a sharded checkpoint directory at ``path`` atomically (a collective: call on every rank).

    Every rank writes its ``shards`` (``sharded_model_state`` / ``sharded_optimizer_state``) into a
    temporary directory named after ``token`` (the same string on every rank); rank 0 adds ``meta``
    as ``meta.pt`` and, once all ranks are done, puts the directory in place of ``path``. Used by the
    Trainer strategies and the Fabric strategies alike, so both write the same layout.
    """
    tmp = temporary_path(path, token)
    save_sharded(shards, tmp)
    if is_global_zero:
        atomic_torch_save(meta, tmp / META_FILE)
    barrier("lightning_zero.save")
    if is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_directory(tmp, path)
    barrier("lightning_zero.commit")


def load_sharded(
    model: ShardedModel,
    optimizers: list[Optimizer],
    directory: Path,
    zero_meta: dict[str, Any],
    mesh: DeviceMesh,
    strict: bool = True,
) -> None:
    """Load a sharded checkpoint into ``model``'s shards and ``optimizers`` (a collective), whatever
    world size, stage or unit policy wrote it."""
    reader = SafeFileSystemReader(directory)
    saved = reader.read_metadata().state_dict_metadata
    _check_names(model, zero_meta, saved, strict)
    target = {k: v for k, v in sharded_model_state(model, mesh).items() if k in saved}
    optimizer_targets: list[dict[str, Any]] = []
    for index, optimizer in enumerate(optimizers):
        wanted = _optimizer_target(model, optimizer, index, saved, mesh)
        optimizer_targets.append(wanted)
        target.update({k: v for k, (v, _) in wanted.items() if v is not None})
    _tensor_keys_only(target, saved)
    dcp.load(target, storage_reader=reader)
    for unit in model.units:
        unit.gather_updated_shards()
    if zero_meta["extra_state"]:  # modules' get_extra_state(): restored through their set_extra_state()
        model.module.load_state_dict(zero_meta["extra_state"], strict=False)
    for index, (optimizer, wanted) in enumerate(zip(optimizers, optimizer_targets)):
        _install_optimizer_state(model, optimizer, wanted, zero_meta["optimizers"][index])


def _check_names(model: ShardedModel, zero_meta: dict[str, Any], saved: dict[str, Any], strict: bool) -> None:
    expected = {name: list(p.shape) for p, name in param_names(model).items()}
    stored = zero_meta["params"]
    params = {id(p) for p in param_names(model)}
    buffers = [
        name
        for name, value in model.module.state_dict(keep_vars=True).items()
        if isinstance(value, torch.Tensor) and id(value) not in params
    ]
    missing = sorted(set(expected) - set(stored)) + [b for b in buffers if MODEL_PREFIX + b not in saved]
    unexpected = sorted(set(stored) - set(expected))
    wrong = sorted(n for n in set(expected) & set(stored) if expected[n] != list(stored[n]))
    if wrong or (strict and (missing or unexpected)):
        lines = []
        if missing:
            lines.append(f"missing from the checkpoint: {', '.join(missing[:10])}")
        if unexpected:
            lines.append(f"in the checkpoint but not in the model: {', '.join(unexpected[:10])}")
        if wrong:
            lines.append(
                "different shapes: "
                + ", ".join(f"{n} {tuple(stored[n])} in the checkpoint vs {tuple(expected[n])}" for n in wrong[:10])
            )
        raise CheckpointMismatchError(
            "the checkpoint was written for another model: " + "; ".join(lines) + ". Load it into the model that "
            "wrote it, or load weights only with strict=False where names differ on purpose."
        )


def _optimizer_target(
    model: ShardedModel, optimizer: Optimizer, index: int, saved: dict[str, Any], mesh: DeviceMesh
) -> dict[str, tuple[Any, tuple[nn.Parameter, str]]]:
    """Freshly allocated tensors for every saved state entry of ``optimizer``'s parameters on this rank."""
    names = param_names(model)
    prefix = f"optim/{index}/"
    wanted: dict[str, tuple[Any, tuple[nn.Parameter, str]]] = {}
    for group in optimizer.param_groups:
        for held in group["params"]:
            param, piece = model._param_of[held]
            shard_param = model._shard_of[param][0]
            name = names[param]
            head = f"{prefix}{name}/"
            for key, meta in saved.items():
                if not key.startswith(head) or not isinstance(meta, TensorStorageMetadata):
                    continue
                state_key = key[len(head) :]
                dtype = meta.properties.dtype
                if list(meta.size) == [param.numel()] and (param.dim() > 0 or state_key != "step"):
                    local = torch.zeros(piece.numel, dtype=dtype, device=shard_param.device)
                    value: Any = _piece(local, piece.param_offset, param.numel(), mesh) if piece.numel else local
                    wanted[key] = (value, (held, state_key)) if piece.numel else (None, (held, state_key))
                else:
                    wanted[key] = (torch.zeros(meta.size, dtype=dtype), (held, state_key))
    return {k: v for k, v in wanted.items()}


def _install_optimizer_state(
    model: ShardedModel, optimizer: Optimizer, wanted: dict[str, tuple[Any, tuple[nn.Parameter, str]]], meta: dict
) -> None:
    names = param_names(model)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    index_of = {names[model._param_of[p][0]]: i for i, p in enumerate(params)}
    position = {id(p): i for i, p in enumerate(params)}
    state: dict[int, dict[str, Any]] = {}
    for value, (held, key) in wanted.values():
        if value is None:  # an empty piece on this rank
            shard_param = model._shard_of[model._param_of[held][0]][0]
            value = torch.zeros(0, dtype=shard_param.dtype, device=shard_param.device)
        elif isinstance(value, DTensor):
            value = value.to_local().local_shards()[0]
        state.setdefault(position[id(held)], {})[key] = value
    groups = []
    if len(meta["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointMismatchError(
            f"the checkpoint's optimizer has {len(meta['param_groups'])} param groups, "
            f"{type(optimizer).__name__} has {len(optimizer.param_groups)}: configure_optimizers changed"
        )
    for saved_group, group in zip(meta["param_groups"], optimizer.param_groups):
        if sorted(saved_group["params"]) != sorted(names[model._param_of[p][0]] for p in group["params"]):
            raise CheckpointMismatchError("a param group of the checkpoint holds other parameters than the optimizer's")
        groups.append({**saved_group, "params": [index_of[n] for n in saved_group["params"]]})
    with model.on_shards(optimizer):  # load_state_dict casts states to each parameter's dtype and device
        optimizer.load_state_dict({"state": state, "param_groups": groups})


def consolidate_state(directory: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """The full, DDP-shaped checkpoint of a sharded one, on one process (no process group, no GPU).

    ``meta`` is the content of ``meta.pt``; the result adds ``state_dict`` and ``optimizer_states``
    as ``DDPStrategy`` would have saved them.
    """
    if "lightning_zero" not in meta:
        raise CorruptCheckpointError(
            f"{str(directory)!r} is a sharded checkpoint written by another tool (its {META_FILE} has no "
            "lightning_zero section); convert it to a full checkpoint with that tool first"
        )
    zero_meta = meta["lightning_zero"]
    saved = SafeFileSystemReader(directory).read_metadata().state_dict_metadata
    full = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in saved.items()
        if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(full, storage_reader=SafeFileSystemReader(directory), no_dist=True)
    shapes = zero_meta["params"]
    state_dict: dict[str, Any] = {}
    for key in zero_meta["state_dict_keys"]:
        name = zero_meta["aliases"].get(key, key)
        if name in shapes:
            state_dict[key] = full[MODEL_PREFIX + name].view(shapes[name])
        elif key in zero_meta["extra_state"]:
            state_dict[key] = zero_meta["extra_state"][key]
        else:
            state_dict[key] = full[MODEL_PREFIX + key]
    optimizer_states = []
    for index, optim_meta in enumerate(zero_meta["optimizers"]):
        order = [n for g in optim_meta["param_groups"] for n in g["params"]]
        state: dict[int, dict[str, Any]] = {}
        for position, name in enumerate(order):
            head = f"optim/{index}/{name}/"
            for key in (k for k in full if k.startswith(head)):
                value = full[key]
                state_key = key[len(head) :]
                per_element = value.dim() == 1 and value.numel() == math.prod(shapes[name])
                if per_element and (len(shapes[name]) > 0 or state_key != "step"):
                    value = value.view(shapes[name])
                state.setdefault(position, {})[state_key] = value
        groups, start = [], 0
        for group in optim_meta["param_groups"]:
            groups.append({**group, "params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        optimizer_states.append({"state": state, "param_groups": groups})
    checkpoint = {k: v for k, v in meta.items() if k != "lightning_zero"}
    checkpoint["state_dict"] = state_dict
    if "optimizer_states" in meta or zero_meta["optimizers"]:
        checkpoint["optimizer_states"] = optimizer_states
    return checkpoint
