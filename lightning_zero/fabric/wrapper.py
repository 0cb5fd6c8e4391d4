"""What ``fabric.setup`` returns under a ZeRO strategy: the user's module behind a forward that brackets the step.

[Note: Fabric steps]
The Trainer calls ``training_step``, so the Trainer strategies bracket it. Fabric has no step: the
user calls ``model(x)``, ``fabric.backward(loss)`` and ``optimizer.step()``. A forward with gradients
enabled starts a step (rank 0's buffers on DDP's schedule; under stage 3 the root unit, the
parameters the module uses outside any unit, gathered and held); ``fabric.backward`` ends it once the
gradients are reduced, so the root unit is freed before the optimizer steps. A forward without
gradients (evaluation) is a step of its own, unless it runs inside an open step, which keeps its
hold. An optimizer step closes a step left open (a forward whose loss was never back-propagated).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn
from typing_extensions import override

from lightning_zero.driver import agreement
from lightning_zero.engine import ShardedModel


class StepBracket:
    """Starts and ends the engine's steps around Fabric's forward and backward (see [Note: Fabric steps]).

    Example::

        steps = StepBracket(sharded)
        out = steps.run(module, (x,), {})      # begins a step: the root unit is held under stage 3
        out.sum().backward()
        steps.end()                            # what the strategy's backward does
    """

    def __init__(self, sharded: ShardedModel, on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.sharded = sharded
        self.on_failure = on_failure  # the strategy's ``on_exception``: a forward that raises ends the run
        self.open = False
        self.counts = {"training": 0, "no_grad": 0}

    def _agree(self, kind: str) -> None:
        """Every rank starts the same step (see [Note: agreements] in ``engine/comm/control.py``)."""
        self.counts[kind] += 1
        step = self.counts[kind]
        what = "forward with gradients" if kind == "training" else "forward under no_grad"
        agreement.begin_plain_step(self.sharded.comm, kind, step, lambda: f"{what} number {step}")

    def run(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``module(*args, **kwargs)`` inside a step."""
        try:
            return self._run(module, args, kwargs)
        except BaseException as error:
            if self.on_failure is not None:
                self.on_failure(error)
            raise

    def _run(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if torch.is_grad_enabled():
            self._agree("training")
            self.sharded.begin_step()
            self.open = True
            return module(*args, **kwargs)
        held = self.sharded.root_held
        self._agree("no_grad")
        self.sharded.begin_step(training=False)
        try:
            return module(*args, **kwargs)
        finally:
            if not held:
                self.sharded.end_step()

    def end(self) -> None:
        """End the open step, if any (after backward; before an optimizer step)."""
        if self.open:
            self.open = False
            self.sharded.end_step()


class ShardedForward(nn.Module):
    """The module ``fabric.setup`` wraps in its ``_FabricModule``: ``forward`` runs the user's module (``.module``,
    whose parameters are this wrapper's) inside a step."""

    def __init__(self, module: nn.Module, steps: StepBracket) -> None:
        super().__init__()
        self.module = module
        self.steps = steps

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.steps.run(self.module, args, kwargs)


class ZeROBackwardSyncControl(_BackwardSyncControl):
    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        """``fabric.no_backward_sync(model)``: stage 1 accumulates full gradients without reducing them; stages 2
        and 3 reduce each micro-batch into the sharded gradient (they must, to free the full one)."""
        if not enabled:
            return nullcontext()
        if not isinstance(module, ShardedForward):
            raise TypeError(
                "no_backward_sync needs the model fabric.setup returned under a ZeRO strategy, got "
                f"{type(module).__name__}"
            )
        return module.steps.sharded.no_sync()
