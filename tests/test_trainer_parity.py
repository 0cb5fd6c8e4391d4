"""Invariant 1 through a real Trainer: every stage trains exactly like DDPStrategy.

One process group per test runs DDP and the three stages on the same seed and data, case by case,
and compares every rank's per-step losses, the final parameters and buffers, the learning rates
left by the schedulers, and the gradient norm seen before clipping. Two ranks make most cases
bitwise equal (dividing by 2 is exact and a sum of two values does not depend on order); clipping
by norm (a norm summed in another order) and accumulation under stages 2 and 3 (micro-batches
reduced one by one) differ by rounding only, checked at 1e-6 relative.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

import lightning_zero  # noqa: F401  registers the strategy names
from lightning_zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy, ZeROStrategy
from tests.distributed import spawn
from tests.models import ParityNet, quiet_trainer

STRATEGIES = ("zero1", "zero2", "zero3", "zero3-per-layer")
# ParityNet has no repeated blocks, so the default units put it all in the root unit; "zero3-per-layer" keeps one
# unit per layer (the finest grain), so that gathers, releases and reductions per unit are compared too.
FACTORIES = {"zero3-per-layer": lambda: ZeRO3Strategy(unit_modules=[nn.Linear, nn.LayerNorm, nn.BatchNorm1d])}


class GradNormRecorder(Callback):
    """The global gradient norm before clipping, as a user would log it."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if isinstance(trainer.strategy, ZeROStrategy):
            norm = trainer.strategy.grad_norm(optimizer)
        else:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
        pl_module.log("grad_norm", norm)
        self.norms.append(norm.item())


def _train(strategy: Any, world_size: int, model_kwargs: dict, trainer_kwargs: dict) -> dict[str, Any]:
    L.seed_everything(0)
    model = ParityNet(**model_kwargs)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    recorder = GradNormRecorder()
    trainer = quiet_trainer(strategy=strategy, devices=world_size, max_steps=6, callbacks=[recorder], **trainer_kwargs)
    trainer.fit(model)
    return {
        "losses": model.losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "lrs": [g["lr"] for opt in trainer.optimizers for g in opt.param_groups],
        "grad_norms": recorder.norms,
        "trained": any(not torch.equal(v, model.state_dict()[k]) for k, v in initial.items()),
    }


def _compare(rank: int, world_size: int, cases: list[tuple]) -> None:
    for model_kwargs, trainer_kwargs, exact, *only in cases:
        ddp = _train(DDPStrategy(find_unused_parameters=True), world_size, model_kwargs, trainer_kwargs)
        assert ddp["trained"], "the reference did not train: the comparison would prove nothing"
        for name in only[0] if only else STRATEGIES:
            got = _train(FACTORIES[name]() if name in FACTORIES else name, world_size, model_kwargs, trainer_kwargs)
            where = f"{name} {model_kwargs} {trainer_kwargs} rank {rank}"
            assert len(got["losses"]) == len(ddp["losses"]), where
            assert got["lrs"] == ddp["lrs"], where
            if name in exact:
                assert got["losses"] == ddp["losses"], where
                for key, value in ddp["state"].items():
                    assert torch.equal(got["state"][key], value), f"{where}: {key}"
            else:
                torch.testing.assert_close(got["losses"], ddp["losses"], rtol=1e-6, atol=0, msg=where)
                for key, value in ddp["state"].items():
                    torch.testing.assert_close(got["state"][key], value, rtol=1e-6, atol=1e-7, msg=f"{where}: {key}")
            torch.testing.assert_close(got["grad_norms"], ddp["grad_norms"], rtol=1e-6, atol=0, msg=where)


ALL = set(STRATEGIES)
CASES = {
    "adamw-groups-step-scheduler-clip-norm": [
        ({"optimizer": "adamw", "param_groups": True, "scheduler": "step"}, {"gradient_clip_val": 0.5}, set()),
    ],
    "sgd-accumulate-clip-value-epoch-scheduler": [
        (
            {"optimizer": "sgd", "scheduler": "epoch"},
            {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05, "gradient_clip_algorithm": "value"},
            {"zero1"},
        ),
    ],
    "frozen-unused-batchnorm-tied-twice-called": [
        ({"optimizer": "sgd", "frozen": True, "unused": True, "batchnorm": True}, {}, ALL),
        ({"optimizer": "adamw", "frozen": True, "unused": True}, {"accumulate_grad_batches": 3}, {"zero1"}),
        # A layer used on rank 0 only: its gradient is rank 0's divided by the world size, as in DDP.
        ({"optimizer": "sgd", "rank_dependent": True}, {}, {"zero1", "zero2"}, ("zero1", "zero2")),
    ],
    "manual-optimization-two-optimizers-and-rmsprop": [
        ({"optimizer": "adagrad", "manual": True}, {}, ALL),
        ({"optimizer": "rmsprop", "param_groups": True}, {}, ALL),
    ],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_stage_matches_ddp(case: str) -> None:
    spawn(_compare, world_size=2, timeout=400, cases=CASES[case])


def test_single_device_matches_ddp() -> None:
    spawn(_compare, world_size=1, cases=[({"optimizer": "sgd", "param_groups": True}, {}, ALL)])


def _overlap_options(rank: int, world_size: int) -> None:
    """Prefetch depth, keeping stage-3 units gathered between forward and backward, and bucket sizes
    change when bytes move, never the result: bitwise equal to DDP, with the expected collectives."""
    model_kwargs: dict[str, Any] = {"optimizer": "adamw", "param_groups": True, "unused": True}
    ddp = _train(DDPStrategy(find_unused_parameters=True), world_size, model_kwargs, {})
    variants = {
        "prefetch=0": lambda: ZeRO3Strategy(prefetch=0),
        "prefetch=3": lambda: ZeRO3Strategy(prefetch=3),
        "reshard_after_forward=False": lambda: ZeRO3Strategy(reshard_after_forward=False),
        "bucket_size_mb=0 (a unit per module)": lambda: ZeRO2Strategy(bucket_size_mb=0),
        "bucket_size_mb=1e-4 (a few buckets)": lambda: ZeRO1Strategy(bucket_size_mb=1e-4),
    }
    for name, make in variants.items():
        got = _train(make(), world_size, model_kwargs, {})
        assert got["losses"] == ddp["losses"], name
        for key, value in ddp["state"].items():
            assert torch.equal(got["state"][key], value), f"{name}: {key}"


def test_overlap_options_match_ddp() -> None:
    spawn(_overlap_options, world_size=2, timeout=300)
