"""What ``fabric.setup`` returns under a ZeRO strategy: the user's module behind a forward that brackets the step.

[Note: Fabric steps]
The Trainer calls ``training_step``, so the Trainer strategies bracket it. Fabric has no step: the
user calls ``model(x)``, ``fabric.backward(loss)`` and ``optimizer.step()``. A forward with gradients
enabled starts a step (rank 0's buffers on DDP's schedule; under stage 3 the root unit, the
parameters the module uses outside any unit, gathered and held); ``fabric.backward`` ends it once the
gradients are reduced, so the root unit is freed before the optimizer steps. A forward without
gradients inside an open step keeps its hold. An optimizer step closes a step left open (a forward whose
loss was never back-propagated).

Forwards without gradients outside a training step (an evaluation loop, a generation loop that calls the model
once per token, as LitGPT's ``generate(model, prompt, ...)`` does under ``torch.inference_mode()``) are one
*no-grad step*: the first begins it, and it stays open after each (the root unit held) until the strategy is asked
for anything else: a training forward, a backward, an optimizer step, clipping, a collective (``fabric.barrier``,
``all_reduce``, ``broadcast``), a save, a load, a state dict, ``gathered_parameters``, ``save_pretrained`` or the
teardown. Ending it is local (the units are freed; nothing is exchanged), so a rank that has finished its forwards
goes on to whatever it does next, and the ranks still running theirs are served at its next agreement: the next
training forward, a barrier, a broadcast, a save or load, the teardown, or a ``fabric.all_reduce`` between
training steps (agreed for this; inside a step it is checked in the step's sequence, as every collective of the
step is). Under stage 3 the forwards of the step after the first are joined forwards (see [Note: joined forwards] in
``engine/schedule/joined.py``): each is agreed, and a rank that has gone elsewhere serves their gathers from
there. The step's beginning is agreed so too (``CollectiveSequence.begin_no_grad_step``): when every rank begins
it, as a Trainer step's agreement, its first forward riding on it (a validation loop pays one agreement per
forward, as when each forward was a step); when some ranks are elsewhere (LitGPT generates its example on rank 0
only), they serve it: the root unit's gather, then the gathers of the first forward, which the runners announce as
the one their last no-grad step began with. A rank serves a step only between steps, where its units are in the
state the runners' were in when they began it (the same steps ran before), and frees them after, as the runners'
step does when it ends; a step that begins with a broadcast of rank 0's buffers (the first forward after a
training forward, as DDP's) cannot be served, as DDP's forward would hang there too. Stages 1 and 2 have no
collective in a forward: a no-grad step is agreed only if it issues one (the buffer broadcast), so ranks may run
different numbers of them, as under DDP.
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
from lightning_zero.engine.comm.advice import BROADCASTS_BUFFERS


class StepBracket:
    """Starts and ends the engine's steps around Fabric's forward and backward (see [Note: Fabric steps]).

    Example::

        steps = StepBracket(sharded)
        out = steps.run(module, (x,), {})      # begins a step: the root unit is held under stage 3
        out.sum().backward()
        steps.end()                            # what the strategy's backward does
        with torch.no_grad():
            steps.run(module, (x,), {})        # a no-grad step begins, and stays open
        steps.end_evaluation()                 # what the strategy's collectives do first
    """

    def __init__(self, sharded: ShardedModel, on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.sharded = sharded
        self.on_failure = on_failure  # the strategy's ``on_exception``: a forward that raises ends the run
        self.open = False  # a training step
        self.evaluating = False  # a no-grad step, open until the strategy is asked for something else
        self.counts = {"training": 0, "no_grad": 0, "evaluation": 0}

    def _agree(self, kind: str) -> None:
        """Every rank starts the same step (see [Note: agreements] in ``engine/comm/control.py``)."""
        self.counts[kind] += 1
        step = self.counts[kind]
        what = (
            "forward with gradients number {}"
            if kind == "training"
            else "forward under no_grad number {} (inside a training step)"
        )
        agreement.begin_plain_step(self.sharded.comm, kind, step, lambda: what.format(step))

    def run(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``module(*args, **kwargs)`` inside a step. Under ``torch.compile`` (a model compiled before
        ``fabric.setup``, which Fabric compiles again around this wrapper) only the call of ``module`` is traced:
        the bracket runs eagerly (see [Note: torch.compile] in ``engine/schedule/compiled.py``)."""
        close = self._begin()
        try:
            output = module(*args, **kwargs)
        except BaseException as error:
            self._fail(error, close)
            raise
        if close:
            self._end_forward()
        return output

    @torch.compiler.disable
    def _begin(self) -> bool:
        """Start a step, or go on in the open one; whether ``run`` ends it (a forward without gradients inside an
        open training step that holds nothing: as a step of its own)."""
        try:
            if torch.is_grad_enabled():
                self.end_evaluation()
                self._agree("training")
                self.sharded.begin_step()
                self.open = True
                return False
            if self.open:
                held = self.sharded.root_held
                self._agree("no_grad")
                self.sharded.begin_step(training=False)
                return not held
            if not self.evaluating:
                self._begin_evaluation()
            return False
        except BaseException as error:
            self._fail(error, close=False)
            raise

    def _begin_evaluation(self) -> None:
        """Begin a no-grad step (see [Note: Fabric steps])."""
        self.counts["evaluation"] += 1
        step = self.counts["evaluation"]

        sharded = self.sharded
        broadcasts = sharded.next_step_broadcasts_buffers

        def describe() -> str:
            first = f", {BROADCASTS_BUFFERS}" if broadcasts else ""
            return f"no-grad step {step} (forwards under no_grad outside a training step{first})"

        joined = sharded.stage3.joined if sharded.stage3 is not None else None
        if joined is None:  # stages 1 and 2: agreed only if it issues a collective
            agreement.defer_plain_step(sharded.comm, "no_grad", describe)
            sharded.begin_step(training=False)
        else:
            first = joined.step_first.name if joined.step_first is not None else ""
            served = agreement.begin_no_grad_step(sharded.comm, first, broadcasts, describe)
            with sharded.comm.forward_collectives() if served else nullcontext():
                sharded.begin_step(training=False)
        self.evaluating = True

    @torch.compiler.disable
    def _end_forward(self) -> None:
        self.sharded.end_step()

    @torch.compiler.disable
    def end_evaluation(self) -> None:
        """End the open no-grad step, if any: local (its units are freed, its sequence of collectives ends, a
        deferred one that issued none is dropped: nothing is exchanged)."""
        if self.evaluating:
            self.evaluating = False
            self.sharded.end_step()
            self.sharded.comm.end_sequence()

    @torch.compiler.disable
    def _fail(self, error: BaseException, close: bool) -> None:
        try:
            if close:
                self.sharded.end_step()
            self.end_evaluation()
        finally:
            if self.on_failure is not None:
                self.on_failure(error)

    def end(self) -> None:
        """End the open step, if any (after backward; before an optimizer step)."""
        self.end_evaluation()
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
