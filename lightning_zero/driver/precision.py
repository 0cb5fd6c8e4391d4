"""What a precision means under ZeRO, alike behind both doors.

[Note: one precision, two plugins]
The Trainer's door replaces Lightning's plugin with ``ZeROPrecision`` (``strategies/precision.py``); Fabric's door
keeps Fabric's own plugins (``fabric/precision.py``). What the precision means for sharding is the same behind
both, and lives here: the dtypes of each precision name (``PrecisionDtypes``: the half type, the compute dtype of
parameters, the cast of ``"-true"`` precisions, autocast for ``"-mixed"``), the plugins and the ``param_dtype``
refused, the loss scaler made sharded and connected to the engine, and the ``nonfinite_grads`` policy (one check
before each step, the same answer on every rank). A door passes its ``DoorWords``, the names its users know, for
the messages; everything else about its API (Lightning's hooks, Fabric's calls) stays in the door.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_zero.driver.config import PRECISIONS, NonFinitePolicy
from lightning_zero.engine.core.scaler import ShardedGradScaler
from lightning_zero.engine.errors import NonFiniteGradientError
from lightning_zero.engine.sharded_model import ShardedModel

HALF_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16}


@dataclass(frozen=True)
class DoorWords:
    """How a door's users name what the shared messages mention: where they choose the precision (``name``, as in
    ``Trainer(precision=...)``) and how they clip gradients (``clip``).

    Example::

        TRAINER_WORDS = DoorWords("Trainer", clip="gradient_clip_val")
    """

    name: str
    clip: str


@dataclass(frozen=True)
class PrecisionDtypes:
    """The dtypes of one of the five precision names and the contexts that apply them.

    ``"-true"`` half precisions build and cast the module, and convert the inputs, to the half type; ``"-mixed"``
    ones run the forward under ``torch.autocast`` on ``device`` and give parameters the half type as their default
    compute dtype (the engine keeps fp32 master shards); ``"32-true"`` changes nothing.

    Example::

        dtypes = PrecisionDtypes("bf16-true")
        with dtypes.module_init_context():
            model = build()  # in bf16
        sharded = driver.shard(model, device=device, param_dtype=dtypes.default_param_dtype)
    """

    precision: str
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")

    @property
    def is_mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    @property
    def half_dtype(self) -> torch.dtype | None:
        """The low-precision dtype (``None`` for ``"32-true"``)."""
        return HALF_DTYPES.get(self.precision.split("-")[0])

    @property
    def default_param_dtype(self) -> torch.dtype | None:
        """The compute dtype the engine gives parameters when the options set none (mixed: the half type)."""
        return self.half_dtype if self.is_mixed else None

    @property
    def _cast_to(self) -> torch.dtype | None:
        """The dtype a ``"-true"`` half precision casts the module and the inputs to (``None``: no cast)."""
        return self.half_dtype if self.precision.endswith("-true") else None

    def convert_module(self, module: Module) -> Module:
        return module if self._cast_to is None else module.to(dtype=self._cast_to)

    def module_init_context(self) -> AbstractContextManager:
        """Where a module is built: in the half type under a ``"-true"`` half precision."""
        return nullcontext() if self._cast_to is None else _DtypeContextManager(self._cast_to)

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.is_mixed:
            with torch.autocast(self.device, dtype=self.half_dtype, cache_enabled=False):
                yield
        else:
            with self.module_init_context():
                yield

    def convert_input(self, data: Any) -> Any:
        if self._cast_to is None:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self._cast_to)


def refuse_plugin(plugin: Any, words: DoorWords) -> NoReturn:
    """The error for a precision plugin the strategies have no ZeRO version of."""
    raise ValueError(
        f"the ZeRO strategies support precision in {PRECISIONS}; got the plugin {type(plugin).__name__} "
        f"(precision={getattr(plugin, 'precision', '?')!r}). Pass one of those to {words.name}(precision=...)."
    )


def param_dtype_for(precision: str, param_dtype: torch.dtype | None, words: DoorWords) -> torch.dtype | None:
    """The dtype parameters are gathered and computed in under ``precision`` (``None``: the module's own), with the
    ``param_dtype`` option; refused without mixed precision.

    Example::

        param_dtype_for("bf16-mixed", None, words)  # torch.bfloat16
    """
    if not precision.endswith("-mixed"):
        if param_dtype is not None:
            raise ValueError(
                f"param_dtype={param_dtype} applies to mixed precision ({words.name}(precision='bf16-mixed' or "
                f"'16-mixed')); with precision={precision!r} parameters keep the module's dtype. Remove "
                "param_dtype or choose a mixed precision."
            )
        return None
    return param_dtype or HALF_DTYPES[precision.split("-")[0]]


# ---------------------------------------------------------------------- the loss scaler of "16-mixed"
def sharded_scaler(scaler: torch.amp.GradScaler | None, device: str) -> ShardedGradScaler:
    """A ``ShardedGradScaler`` with the settings of ``scaler`` (``None``: torch's defaults) on ``device``."""
    return ShardedGradScaler.like(scaler, device) if scaler is not None else ShardedGradScaler(device)


def connect_scaler(scaler: ShardedGradScaler, sharded: ShardedModel | None) -> None:
    """Let ``scaler``'s overflow flag be all-reduced over ``sharded``'s ranks (``None``: disconnect it), so that
    one overflow decision covers every rank's shard."""
    scaler.all_reduce = None if sharded is None else sharded.comm.all_reduce
    scaler.comm_device = None if sharded is None else sharded.units[0].device


# ---------------------------------------------------------------------- non-finite gradients
def checks_finite(policy: NonFinitePolicy, has_scaler: bool) -> bool:
    """Whether the ``nonfinite_grads`` check runs before each step: not under ``"ignore"``, and not with a loss
    scaler (the scaler decides)."""
    return policy != "ignore" and not has_scaler


def arm_finite_check(sharded: ShardedModel, policy: NonFinitePolicy, has_scaler: bool) -> None:
    """Have the backward pass's reductions note whether gradients are finite, when the check runs: its answer then
    needs no collective of its own (see ``GradReducer.check_finite``)."""
    sharded.reducer.check_finite = checks_finite(policy, has_scaler)


def nonfinite_grads_at(sharded: ShardedModel, optimizer: Optimizer) -> str | None:
    """Before a step: where gradients hold ``inf``/``NaN`` (the ranks, the same on every rank, and this rank's
    parameters, at most five), or ``None`` if every rank's are finite."""
    ranks, local = sharded.nonfinite_grads(optimizer)
    if not ranks:
        return None
    return f"rank(s) {ranks}" + (f" (here: {', '.join(local[:5])})" if local else "")


def skip_nonfinite_step(
    sharded: ShardedModel,
    optimizer: Optimizer,
    where: str,
    policy: NonFinitePolicy,
    skipped: int,
    words: DoorWords,
    step: int | None = None,
    deferred_to: str | None = None,
) -> None:
    """The gradients hold ``inf``/``NaN`` at ``where`` (``nonfinite_grads_at``): ``"raise"`` raises
    ``NonFiniteGradientError``; ``"skip"`` drops the gradients (the step changes nothing) and warns. ``skipped``:
    the steps skipped before this one, for the warning; ``step``: the step's number, where the door knows it;
    ``deferred_to``: what decides instead of ``"raise"`` (the step is skipped, and the warning names it).

    Example::

        where = nonfinite_grads_at(sharded, optimizer)
        if where is not None:
            skip_nonfinite_step(sharded, optimizer, where, "skip", skipped, words)
            skipped += 1
    """
    if policy == "raise" and deferred_to is None:
        at = "" if step is None else f" at step {step}"
        raise NonFiniteGradientError(
            f"non-finite gradients (inf or NaN){at} on {where}; the step was not applied. Lower the learning rate, "
            f"clip gradients ({words.clip}), check the data, or pass nonfinite_grads='skip' to skip such steps on all "
            "ranks."
        )
    sharded.drop_grads(optimizer)
    which = "an optimizer step" if step is None else f"optimizer step {step}"
    handed_on = f" (the loss goes on to {deferred_to})" if policy == "raise" else ""
    rank_zero_warn(f"skipped {which}: non-finite gradients on {where} ({skipped + 1} so far){handed_on}")
