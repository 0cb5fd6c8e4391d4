"""Every error the engine and the strategies raise on purpose, in one place.

Each says what went wrong and how to fix it. The ones a collective decides (``CollectiveMismatchError``,
``PeerFailureError``, ``NonFiniteGradientError``, ``CheckpointSaveError``, ...) are raised on every rank at the same
point, so no rank is left waiting for the others. ``lightning_zero`` exports the ones user code may catch.
"""

from __future__ import annotations

import pickle
from typing import Any

__all__ = [
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "CollectiveMismatchError",
    "CorruptCheckpointError",
    "FoldedModuleError",
    "MetaInitError",
    "NonFiniteGradientError",
    "PeerFailureError",
    "RecordChecksumError",
    "ShardedConversionError",
    "ShardedGradientError",
    "ShardedOptimizerStateError",
    "ShardedParameterReadError",
    "ShardedParameterWriteError",
    "UnsafeCheckpointError",
    "UnsupportedOptimizerError",
    "WeightsOnlyCheckpointError",
]


class MetaInitError(ValueError):
    """A model built on the meta device cannot be initialized as an ordinary construction would (raised on
    every rank alike, at the same point)."""


class UnsupportedOptimizerError(TypeError):
    """The optimizer's update is not element-wise, so stepping shards would change the result."""


class ShardedOptimizerStateError(RuntimeError):
    """An optimizer whose per-parameter states stayed sharded when its run ended (their full form did not fit in
    memory) was asked for its state or to step."""


class ShardedParameterWriteError(RuntimeError):
    """User code wrote into a stage-3 parameter while its unit was sharded (the write would be lost)."""


class ShardedParameterReadError(RuntimeError):
    """A stage-3 parameter was read, outside its unit's forward, in a way that cannot be served (see
    [Note: reading a sharded parameter])."""


class ShardedGradientError(RuntimeError):
    """A module parameter's ``.grad`` was read, but under ZeRO the reduced gradient exists only as shards."""


class ShardedConversionError(RuntimeError):
    """A sharded model's parameters were given another dtype or device during training (``model.to(...)``,
    ``.double()``, ``.half()``, ``.cpu()``): the shards, master weights, optimizer states and communication buffers
    keep the ones they were built with, so the change cannot be followed.

    Example::

        error = ShardedConversionError("'blocks.0.up.weight'", "torch.float32 on cpu", "torch.float64 on cpu")
        str(error)      # "... 'blocks.0.up.weight' from torch.float32 on cpu to torch.float64 on cpu ..."
    """

    def __init__(self, where: str, old: str, new: str) -> None:
        super().__init__(
            f"the model was converted during training (module.to(...), .double(), .half(), .cpu(), ...): {where} "
            f"from {old} to {new}. Under ZeRO a parameter's dtype and device are fixed once the model is sharded (its "
            "shards, master weights, optimizer states and communication buffers were built for them). Choose them "
            "before fit: Trainer(precision=...) (e.g. '64-true', 'bf16-true') or fabric = Fabric(precision=...), or "
            "convert the model before trainer.fit(...) / fabric.setup(...); for a converted copy, convert "
            "copy.deepcopy(model), which is a plain module."
        )
        self.where, self.old, self.new = where, old, new

    def __reduce__(self) -> tuple[Any, ...]:  # rebuilt from its parts (the message is made of them)
        return type(self), (self.where, self.old, self.new)


class FoldedModuleError(RuntimeError):
    """A module folded into a unit ran while that unit was not gathered (see [Note: folded modules])."""


class CollectiveMismatchError(RuntimeError):
    """Ranks were about to do different things that must be done together (raised on every rank, naming each
    rank's action, instead of a deadlock or an exchange of the wrong data)."""


class PeerFailureError(RuntimeError):
    """Another rank failed while this one waited for it in a collective (the message carries its error)."""


class CorruptCheckpointError(RuntimeError):
    """A checkpoint's files are missing, truncated, from another save or not what a checkpoint holds;
    nothing was loaded."""


class UnsafeCheckpointError(pickle.UnpicklingError):
    """The file holds objects only arbitrary pickled code can rebuild; it was not loaded.

    ``reason`` says what was refused, ``advice`` how to load the file anyway if it is trusted (a command line
    replaces it with its own flag). Example::

        error = UnsafeCheckpointError("'a.ckpt' holds ...", advice="If you trust the file, pass weights_only=False.")
        str(error)      # "'a.ckpt' holds .... If you trust the file, pass weights_only=False."
    """

    def __init__(self, reason: str, advice: str = "") -> None:
        super().__init__(f"{reason}. {advice}" if advice else reason)
        self.reason = reason
        self.advice = advice

    def __reduce__(self) -> tuple[Any, ...]:  # rebuilt from its parts (the message is made of them)
        return type(self), (self.reason, self.advice)


class RecordChecksumError(ValueError):
    """The pieces of a record do not cover it exactly once (an internal error of the writer)."""


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the model (names or shapes differ)."""


class NonFiniteGradientError(FloatingPointError):
    """A gradient held ``inf`` or ``NaN``; raised on every rank together, before the step."""


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank; every rank raises it, the partial save was removed, and the previous
    checkpoint of that name is unchanged."""


class WeightsOnlyCheckpointError(KeyError):
    """``fit`` was asked to resume from a checkpoint that holds the model only."""
