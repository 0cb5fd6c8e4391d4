"""What ``DDPStrategy`` does to a model besides averaging gradients, checked under every stage.

Each case runs a real ``Trainer`` on 2 CPU ranks under ``DDPStrategy`` and under each stage, and every rank
compares its own results with its own DDP run: losses, validation losses, parameters and buffers (so a
rank whose BatchNorm statistics drift from DDP's is caught, not only rank 0). The rows of the table in
``docs/parity.md`` name these cases.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelPruning
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import grad_norm

from lightning_zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy
from lightning_zero.engine.errors import ShardedGradientError
from tests.distributed import spawn
from tests.models import quiet_trainer
from tests.test_callbacks import FinetuneNet

STAGES = {"zero1": ZeRO1Strategy, "zero2": ZeRO2Strategy, "zero3": ZeRO3Strategy}


class LogsGradNorm(FinetuneNet):
    """Lightning's documented recipe for logging gradient norms."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log_dict(grad_norm(self, norm_type=2))


class HooksAtBatchStart(FinetuneNet):
    """What a user's ``on_train_batch_start`` may do: give a weight new values by rebinding its ``.data`` (as
    pruning does), and end the epoch early by returning -1. Stage 3 has the step's first gathers in flight
    while it runs (see [Note: gathers at the start of a batch])."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        if self.current_epoch == 0 and batch_idx == 1:
            self.head.weight.data = torch.full_like(self.head.weight, 0.01)
        return -1 if self.current_epoch == 0 and batch_idx == 2 else None


class LayerTypes(Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.types = sorted({type(m).__name__ for m in pl_module.modules()})


def _pruning(model: FinetuneNet, lottery: bool) -> list[Callback]:
    targets = [(model.backbone[0], "weight"), (model.backbone[3], "weight"), (model.head, "weight")]
    return [
        ModelPruning(
            "l1_unstructured",
            parameters_to_prune=targets,
            amount=0.3,
            use_lottery_ticket_hypothesis=lottery,
            verbose=0,
        )
    ]


# name: (model class and kwargs, callbacks(model), trainer kwargs)
CASES: dict[str, tuple[Any, dict, Any, dict]] = {
    "model_pruning": (FinetuneNet, {}, lambda m: _pruning(m, lottery=False), {"max_epochs": 3}),
    "model_pruning_lottery_ticket": (FinetuneNet, {}, lambda m: _pruning(m, lottery=True), {"max_epochs": 3}),
    "batchnorm_with_validation": (
        FinetuneNet,
        # SGD: the bias before BatchNorm has an exactly-zero true gradient, which Adam would turn into rounding noise
        # steps (docs/parity.md); the accumulation makes stages 2 and 3 reduce in another order than DDP.
        {"batchnorm": True, "sgd": True},
        lambda m: [],
        {"max_epochs": 2, "limit_val_batches": 2, "accumulate_grad_batches": 2},
    ),
    "sync_batchnorm": (
        FinetuneNet,
        {"batchnorm": True},
        lambda m: [LayerTypes()],
        {"max_epochs": 1, "sync_batchnorm": True},
    ),
    "grad_norm_utility": (LogsGradNorm, {}, lambda m: [], {"max_epochs": 1}),
    "hooks_at_batch_start": (HooksAtBatchStart, {}, lambda m: [], {"max_epochs": 2}),
}


def _train(case: str, strategy: Any, world_size: int) -> dict[str, Any]:
    model_class, model_kwargs, make_callbacks, trainer_kwargs = CASES[case]
    L.seed_everything(0)
    model = model_class(**model_kwargs)
    callbacks = make_callbacks(model)
    kwargs: dict[str, Any] = {"limit_train_batches": 4, "limit_val_batches": 0, "use_distributed_sampler": False}
    kwargs.update(trainer_kwargs)
    trainer = quiet_trainer(devices=world_size, strategy=strategy, callbacks=callbacks, **kwargs)
    try:
        trainer.fit(model)
    except Exception as error:  # the outcome to compare: DDP's and the stage's must be the same kind
        return {"error": type(error).__name__, "message": str(error)}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    result: dict[str, Any] = {
        "losses": model.losses,
        "val_losses": model.val_losses,
        "params": params,
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "zeros": sum(int((p == 0).sum()) for p in params.values()),
    }
    for callback in callbacks:
        if isinstance(callback, LayerTypes):
            result["layer_types"] = callback.types
    return result


def _compare(rank: int, world_size: int, cases: list[str]) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for case in cases:
        want = _train(case, DDPStrategy(find_unused_parameters=True), world_size)
        for name, strategy in STAGES.items():
            got = _train(case, strategy(), world_size)
            where = f"{case}/{name} (rank {rank})"
            if case == "grad_norm_utility":
                # DDP logs the norms of its full gradients; under ZeRO the module's .grad is a marker, and reading
                # it says what to call instead, on every rank.
                assert "error" not in want, where
                assert got.get("error") == ShardedGradientError.__name__, (where, got)
                assert "trainer.strategy.grad_norm()" in got["message"], where
                continue
            if "error" in want:  # e.g. SyncBatchNorm on CPU: the same refusal as DDP's, at setup
                assert got.get("error") == want["error"], (where, got, want)
                assert got["message"].startswith(want["message"]), (where, got["message"], want["message"])
                continue
            assert "error" not in got, (where, got)
            # Bitwise, except that stages 2 and 3 reduce each micro-batch of gradient accumulation on its own (DDP
            # and stage 1 reduce their sum): a rounding apart, then amplified a little by training.
            tol = 1e-5 if name != "zero1" and CASES[case][3].get("accumulate_grad_batches", 1) > 1 else 0.0
            close = {"rtol": tol, "atol": tol}
            torch.testing.assert_close(got["losses"], want["losses"], **close, msg=where)
            torch.testing.assert_close(got["val_losses"], want["val_losses"], **close, msg=where)
            assert got["zeros"] == want["zeros"], where
            assert got.get("layer_types") == want.get("layer_types"), where
            for kind in ("params", "buffers"):
                assert got[kind].keys() == want[kind].keys(), (where, kind)
                for key, value in want[kind].items():
                    torch.testing.assert_close(got[kind][key], value, **close, msg=f"{where} {kind} {key}")
            report[where] = {"zeros": got["zeros"], "outcome": "error" if "error" in want else "trained"}
    return report


def test_what_ddp_does_to_the_model_every_stage_does_too() -> None:
    reports = spawn(_compare, world_size=2, cases=list(CASES), timeout=400)
    # Pruning really pruned (the comparison above is with DDP's own fraction of zeros).
    assert reports[0]["model_pruning/zero3 (rank 0)"]["zeros"] > 0
