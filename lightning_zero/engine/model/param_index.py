"""``ParamIndex``: each parameter's shard parameter, piece and unit, looked up from either side."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_zero.engine.core.layout import ParamShard
from lightning_zero.engine.core.unit import ShardedUnit


@dataclass(frozen=True)
class ParamIndex:
    """Lookups over a model's units: ``shard_of[param]`` is the shard parameter (the master piece the optimizer
    steps) and the piece of a module parameter; ``param_of`` and ``unit_of`` are keyed by both, since optimizers hold
    the module's parameters and the engine's own code the shard ones.

    Example::

        index = ParamIndex.of(sharded.units)
        shard_param, piece = index.shard_of[model.weight]
    """

    shard_of: dict[nn.Parameter, tuple[nn.Parameter, ParamShard]]
    param_of: dict[nn.Parameter, tuple[nn.Parameter, ParamShard]]
    unit_of: dict[nn.Parameter, ShardedUnit]

    @classmethod
    def of(cls, units: list[ShardedUnit]) -> ParamIndex:
        index = cls({}, {}, {})
        for unit in units:
            for param, shard_param, piece in zip(unit.params, unit.shard_params, unit.param_shards):
                index.shard_of[param] = (shard_param, piece)
                index.param_of[shard_param] = index.param_of[param] = (param, piece)
                index.unit_of[shard_param] = index.unit_of[param] = unit
        return index

    def name_of(self, shard_param: nn.Parameter) -> str:
        """The name a shard parameter's module parameter has in its unit."""
        unit = self.unit_of[shard_param]
        param, _ = self.param_of[shard_param]
        return next(name for p, name in zip(unit.params, unit.param_names) if p is param)
