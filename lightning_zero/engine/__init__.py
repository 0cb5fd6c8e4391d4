"""The sharding engine: pure torch and torch.distributed, no Lightning.

See ``sharded_model.ShardedModel`` (or ``shard_model``) for the entry point, ``core/policy.py`` for its options and
``layout.py`` for the vocabulary.
"""

from lightning_zero.engine.comm.comm import Comm
from lightning_zero.engine.comm.stats import CommStats
from lightning_zero.engine.core.grouping import default_unit_policy, module_class_policy, owns_parameters, plan_units
from lightning_zero.engine.core.layout import ParamShard, ShardLayout, ShardRange
from lightning_zero.engine.core.optimizer import UnsupportedOptimizerError, check_elementwise
from lightning_zero.engine.core.policy import EnginePolicy, Offload
from lightning_zero.engine.core.unit import ShardedUnit
from lightning_zero.engine.core.unit_state import UnitPhase, UnitState
from lightning_zero.engine.errors import CollectiveMismatchError
from lightning_zero.engine.meta.init_trace import MetaInitError, record_meta_init
from lightning_zero.engine.sharded_model import ShardedModel, shard_model

__all__ = [
    "CollectiveMismatchError",
    "Comm",
    "CommStats",
    "EnginePolicy",
    "MetaInitError",
    "Offload",
    "ParamShard",
    "ShardLayout",
    "ShardRange",
    "ShardedModel",
    "ShardedUnit",
    "UnitPhase",
    "UnitState",
    "UnsupportedOptimizerError",
    "check_elementwise",
    "default_unit_policy",
    "module_class_policy",
    "owns_parameters",
    "plan_units",
    "record_meta_init",
    "shard_model",
]
