"""ZeRO stages 1, 2 and 3 (sharded optimizer states, gradients, parameters) as Lightning strategies.

Example::

    import lightning as L
    import lightning_zero  # registers "zero1", "zero2" and "zero3"

    trainer = L.Trainer(strategy="zero3", accelerator="cpu", devices=2)
    trainer.fit(model)

Fabric users: ``Fabric(strategy="zero3")`` after the same import, or the classes in ``lightning_zero.fabric``.

``lightning_zero.check_parity(model, stage=3)`` trains a few steps of your module under ``DDPStrategy``
and under a stage, and reports loss, gradient-norm and parameter differences.

The errors the strategies raise on purpose (``lightning_zero.CheckpointSaveError``, ``CollectiveMismatchError``,
``PeerFailureError``, ...) are exported here; they are defined in ``lightning_zero.engine.errors``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero import fabric  # registers "zero1", "zero2" and "zero3" with Fabric
from lightning_zero.driver.checkpointing import consolidate as consolidate_checkpoint
from lightning_zero.engine.errors import (
    CheckpointMismatchError,
    CheckpointSaveError,
    CollectiveMismatchError,
    CorruptCheckpointError,
    FoldedModuleError,
    MetaInitError,
    NonFiniteGradientError,
    PeerFailureError,
    RecordChecksumError,
    ShardedConversionError,
    ShardedGradientError,
    ShardedOptimizerStateError,
    ShardedParameterReadError,
    ShardedParameterWriteError,
    UnsafeCheckpointError,
    UnsupportedOptimizerError,
    WeightsOnlyCheckpointError,
)
from lightning_zero.planning.activations import ActivationProfile, profile_activations
from lightning_zero.planning.estimate import estimate_memory
from lightning_zero.planning.estimate_report import MemoryEstimate, StrategyEstimate
from lightning_zero.pretrained import export_pretrained, from_pretrained, load_weights
from lightning_zero.strategies import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy, ZeROPrecision, ZeROStrategy
from lightning_zero.tools.parity import check_parity
from lightning_zero.tools.parity_report import ParityReport

__version__ = "0.1.0"
__all__ = [
    "ActivationProfile",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "CollectiveMismatchError",
    "CorruptCheckpointError",
    "FoldedModuleError",
    "MemoryEstimate",
    "MetaInitError",
    "NonFiniteGradientError",
    "ParityReport",
    "PeerFailureError",
    "RecordChecksumError",
    "ShardedConversionError",
    "ShardedGradientError",
    "ShardedOptimizerStateError",
    "ShardedParameterReadError",
    "ShardedParameterWriteError",
    "StrategyEstimate",
    "UnsafeCheckpointError",
    "UnsupportedOptimizerError",
    "WeightsOnlyCheckpointError",
    "ZeRO1Strategy",
    "ZeRO2Strategy",
    "ZeRO3Strategy",
    "ZeROPrecision",
    "ZeROStrategy",
    "__version__",
    "check_parity",
    "consolidate_checkpoint",
    "estimate_memory",
    "export_pretrained",
    "fabric",
    "from_pretrained",
    "load_weights",
    "profile_activations",
]

for _strategy, _name in ((ZeRO1Strategy, "zero1"), (ZeRO2Strategy, "zero2"), (ZeRO3Strategy, "zero3")):
    if _name not in StrategyRegistry:  # a re-import must not register twice
        _strategy.register_strategies(StrategyRegistry)
