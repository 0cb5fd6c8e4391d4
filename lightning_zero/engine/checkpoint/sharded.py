"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): the directory, its save, check and load, and
its consolidation. What each rank writes into it is ``pieces.py``'s ([Note: checkpoint layout]).

[Note: sharded layout]
A sharded checkpoint (format 2) is a directory holding ``meta.pt`` and one ``shards-<token>``
subdirectory with DCP's files (``.metadata``, ``__<rank>_0.distcp``). ``<token>`` is the save's
identity, chosen by rank 0 and written three times: in the subdirectory's name, in ``meta.pt``
(``lightning_zero.save_id``) and, as a small tensor ``lightning_zero/save/<rank>``, into every rank's
``.distcp`` file. ``meta.pt`` is the commit record: a save writes a new subdirectory, then replaces
``meta.pt`` (one atomic rename), then deletes the other subdirectories (see [Note: crash-safe saves]
in ``engine/io/files.py``). A loader reads only the subdirectory ``meta.pt`` names and refuses any file
whose identity differs (a shard copied from another save or run). Format 1 (DCP's files directly in
the directory, no identity) still loads, with a warning.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_zero.engine.checkpoint.pieces import (
    FORMAT_VERSION,
    MODEL_PREFIX,
    dtensor_piece,
    param_names,
    sharded_model_state,
)
from lightning_zero.engine.errors import CheckpointMismatchError
from lightning_zero.engine.io.checksums import StoredEntry, entry_checksums, share_by_size
from lightning_zero.engine.io.safe_read import SAVE_ID_PREFIX, CorruptCheckpointError, SafeFileSystemReader
from lightning_zero.engine.sharded_model import ShardedModel

META_FILE = "meta.pt"
SHARDS_PREFIX = "shards-"
METADATA_FILE = ".metadata"  # DCP's index of the shards, in the shards directory
CHECKSUMS_KEY = "checksums"  # in meta.pt's lightning_zero section: see [Note: shard checksums]


class WrittenShards(NamedTuple):
    """What the ranks of a sharded save wrote into its ``shards-<token>`` directory: the checksum of each stored
    entry (see [Note: shard checksums] in ``engine/io/checksums.py``) and the size of each file, by name (checked
    before the commit: see [Note: complete commits] in ``engine/io/files.py``)."""

    checksums: dict[str, int]
    sizes: dict[str, int]


def save_sharded(state: dict[str, Any], directory: Path, save_id: str, rank: int, group: Any = None) -> WrittenShards:
    """Every rank writes its pieces of ``state``, and the save's identity, into ``directory`` (a collective over
    ``group``, the default group if ``None``); what this rank wrote."""
    identity = torch.tensor(list(save_id.encode()), dtype=torch.uint8)
    metadata = dcp.save(
        {**state, f"{SAVE_ID_PREFIX}{rank}": identity},
        storage_writer=dcp.FileSystemWriter(directory),
        process_group=group,
    )
    mine = [entry for entry in stored_entries(metadata) if entry.file.startswith(f"__{rank}_")]
    files = {entry.file for entry in mine}
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank(group) == 0:
        files.add(METADATA_FILE)  # written by DCP's coordinator, rank 0 of the group
    return WrittenShards(entry_checksums(directory, mine), {file: (directory / file).stat().st_size for file in files})


def stored_entries(metadata: Metadata) -> list[StoredEntry]:
    """Every stored piece of a DCP checkpoint, from its metadata."""
    return [
        StoredEntry(index.fqn, str(info.relative_path), int(info.offset), int(info.length))
        for index, info in metadata.storage_data.items()
    ]


def check_shards(
    directory: Path, metadata: Metadata, zero_meta: dict[str, Any], rank: int = 0, world_size: int = 1
) -> str | None:
    """This rank's share of the check of a sharded checkpoint's pieces against the checksums ``meta.pt`` holds
    (all of them with the defaults): what is wrong, or ``None``. The ranks must then agree on the verdict."""
    stored = zero_meta.get(CHECKSUMS_KEY)
    if stored is None:
        if rank == 0 and zero_meta.get("format_version") == FORMAT_VERSION:
            warnings.warn(
                f"{str(directory)!r} was written by an older lightning_zero, which stored no checksums of its "
                "pieces: their bytes cannot be checked (save it again to add them)",
                stacklevel=3,
            )
        return None
    if not isinstance(stored, dict):
        return f"the meta.pt of {str(directory.parent)!r} is damaged (its checksum table is not a table)"
    entries = stored_entries(metadata)
    mine = share_by_size(entries, lambda e: e.length, lambda e: e.key, rank, world_size)
    try:
        found = entry_checksums(directory, mine)
    except OSError as err:
        return f"{str(directory)!r} could not be read: {err}"
    for entry in mine:
        if stored.get(entry.key) != found[entry.key]:
            return (
                f"{str(directory / entry.file)!r} is corrupted: the bytes of its piece of {entry.fqn!r} (at byte "
                f"{entry.offset}) do not match the checksum meta.pt stores for them (a damaged disk, a partial copy or "
                "an edited file); nothing was loaded. Load an intact copy or an earlier checkpoint."
            )
    return None


def _check_shards_together(directory: Path, metadata: Metadata, zero_meta: dict[str, Any]) -> None:
    """``check_shards`` with the checks shared by every rank of the default process group; every rank raises the
    same ``CorruptCheckpointError`` if any share failed."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        problems: list[Any] = [None] * dist.get_world_size()
        mine = check_shards(directory, metadata, zero_meta, dist.get_rank(), dist.get_world_size())
        dist.all_gather_object(problems, mine)
    else:
        problems = [check_shards(directory, metadata, zero_meta)]
    found = [p for p in problems if p]
    if found:
        raise CorruptCheckpointError(found[0])


def shard_directory(path: Path, zero_meta: dict[str, Any]) -> tuple[Path, str | None]:
    """The directory holding DCP's files of the checkpoint at ``path``, and the save's identity."""
    version = zero_meta.get("format_version")
    if version == 1:
        warnings.warn(
            f"{str(path)!r} was written by an older lightning_zero (checkpoint format 1), which records no "
            "save identity: its shard files cannot be checked to belong together",
            stacklevel=3,
        )
        return path, None
    if version != FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{str(path)!r} has checkpoint format {version!r}; this lightning_zero reads formats 1 and "
            f"{FORMAT_VERSION}: upgrade lightning_zero"
        )
    save_id = str(zero_meta.get("save_id", ""))
    if not save_id.isalnum():
        raise CorruptCheckpointError(f"the meta.pt of {str(path)!r} names no valid save identity")
    shards = path / f"{SHARDS_PREFIX}{save_id}"
    if shards.is_symlink() or not shards.is_dir():
        raise CorruptCheckpointError(
            f"{str(shards)!r}, which {str(path / META_FILE)!r} names, is missing or not a directory: "
            "the checkpoint is incomplete"
        )
    return shards, save_id


def _dcp_load(state: dict[str, Any], reader: SafeFileSystemReader, **kwargs: Any) -> None:
    try:
        with warnings.catch_warnings():
            if kwargs.get("no_dist"):  # one process on purpose (consolidation): DCP warns even when told so
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=reader, **kwargs)
    except CheckpointException as err:
        raise CorruptCheckpointError(f"{str(reader.path)!r} could not be read, nothing was loaded: {err}") from err


def gather_to_zero(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value`` on rank 0 of ``group`` (every rank, in order; the default group if ``None``), an empty
    list elsewhere (a collective): for what only rank 0 writes, such as checksums, which need not travel to every
    rank."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1):
        return [value]
    everyone: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(value, everyone, dst=0, group=group)
    return everyone or []


def gather_written(mine: WrittenShards, group: Any = None) -> WrittenShards:
    """What every rank wrote, joined on rank 0 (empty tables elsewhere; a collective over ``group``)."""
    every_rank = gather_to_zero(mine, group)
    return WrittenShards(
        {key: crc for written in every_rank for key, crc in written.checksums.items()},
        {file: size for written in every_rank for file, size in written.sizes.items()},
    )


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
    shards, save_id = shard_directory(directory, zero_meta)
    reader = SafeFileSystemReader(shards, save_id)
    metadata = reader.read_metadata()
    _check_shards_together(shards, metadata, zero_meta)
    saved = metadata.state_dict_metadata
    _check_names(model, zero_meta, saved, strict)
    target = {k: v for k, v in sharded_model_state(model, mesh, loading=True).items() if k in saved}
    optimizer_targets: list[dict[str, Any]] = []
    for index, optimizer in enumerate(optimizers):
        wanted = _optimizer_target(model, optimizer, index, saved, mesh)
        optimizer_targets.append(wanted)
        target.update({k: v for k, (v, _) in wanted.items() if v is not None})
    model.wait_for_parameters()  # a post-step gather in flight reads the masters the load writes
    for unit in model.units:  # the load writes the masters: offloaded shards among them (see unit.py)
        unit.wait_host_reads()
    _dcp_load(target, reader)
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
                    value: Any = dtensor_piece(local, piece.param_offset, param.numel(), mesh) if piece.numel else local
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
    as ``DDPStrategy`` would have saved them, or, for a directory ``fabric.save`` wrote, the model and optimizer
    states under the keys of the state it was given, as Fabric's ``DDPStrategy`` writes them (LitGPT's
    ``lit_model.pth`` keeps its model under ``model``).
    """
    if "lightning_zero" not in meta:
        raise CorruptCheckpointError(
            f"{str(directory)!r} is a sharded checkpoint written by another tool (its {META_FILE} has no "
            "lightning_zero section); convert it to a full checkpoint with that tool first"
        )
    zero_meta = meta["lightning_zero"]
    shards, save_id = shard_directory(directory, zero_meta)
    reader = SafeFileSystemReader(shards, save_id)
    metadata = reader.read_metadata()  # checked: every size is backed by stored bytes
    problem = check_shards(shards, metadata, zero_meta)
    if problem is not None:
        raise CorruptCheckpointError(problem)
    saved = metadata.state_dict_metadata
    full = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in saved.items()
        if isinstance(m, TensorStorageMetadata) and not k.startswith(SAVE_ID_PREFIX)
    }
    _dcp_load(full, reader, no_dist=True)
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
    fabric = zero_meta.get("fabric")
    if fabric is not None:  # written by fabric.save: the user's keys, as its checkpoint_format="full" writes them
        checkpoint.pop("pytorch-lightning_version", None)  # added for a Trainer reading the directory
        return {fabric["module"]: state_dict, **dict(zip(fabric["optimizers"], optimizer_states)), **checkpoint}
    checkpoint["state_dict"] = state_dict
    if "optimizer_states" in meta or zero_meta["optimizers"]:
        checkpoint["optimizer_states"] = optimizer_states
    return checkpoint
