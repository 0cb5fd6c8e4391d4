"""Full parameters for the callbacks that read and write a model's weights between steps.

[Note: callbacks that need full parameters]
Lightning's weight-averaging callbacks (``StochasticWeightAveraging``, ``WeightAveraging`` and its
``EMAWeightAveraging``) read every parameter of the ``LightningModule`` after steps and write
averaged values back into them, with plain tensor code (``copy_``, ``_foreach_lerp_``);
``ModelPruning`` computes masks from the weights and rebinds ``param.data`` (``prune.remove``, the
lottery-ticket reset), which ``gathered_parameters()`` takes over on exit. Under stage
3, or with a half-precision compute copy, the parameters do not show their master values between
steps (see [Note: parameters outside their unit's use] in ``engine/core/unit.py``). The strategy
therefore brackets each such callback with two small callbacks of its own, inserted into
``trainer.callbacks`` just before and just after it: around every hook listed in
``WEIGHT_HOOKS`` that the callback overrides, the first enters
``ShardedModel.gathered_parameters()`` (full values in the master dtype) and the second leaves it,
writing what the callback wrote back into the shards. The callback itself is untouched.

The cost is one all-gather of the model per bracketed hook, and the full parameters for the
duration of the hook: the same order of memory as the averaged copy these callbacks keep anyway.
Any other callback can ask for the same by setting ``needs_full_parameters = True`` on itself; in
a ``LightningModule`` hook, use ``trainer.strategy.gathered_parameters()`` directly.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelPruning, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.nn import Module

FULL_PARAMETER_CALLBACKS: tuple[type[Callback], ...] = (StochasticWeightAveraging, WeightAveraging, ModelPruning)
# The hooks in which these callbacks touch the weights. Not on_load_checkpoint: a load streams into the
# shards itself, and writing a gathered copy back afterwards would undo it.
WEIGHT_HOOKS = (
    "on_train_epoch_start",
    "on_train_batch_end",
    "on_train_epoch_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_train_end",
)


def needs_full_parameters(callback: Callback) -> bool:
    """Whether ``callback`` reads or writes the module's weights between steps (see the note above)."""
    return isinstance(callback, FULL_PARAMETER_CALLBACKS) or bool(getattr(callback, "needs_full_parameters", False))


# ``strategy.gathered_parameters``: a context in which a module's parameters are full.
Gathered = Callable[[Module], AbstractContextManager]


class _Bracket:
    """What the opening and closing callbacks of one bracketed callback share."""

    def __init__(self, gathered: Gathered, target: Callback) -> None:
        self.gathered = gathered
        self.target = target
        self.stack: ExitStack | None = None

    def open(self, hook: str, pl_module: pl.LightningModule) -> None:
        if not is_overridden(hook, self.target, Callback) or self.stack is not None:
            return
        stack = ExitStack()
        stack.enter_context(self.gathered(pl_module))
        self.stack = stack

    def close(self) -> None:
        stack, self.stack = self.stack, None
        if stack is not None:
            stack.close()


def _opening(hook: str):
    def method(self: _GatherParameters, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.bracket.open(hook, pl_module)

    method.__name__ = hook
    return method


def _closing(hook: str):
    def method(self: _ScatterParameters, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.bracket.close()

    method.__name__ = hook
    return method


class _BracketEnd(Callback):
    """One end of a bracket around a callback that needs full parameters."""

    def __init__(self, bracket: _Bracket) -> None:
        self.bracket = bracket

    @property
    def state_key(self) -> str:
        return f"{type(self).__name__}[{type(self.bracket.target).__name__}]"


class _GatherParameters(_BracketEnd):
    """Placed just before the callback: gathers the parameters (see the note above)."""


class _ScatterParameters(_BracketEnd):
    """Placed just after it: writes what it changed back into the shards and frees the full parameters."""

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.bracket.close()


for _hook in WEIGHT_HOOKS:
    setattr(_GatherParameters, _hook, _opening(_hook))
    setattr(_ScatterParameters, _hook, _closing(_hook))


def bracket_full_parameter_callbacks(gathered: Gathered, callbacks: list[Callback]) -> list[Callback]:
    """Insert the gathering pair around every callback that needs full parameters (in place); return the
    inserted callbacks, for ``unbracket`` at teardown. ``gathered``: the strategy's ``gathered_parameters``."""
    inserted: list[Callback] = []
    for target in [c for c in callbacks if needs_full_parameters(c)]:
        bracket = _Bracket(gathered, target)
        before, after = _GatherParameters(bracket), _ScatterParameters(bracket)
        position = callbacks.index(target)
        callbacks[position : position + 1] = [before, target, after]
        inserted += [before, after]
    return inserted


def unbracket(callbacks: list[Callback], inserted: list[Callback]) -> None:
    """Remove what ``bracket_full_parameter_callbacks`` inserted (in place), closing any open bracket."""
    for callback in inserted:
        if isinstance(callback, _ScatterParameters):
            callback.bracket.stack = None  # the module is released as a whole at teardown
    ids = {id(c) for c in inserted}
    callbacks[:] = [c for c in callbacks if id(c) not in ids]
