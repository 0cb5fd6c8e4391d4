"""The Trainer's evaluation steps under ZeRO: each step agreed, the root unit held for its forward, and, under
stage 3, a rank that has run out of batches serving the gathers of the ranks still running (see [Note: uneven
evaluation] in ``strategies/agreement.py``).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from functools import partial
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT

from lightning_zero.engine.sharded_model import ShardedModel
from lightning_zero.strategies import agreement


class EvaluationSteps:
    """Mixed into ``ZeROStrategy`` before Lightning's ``ParallelStrategy``: its ``validation_step``, ``test_step``
    and ``predict_step`` and the loops' start hooks. The strategy provides ``sharded_model``, ``lightning_module``
    and the counters below.

    Example::

        class ZeROStrategy(ZeROOptions, EvaluationSteps, ProcessTopology, ParallelStrategy): ...
    """

    sharded_model: ShardedModel
    lightning_module: Any
    # The evaluation loop under way or last run since the last training step: its phase, and this rank's batches
    # in it so far; and the steps counted since setup, by phase.
    _evaluation: tuple[str, int] | None
    _steps: dict[str, int]

    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._eval_step():
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._eval_step():
            return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._eval_step():
            return super().predict_step(*args, **kwargs)

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._start_evaluation()

    def on_test_start(self) -> None:
        super().on_test_start()
        self._start_evaluation()

    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._start_evaluation()

    def _start_evaluation(self) -> None:
        """An evaluation loop starts: its steps count from 1 (see [Note: uneven evaluation])."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        self._evaluation = (_eval_phase(trainer), 0)

    @contextmanager
    def _eval_step(self) -> Generator[None, None, None]:
        """Around ``validation_step``, ``test_step``, ``predict_step``: see [Note: uneven evaluation] in
        ``strategies/agreement.py``."""
        sharded = self.sharded_model
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        phase = _eval_phase(trainer)
        step = (self._evaluation[1] if self._evaluation is not None else 0) + 1
        self._evaluation = (phase, step)
        trained = self._steps.get("training", 0)
        after = f"after {trained} training steps" if trained else "no training steps yet"
        joined = sharded.stage3 is not None  # only stage 3 gathers in forward
        agreement.begin_eval_step(sharded.comm, phase, step, lambda: f"{phase} step {step} ({after})", joined)
        with self._evaluation_forward():
            yield
        if not joined:
            sharded.comm.end_sequence()  # the next step may run on some ranks only
        elif _is_last_eval_batch(trainer):
            describe = partial(agreement.describe_serving, phase, step, after)
            served = agreement.serve_eval_steps(sharded.comm, phase, step, describe, self._replay_eval_forward)
            self._steps[f"{phase} served"] = self._steps.get(f"{phase} served", 0) + served  # since setup

    @contextmanager
    def _evaluation_forward(self) -> Generator[None, None, None]:
        sharded = self.sharded_model
        held_already = sharded.root_held  # validation in the middle of gradient accumulation keeps the hold
        sharded.begin_step(training=False)
        try:
            yield
        finally:
            if not held_already:
                sharded.end_step()

    def _replay_eval_forward(self) -> None:
        with self._evaluation_forward():
            self.sharded_model.replay_eval_forward()


_EVALUATION_LOOPS = {
    TrainerFn.VALIDATING: "validate_loop",
    TrainerFn.TESTING: "test_loop",
    TrainerFn.PREDICTING: "predict_loop",
}


def _is_last_eval_batch(trainer: Any) -> bool:
    """Whether the batch of the evaluation step under way is this rank's last of the loop (``False`` if unknown:
    a step that takes ``dataloader_iter``)."""
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    if fn == TrainerFn.FITTING:
        loop = trainer.fit_loop.epoch_loop.val_loop  # validation and the sanity check
    else:
        loop = getattr(trainer, _EVALUATION_LOOPS.get(fn, ""), None)
    return bool(getattr(getattr(loop, "batch_progress", None), "is_last_batch", False))


def _eval_phase(trainer: Any) -> str:
    stage = getattr(getattr(trainer, "state", None), "stage", None)
    value = getattr(stage, "value", "")
    return {"sanity_check": "sanity check", "validate": "validation", "test": "test", "predict": "predict"}.get(
        value, "validation"
    )
