"""``ShardedUnit``: the parameters that are gathered, reduced and stepped together.

[Note: unit memory]
A unit owns one flat buffer (see [Note: flat layout] in ``layout.py``) whose views *are* the
module's parameters (``param.data`` points into it, so tied references, ``module.weight`` and the
autograd graph keep working). It also owns ``shard``, this rank's slice of that buffer, and one
``shard_param`` per parameter: a 1-D ``nn.Parameter`` over the parameter's piece of the shard.
The user's optimizer steps the ``shard_params``; nothing else does.

- ``reshard_after_forward=False`` (stages 1 and 2): the flat buffer is always allocated, the
  shard is a view into it; after the optimizer step the shards are all-gathered in place.
- ``reshard_after_forward=True`` (stage 3): the shard has its own storage and the flat buffer's
  storage is resized to 0 bytes while the unit is ``SHARDED``; ``unshard()`` re-allocates it and
  all-gathers the shards into it. Resizing the storage (instead of swapping ``param.data``) keeps
  every reference autograd or the user holds valid. Writes go through ``flat``, which does not
  share the parameters' version counters, so tensors saved for backward stay usable.

Gradients are never kept here: ``reduce_grads`` packs the full gradients, reduce-scatters them
into a fresh shard-sized tensor that it returns, and drops the full gradients.
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from lightning_zero.engine.comm import Comm
from lightning_zero.engine.layout import ParamShard, ShardLayout


class UnitState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDED = "unsharded"


class ShardedUnit:
    """One group of parameters with its flat buffer and shard (see [Note: unit memory]).

    Example::

        unit = ShardedUnit("layer", layer, [layer.weight, layer.bias], ["weight", "bias"], comm,
                           reshard_after_forward=True)
        unit.unshard()            # all-gather: layer.weight is usable
        unit.reshard()            # free the gathered storage again
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        params: list[nn.Parameter],
        param_names: list[str],
        comm: Comm,
        reshard_after_forward: bool,
        sync_from_rank0: bool = True,
    ) -> None:
        check_unit_params(name, params, param_names)
        self.name = name
        self.module = module
        self.params = params
        self.param_names = param_names
        self.comm = comm
        self.reshard_after_forward = reshard_after_forward
        self.layout = ShardLayout.from_shapes([p.shape for p in params], comm.world_size)
        self.param_shards: list[ParamShard] = self.layout.param_shards(comm.rank)
        # Fixed at construction: gradient hooks and shard parameters are made for exactly these.
        self.trainable_indices = [i for i, p in enumerate(params) if p.requires_grad]
        self.frozen_indices = [i for i, p in enumerate(params) if not p.requires_grad]
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.flat = self._flatten_into_views()
        if sync_from_rank0:
            # Every rank starts from rank 0's values, as with DDP.
            comm.broadcast(self.flat, src=0)
        start, end = self.layout.shard_range(comm.rank)
        self.shard = self.flat[start:end].clone() if reshard_after_forward else self.flat[start:end]
        self.shard_params = [self._make_shard_param(p, piece) for p, piece in zip(params, self.param_shards)]
        self.state = UnitState.UNSHARDED
        self.reshard()

    # ------------------------------------------------------------------ construction
    def _flatten_into_views(self) -> torch.Tensor:
        flat = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for param, offset, numel in zip(self.params, self.layout.offsets, self.layout.numels):
                view = flat[offset : offset + numel].view(param.shape)
                view.copy_(param.detach())
                param.data = view
        return flat

    def _make_shard_param(self, param: nn.Parameter, piece: ParamShard) -> nn.Parameter:
        data = self.shard[piece.shard_offset : piece.shard_offset + piece.numel]
        return nn.Parameter(data, requires_grad=param.requires_grad)

    # ------------------------------------------------------------------ properties
    @property
    def is_unsharded(self) -> bool:
        return self.state is UnitState.UNSHARDED

    # ------------------------------------------------------------------ parameters
    def unshard(self) -> None:
        """Make the full parameters usable (idempotent; a no-op for stages 1 and 2)."""
        if self.state is UnitState.UNSHARDED:
            return
        storage = self.flat.untyped_storage()
        storage.resize_(self.layout.padded_numel * self.flat.element_size())
        with torch.no_grad():
            # Which unit is gathered when depends on the model's control flow: checked (see
            # [Note: collective checks] in comm.py).
            self.comm.all_gather(self.flat, self.shard, name=self.name, guard=True)
        self.state = UnitState.UNSHARDED

    def reshard(self) -> None:
        """Free the full parameters (idempotent; a no-op for stages 1 and 2)."""
        if not self.reshard_after_forward or self.state is UnitState.SHARDED:
            return
        self.flat.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED

    def gather_updated_shards(self) -> None:
        """After the optimizer stepped the shards: refresh the full parameters (stages 1 and 2),
        or the gathered copy if one is held (stage 3)."""
        if self.reshard_after_forward:
            if self.state is UnitState.UNSHARDED:
                with torch.no_grad():
                    self.comm.all_gather(self.flat, self.shard, name=self.name)
            return
        start, end = self.layout.shard_range(self.comm.rank)
        with torch.no_grad():
            self.comm.all_gather(self.flat, self.flat[start:end], name=self.name)

    def full_flat(self) -> torch.Tensor:
        """A full copy of the flat buffer, gathered if needed (for state dicts)."""
        if self.state is UnitState.UNSHARDED:
            return self.flat.detach().clone()
        full = torch.empty(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        self.comm.all_gather(full, self.shard, name=self.name)
        return full

    def load_full_flat(self, full: torch.Tensor) -> None:
        """Take this rank's shard (and, if allocated, the full buffer) from a full flat tensor."""
        start, end = self.layout.shard_range(self.comm.rank)
        with torch.no_grad():
            self.shard.copy_(full[start:end])
            if self.state is UnitState.UNSHARDED:
                self.flat.copy_(full)

    def release_without_peers(self) -> None:
        """After a failure other ranks may not share: make the parameters safe to touch without any
        collective. A sharded (stage-3) unit cannot be rebuilt alone, so its parameters become NaN,
        loud rather than silently wrong; reload them from a checkpoint."""
        if self.state is UnitState.SHARDED:
            self.flat.untyped_storage().resize_(self.layout.padded_numel * self.flat.element_size())
            with torch.no_grad():
                self.flat.fill_(float("nan"))
        with torch.no_grad():
            for param in self.params:
                param.data = param.data.clone()
        self.state = UnitState.UNSHARDED

    def release(self) -> None:
        """Give every parameter its own storage again (the module becomes a plain module)."""
        self.unshard()
        with torch.no_grad():
            for param in self.params:
                param.data = param.data.clone()

    # ------------------------------------------------------------------ gradients
    def reduce_grads(self) -> tuple[torch.Tensor, list[bool]]:
        """Reduce-scatter the mean of the full gradients; return (this rank's shard, which params had a
        gradient here). The full gradients are dropped."""
        flat_grad = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        had_grad = []
        for param, offset, numel in zip(self.params, self.layout.offsets, self.layout.numels):
            had_grad.append(param.grad is not None)
            if param.grad is not None:
                flat_grad[offset : offset + numel].copy_(param.grad.reshape(-1))
                param.grad = None
        # Divide before summing, as DDP does, so that two ranks give bit-identical results.
        if self.comm.world_size > 1:
            flat_grad.div_(self.comm.world_size)
        out = torch.empty(self.layout.shard_numel, dtype=self.dtype, device=self.device)
        self.comm.reduce_scatter(out, flat_grad, name=self.name)
        return out, had_grad

    # ------------------------------------------------------------------ accounting
    def persistent_param_bytes(self) -> int:
        """Bytes of parameters this unit holds while not in use."""
        elem = self.flat.element_size()
        full = 0 if self.reshard_after_forward else self.layout.padded_numel * elem
        own_shard = self.layout.shard_numel * elem if self.reshard_after_forward else 0
        return full + own_shard


def check_unit_params(name: str, params: list[nn.Parameter], names: list[str]) -> None:
    if not params:
        raise ValueError(f"unit {name!r} has no parameters")
    for param, pname in zip(params, names):
        if not param.is_floating_point():
            raise ValueError(
                f"parameter {pname!r} in unit {name!r} has dtype {param.dtype}; ZeRO shards floating-point "
                "parameters only. Register integer tensors as buffers (module.register_buffer) instead."
            )
        if param.dtype != params[0].dtype or param.device != params[0].device:
            raise ValueError(
                f"unit {name!r} mixes dtypes/devices: {names[0]!r} is {params[0].dtype} on {params[0].device}, "
                f"{pname!r} is {param.dtype} on {param.device}. Put them in separate units (unit_modules=...) "
                "or cast the module to one dtype and device before training."
            )
