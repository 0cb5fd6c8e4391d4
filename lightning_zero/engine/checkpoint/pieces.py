"""What each rank contributes to a checkpoint: its pieces of every parameter and optimizer state, and the meta.

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

The same pieces, described as ``FlatPiece``s with the full shapes instead of DTensors, make the
default ``"full"`` format (one ordinary ``torch.save`` file, written by all ranks in parallel, see
[Note: parallel full file] in ``engine/io/torch_file.py``); the sharded directory they are saved into is
``sharded.py``'s ([Note: sharded layout]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.optim import Optimizer

from lightning_zero.engine.core.optimizer import is_param_shaped
from lightning_zero.engine.io.torch_file import FlatPiece
from lightning_zero.engine.sharded_model import ShardedModel

FORMAT_VERSION = 2  # of the sharded checkpoint (see [Note: sharded layout] in ``sharded.py``), written in meta.pt
MODEL_PREFIX = "model/"


def dtensor_piece(local: torch.Tensor, offset: int, numel: int, mesh: DeviceMesh) -> DTensor:
    """A 1-D DTensor of ``numel`` elements of which this rank holds ``local`` at ``offset``."""
    wrapper = LocalShardsWrapper([local], [(offset,)])
    return DTensor.from_local(wrapper, mesh, [Shard(0)], run_check=False, shape=torch.Size([numel]), stride=(1,))


def _param_pieces(model: ShardedModel):
    for unit in model.units:
        for index, (param, piece) in enumerate(zip(unit.params, unit.param_shards)):
            yield unit, index, param, piece


def param_names(model: ShardedModel) -> dict[nn.Parameter, str]:
    """Each parameter of ``model``'s units and the name it is saved under (its unit's name for it)."""
    return {param: unit.param_names[i] for unit, i, param, _ in _param_pieces(model)}


def _optim_key(index: int, name: str, key: str) -> str:
    return f"optim/{index}/{name}/{key}"


def writes_pieces(model: ShardedModel) -> bool:
    """Whether this rank writes its pieces of the sharded state. Under hybrid sharding the replicate groups hold the
    same pieces, so only the first shard group writes them, each once (see [Note: hybrid sharding] in ``mesh.py``);
    loading asks for the pieces of the loading rank's layout, whatever layout and world size wrote them."""
    return model.replicate_comm is None or model.replicate_comm.rank == 0


def sharded_model_state(model: ShardedModel, mesh: DeviceMesh, loading: bool = False) -> dict[str, Any]:
    """This rank's part of the model state, ready for ``dcp.save``: parameter pieces (views of the
    live shards, no copies; none on a replica, see ``writes_pieces``) and the buffers. ``loading``: the
    pieces this rank's layout reads, replica or not."""
    state: dict[str, Any] = {}
    writes = loading or writes_pieces(model)
    for unit, index, param, piece in _param_pieces(model):
        if piece.numel and writes:
            view = unit.master[piece.shard_offset : piece.shard_offset + piece.numel]
            state[MODEL_PREFIX + unit.param_names[index]] = dtensor_piece(view, piece.param_offset, param.numel(), mesh)
    params = {id(p) for p in param_names(model)}
    for name, value in model.module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor) and id(value) not in params:
            state[MODEL_PREFIX + name] = value.detach()
    return state


def sharded_optimizer_state(model: ShardedModel, optimizer: Optimizer, index: int, mesh: DeviceMesh) -> dict[str, Any]:
    """This rank's part of ``optimizer``'s state, ready for ``dcp.save`` (no pieces on a replica, see
    ``writes_pieces``)."""
    model.units_of(optimizer)  # a clear error for a param group added after setup
    names = param_names(model)
    writes = writes_pieces(model)
    state: dict[str, Any] = {}
    for held, entry in optimizer.state.items():  # keyed by the module's parameters
        param, piece = model._param_of[held]
        shard_param = model._shard_of[param][0]
        for key, value in entry.items():
            if is_param_shaped(key, value, shard_param):
                if piece.numel and writes:
                    state[_optim_key(index, names[param], key)] = dtensor_piece(
                        value, piece.param_offset, param.numel(), mesh
                    )
            elif isinstance(value, torch.Tensor):
                state[_optim_key(index, names[param], key)] = value
    return state


def piece_state_dict(model: ShardedModel) -> dict[str, Any]:
    """``model.module.state_dict()`` as DDP returns it (same keys, order and tied names), with each parameter
    as this rank's ``FlatPiece`` of it (views of the live shards, the same piece under every tied name; empty on
    a replica, see ``writes_pieces``)."""
    pieces = {}
    numel_of = _piece_numel(model)
    for unit, index, param, piece in _param_pieces(model):
        local = unit.master[piece.shard_offset : piece.shard_offset + numel_of(piece.numel)]
        key = MODEL_PREFIX + unit.param_names[index]
        pieces[id(param)] = FlatPiece(key, param.shape, local.dtype, local, piece.param_offset)
    state = model.module.state_dict(keep_vars=True)
    result = state.copy()
    if hasattr(state, "_metadata"):  # module versions, which load_state_dict reads (as DDP saves them)
        result._metadata = state._metadata  # type: ignore[attr-defined]
    for key, value in state.items():
        if id(value) in pieces:
            result[key] = pieces[id(value)]
        elif isinstance(value, torch.Tensor):
            result[key] = value.detach()
    return result


def piece_optimizer_state(model: ShardedModel, optimizer: Optimizer, index: int) -> dict[str, Any]:
    """``optimizer.state_dict()`` as DDP saves it (per-parameter state, the saved ``param_groups``), with each
    per-element entry as this rank's ``FlatPiece`` of the full-shaped tensor."""
    model.units_of(optimizer)  # a clear error for a param group added after setup
    state_dict = optimizer.state_dict()
    # state_dict() shares the per-parameter dicts with optimizer.state: copy before replacing entries.
    state_dict["state"] = {idx: dict(entry) for idx, entry in state_dict["state"].items()}
    held = [p for group in optimizer.param_groups for p in group["params"]]  # the module's parameters
    numel_of = _piece_numel(model)
    for idx, entry in state_dict["state"].items():
        param, piece = model._param_of[held[idx]]
        shard_param = model._shard_of[param][0]  # shaped like this rank's piece, as the state is
        for key, value in entry.items():
            if is_param_shaped(key, value, shard_param):
                name = f"optim/{index}/{idx}/{key}"
                local = value[: numel_of(value.numel())]
                entry[key] = FlatPiece(name, param.shape, value.dtype, local, piece.param_offset)
    return state_dict


def _piece_numel(model: ShardedModel) -> Callable[[int], int]:
    """How many of a piece's elements this rank writes: all of them, or none on a replica (``writes_pieces``)."""
    writes = writes_pieces(model)
    return lambda numel: numel if writes else 0


def checkpoint_meta(model: ShardedModel, optimizers: list[Optimizer]) -> dict[str, Any]:
    """What a sharded checkpoint needs besides tensors: shapes, tied aliases, optimizer structure."""
    names = param_names(model)
    return _meta(model.module, names, optimizers, lambda held: model._param_of[held][0])


def _meta(
    module: nn.Module,
    names: dict[nn.Parameter, str],
    optimizers: list[Optimizer],
    param_of: Callable[[nn.Parameter], nn.Parameter],
) -> dict[str, Any]:
    """``checkpoint_meta`` of ``module`` whose parameters are saved under ``names``; ``param_of``: the parameter an
    optimizer's entry stands for."""
    state = module.state_dict(keep_vars=True)
    by_id = {id(p): n for p, n in names.items()}
    aliases = {
        key: by_id[id(value)]
        for key, value in state.items()
        if isinstance(value, nn.Parameter) and by_id.get(id(value), key) != key
    }
    extra = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    optim_meta = []
    for optimizer in optimizers:
        groups = []
        for group in optimizer.param_groups:
            entry = {k: v for k, v in group.items() if k != "params"}
            entry["params"] = [names[param_of(p)] for p in group["params"]]
            groups.append(entry)
        optim_meta.append({"param_groups": groups})
    return {
        "format_version": FORMAT_VERSION,
        "params": {name: list(param.shape) for param, name in names.items()},
        "aliases": aliases,
        "state_dict_keys": list(state),
        "extra_state": extra,
        "optimizers": optim_meta,
    }


def plain_module_checkpoint(
    module: nn.Module, optimizers: list[Optimizer], checkpoint: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A sharded checkpoint's tensors and meta for a module that is whole again (after ``fit``): each parameter,
    flattened, under its first name, each per-element optimizer state the same way, as the layout of [Note:
    checkpoint layout] stores them. Every rank holds the same values, and DCP writes each once. ``checkpoint`` is
    Lightning's dict; the result replaces its ``state_dict`` and ``optimizer_states``."""
    names: dict[nn.Parameter, str] = {}
    for name, param in module.named_parameters():
        names.setdefault(param, name)
    model_state: dict[str, Any] = {MODEL_PREFIX + n: p.detach().reshape(-1) for p, n in names.items()}
    for key, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
            model_state[MODEL_PREFIX + key] = value.detach()
    optimizer_states = []
    for index, optimizer in enumerate(optimizers):
        entries: dict[str, Any] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                for key, value in optimizer.state.get(param, {}).items():
                    if is_param_shaped(key, value, param):
                        entries[_optim_key(index, names[param], key)] = value.detach().reshape(-1)
                    elif isinstance(value, torch.Tensor):
                        entries[_optim_key(index, names[param], key)] = value
        optimizer_states.append(entries)
    converted = {**checkpoint, "state_dict": model_state}
    if "optimizer_states" in checkpoint:
        converted["optimizer_states"] = optimizer_states
    return converted, _meta(module, names, optimizers, lambda held: held)
