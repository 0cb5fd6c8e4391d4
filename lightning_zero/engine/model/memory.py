"""The bytes of model state one rank holds now, by kind (``ShardedModel.memory_stats``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from lightning_zero.engine.core.unit import ShardedUnit


def memory_stats(units: list[ShardedUnit], optimizers: list[Optimizer]) -> dict[str, int]:
    """Bytes of model state this rank holds now: ``params`` (the persistent compute copy on the device),
    ``master_params`` (the master shard where it is kept apart: mixed precision, offload),
    ``gathered_params`` (stage 3, transient), ``grads`` (sharded gradients), ``optimizer_states`` and
    ``host_params`` (the compute shards in host memory under ``offload_params``, where they are tensors of
    their own; with the master's dtype the host shard is the master, counted once in ``master_params``).
    With ``offload_optimizer``, master shards, gradients and optimizer states are in CPU memory; with
    ``offload_params`` ``params`` is 0.

    Example::

        stats = memory_stats(sharded.units, sharded.optimizers)   # what ``sharded.memory_stats()`` returns
        device_bytes = stats["params"] + stats["gathered_params"]  # without offload add the other three
    """
    params = sum(u.persistent_param_bytes() for u in units)
    host = sum(u.host_param_bytes() for u in units)
    master = sum(u.master_bytes() for u in units)
    gathered = sum(
        u.layout.padded_numel * u.flat.element_size() for u in units if u.reshard_after_forward and u.is_unsharded
    )
    grads = _storage_bytes(p.grad for u in units for p in u.shard_params if p.grad is not None)
    states = _storage_bytes(
        v
        for opt in optimizers
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return {
        "params": params,
        "master_params": master,
        "gathered_params": gathered,
        "grads": grads,
        "optimizer_states": states,
        "host_params": host,
    }


def _storage_bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
