"""The precision plugin our strategies use: Lightning's precisions made sharding-aware.

``ZeROPrecision(precision)`` takes the place of Lightning's ``Precision`` (``"32-true"``),
``MixedPrecision`` (``"bf16-mixed"``, ``"16-mixed"``) and ``HalfPrecision`` (``"bf16-true"``,
``"16-true"``); the strategies convert the plugin the ``Trainer`` picked.

- Mixed precision: forward and backward run under ``torch.autocast`` as with Lightning's plugin,
  but on parameters already in the compute dtype (``param_dtype``, the half type by default): the
  engine keeps fp32 master shards for the optimizer, so stage 3 gathers half the bytes. Set
  ``param_dtype=torch.float32`` on the strategy for Lightning's own behaviour (fp32 parameters,
  autocast only), which matches ``DDPStrategy`` exactly.
- ``"16-mixed"`` scales the loss with ``ShardedGradScaler``: an ``inf``/``NaN`` in *any* rank's shard
  skips the step on every rank and lowers the scale (a ``GradScaler`` per rank would see only its
  own shard and let ranks diverge). Skipped steps are counted in ``skipped_steps`` and warned about.
- ``"-true"`` precisions convert the module to the half type before sharding, as Lightning does;
  the optimizer steps half-precision shards, exactly like ``DDPStrategy`` at that precision.
- Clipping by norm: Lightning clips with ``torch.nn.utils.clip_grad_norm_`` over the optimizer's
  parameters. Under ZeRO those are this rank's shards, whose local norm is not the model's norm;
  this plugin asks the engine for the global norm instead (one all-reduce). Clipping by value is
  element-wise, so Lightning's own implementation is already exact on shards.
- Non-finite gradients (without a loss scaler): before the step, every rank learns whether any
  rank's shard holds an ``inf`` or ``NaN`` (one all-reduce), and all ranks then raise, or all skip
  the step, together (``nonfinite_grads``). A step is never applied with such a gradient unless
  asked (``"ignore"``, what DDP does).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.spike import SpikeDetection
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.driver.config import PRECISIONS, NonFinitePolicy
from lightning_zero.driver.precision import (
    DoorWords,
    PrecisionDtypes,
    arm_finite_check,
    checks_finite,
    connect_scaler,
    nonfinite_grads_at,
    refuse_plugin,
    sharded_scaler,
    skip_nonfinite_step,
)
from lightning_zero.engine.comm.device_wait import read_on_host
from lightning_zero.engine.core.scaler import ShardedGradScaler
from lightning_zero.engine.errors import NonFiniteGradientError
from lightning_zero.engine.sharded_model import ShardedModel

PrecisionName = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]
TRAINER_WORDS = DoorWords("Trainer", clip="gradient_clip_val")
__all__ = ["NonFiniteGradientError", "ShardedGradScaler", "ZeROPrecision"]


class ZeROPrecision(Precision):
    """Lightning's precisions for the ZeRO strategies (see the module docstring; what each precision means is
    ``driver/precision.py``'s ``PrecisionDtypes``, shared with Fabric's door).

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"`` or ``"16-true"``.
        device: The device type for ``torch.autocast`` and the loss scaler (mixed precision).
        scaler: A ``torch.amp.GradScaler`` whose settings to use (``"16-mixed"``); made sharded.

    Normally the strategy builds this from ``Trainer(precision=...)``. Pass it as a plugin to use
    ``"16-mixed"`` on CPU, which the ``Trainer`` otherwise turns into ``"bf16-mixed"``.

    Example::

        trainer = Trainer(strategy=ZeRO3Strategy(), precision="bf16-mixed", gradient_clip_val=1.0)
        trainer = Trainer(strategy=ZeRO2Strategy(), plugins=[ZeROPrecision("16-mixed", device="cpu")])
    """

    def __init__(
        self, precision: PrecisionName = "32-true", device: str = "cpu", scaler: torch.amp.GradScaler | None = None
    ) -> None:
        super().__init__()
        if precision not in PRECISIONS:
            raise ValueError(
                f"the ZeRO strategies support precision in {PRECISIONS}, got {precision!r}. "
                "Pass one of those to Trainer(precision=...)."
            )
        if scaler is not None and precision != "16-mixed":
            raise ValueError(f"precision={precision!r} does not use a loss scaler; pass scaler only with '16-mixed'")
        self.precision = precision
        self.device = device
        self.scaler: ShardedGradScaler | None = sharded_scaler(scaler, device) if precision == "16-mixed" else None
        self.sharded_model: ShardedModel | None = None
        self.nonfinite_grads: NonFinitePolicy = "raise"
        self.skipped_steps = 0
        self.last_grad_norm = None

    @classmethod
    def from_lightning(cls, plugin: Precision | None) -> ZeROPrecision:
        """The ZeRO version of the plugin the ``Trainer`` picked; a clear error for the ones without one."""
        if plugin is None or type(plugin) is Precision:
            return cls()
        if isinstance(plugin, ZeROPrecision):
            return plugin
        if type(plugin) is MixedPrecision:
            return cls(plugin.precision, device=plugin.device, scaler=plugin.scaler)
        if type(plugin) is HalfPrecision:
            return cls(plugin.precision)
        refuse_plugin(plugin, TRAINER_WORDS)

    # ------------------------------------------------------------------ dtypes
    @property
    def dtypes(self) -> PrecisionDtypes:
        return PrecisionDtypes(self.precision, self.device)

    @property
    def is_mixed(self) -> bool:
        return self.dtypes.is_mixed

    @property
    def half_dtype(self) -> torch.dtype | None:
        """The low-precision dtype (``None`` for ``"32-true"``)."""
        return self.dtypes.half_dtype

    @property
    def default_param_dtype(self) -> torch.dtype | None:
        """The compute dtype the engine gives parameters when the strategy sets none (mixed: the half type)."""
        return self.dtypes.default_param_dtype

    @override
    def convert_module(self, module: Module) -> Module:
        return self.dtypes.convert_module(module)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return self.dtypes.module_init_context()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self.dtypes.forward_context():
            yield

    @override
    def convert_input(self, data: Any) -> Any:
        return self.dtypes.convert_input(data)

    # ------------------------------------------------------------------ loss scaling
    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizable, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        # The closure (forward and backward) runs first, on full parameters; then the step runs with the
        # parameters as this rank's master pieces (``ShardedModel.on_shards``), as Lightning's own mixed
        # precision runs its closure before ``optimizer.step()``.
        closure_result = closure()
        skip = closure_result is None and model.automatic_optimization  # the user's step returned no loss
        if self.scaler is None:
            self._after_closure(model, optimizer)
            if skip:
                return closure_result
            with self._engine().on_shards(optimizer):
                optimizer.step(**kwargs)
            return closure_result
        if not skip:
            with self._engine().on_shards(optimizer):
                self.scaler.unscale_(optimizer)  # type: ignore[arg-type]
        self._after_closure(model, optimizer)
        if skip:
            return closure_result
        found = self.scaler._found_inf_per_device(optimizer)  # type: ignore[arg-type]
        # Read once, through the stall report (see [Note: waits for the device] in device_wait.py); the read in
        # ``GradScaler.step`` of the same flags (as under DDP) then finds the device done with them.
        overflow = _overflowed(self._engine(), found)
        with self._engine().on_shards(optimizer):
            output = self.scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]
        scale = self.scaler.get_scale() if overflow else 0.0  # a read on the host: only for the warning
        self.scaler.update()
        if overflow:
            self.skipped_steps += 1
            rank_zero_warn(
                f"skipped optimizer step {model.trainer.global_step}: the scaled gradients overflowed on some rank "
                f"(loss scale {scale:g} -> {self.scaler.get_scale():g}; {self.skipped_steps} skipped so far)"
            )
        return output

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)

    def attach(self, sharded_model: ShardedModel | None) -> None:
        """Connect to (or, with ``None``, detach from) the engine whose gradients this plugin checks."""
        self.sharded_model = sharded_model
        if sharded_model is not None:
            arm_finite_check(sharded_model, self.nonfinite_grads, self.scaler is not None)
        if self.scaler is not None:
            connect_scaler(self.scaler, sharded_model)

    def _engine(self) -> ShardedModel:
        if self.sharded_model is None:
            raise RuntimeError("ZeROPrecision is not attached to a sharded model; use it through a ZeRO strategy")
        return self.sharded_model

    @override
    def _after_closure(self, model: pl.LightningModule, optimizer: Any) -> None:
        if self.sharded_model is not None:  # before the hooks that look at gradients (see ``settle_grads``)
            self.sharded_model.settle_grads()
        if checks_finite(self.nonfinite_grads, self.scaler is not None):  # with a scaler, the scaler decides
            self._check_finite(model, optimizer)
        super()._after_closure(model, optimizer)

    def _check_finite(self, model: pl.LightningModule, optimizer: Optimizer) -> None:
        sharded = self._engine()
        where = nonfinite_grads_at(sharded, optimizer)
        if where is None:
            return
        policy = self.nonfinite_grads
        deferred_to = "SpikeDetection" if policy == "raise" and _has_spike_detection(model.trainer) else None
        step = model.trainer.global_step
        skip_nonfinite_step(sharded, optimizer, where, policy, self.skipped_steps, TRAINER_WORDS, step, deferred_to)
        self.skipped_steps += 1

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        with self._engine().on_shards(optimizer):  # element-wise: the sharded gradients are clipped in place
            super().clip_grad_by_value(optimizer, clip_val)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.last_grad_norm = self._engine().clip_grad_norm_(optimizer, float(clip_val))


def _overflowed(sharded: ShardedModel, found: dict[torch.device, Tensor]) -> bool:
    """Whether the scaler found an inf or NaN on some rank (its flags are already all-reduced)."""
    if not found:
        return False
    device = sharded.units[0].device
    total = torch.stack([flag.to(device, torch.float32) for flag in found.values()]).sum()
    return read_on_host(sharded.comm, total.reshape(1), "whether the scaled gradients overflowed")[0] > 0


def _has_spike_detection(trainer: pl.Trainer) -> bool:
    """Whether Lightning's ``SpikeDetection`` callback watches the losses: then it decides what a non-finite loss
    means (its exception after its warm-up, as under DDP), and the default policy skips the step instead of raising
    first; the model is not stepped with the non-finite gradients meanwhile."""
    return any(isinstance(callback, SpikeDetection) for callback in trainer.callbacks)
