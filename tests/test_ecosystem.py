"""Lightning's ecosystem around the strategies: the registry, torchmetrics, and logged statistics."""

from __future__ import annotations

import csv
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torchmetrics
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

import lightning_zero
from lightning_zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy
from tests.distributed import spawn
from tests.models import VOCAB, ParityNet, quiet_trainer


def test_registry_lists_every_stage_and_preset_with_a_description() -> None:
    for stage, cls in ((1, ZeRO1Strategy), (2, ZeRO2Strategy), (3, ZeRO3Strategy)):
        for suffix, attribute, value in (
            ("", "checkpoint_format", "full"),
            ("_spawn", "start_method", "spawn"),
            ("_fork", "start_method", "fork"),
            ("_full_checkpoint", "checkpoint_format", "full"),
            ("_sharded_checkpoint", "checkpoint_format", "sharded"),
            ("_stats", "log_stats", True),
        ):
            name = f"zero{stage}{suffix}"
            assert f"ZeRO stage {stage}" in StrategyRegistry[name]["description"], name
            trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
            assert type(trainer.strategy) is cls and getattr(trainer.strategy, attribute) == value, name


def test_unknown_option_lists_the_valid_ones() -> None:
    with pytest.raises(TypeError, match=r"has no option 'chekpoint_format' \(did you mean 'checkpoint_format'\?\)"):
        lightning_zero.ZeRO3Strategy(chekpoint_format="full")
    with pytest.raises(TypeError, match="Valid options: unit_modules, broadcast_buffers"):
        lightning_zero.ZeRO1Strategy(stage=3)
    # A script written for FSDPStrategy (LitGPT's) is told what says the same here.
    with pytest.raises(TypeError, match=r"'state_dict_type' \(FSDPStrategy's; here: checkpoint_format='full' or"):
        lightning_zero.fabric.ZeRO3Strategy(state_dict_type="full")


class MetricNet(ParityNet):
    """Accuracy and a mean loss as torchmetrics modules, updated in training and validation steps."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.train_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=VOCAB, average="micro")
        self.val_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=VOCAB, average="micro")
        self.val_loss_mean = torchmetrics.MeanMetric()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        self.train_accuracy(logits.argmax(-1), y)
        self.log("train_acc", self.train_accuracy, on_step=False, on_epoch=True)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_accuracy(logits.argmax(-1), y)
        self.val_loss_mean(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))
        self.log("val_acc", self.val_accuracy)
        self.log("val_loss_mean", self.val_loss_mean)


def _metrics(rank: int, world_size: int) -> None:
    results = {}
    for name, strategy in (("ddp", DDPStrategy()), ("zero1", "zero1"), ("zero2", "zero2"), ("zero3", "zero3")):
        L.seed_everything(0)
        model = MetricNet()
        trainer = quiet_trainer(strategy=strategy, devices=world_size, max_epochs=1, limit_val_batches=2)
        trainer.fit(model)
        assert model.val_accuracy.device == trainer.strategy.root_device
        results[name] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert set(results["ddp"]) == {"train_acc", "val_acc", "val_loss_mean"}
    for name in ("zero1", "zero2", "zero3"):
        assert results[name] == results["ddp"], name


def test_torchmetrics_sync_like_ddp_under_every_stage() -> None:
    spawn(_metrics, world_size=2)


def _logged_stats(rank: int, world_size: int, directory: str) -> None:
    # Stage 3 with one unit per layer: under the default units ParityNet (no repeated blocks) is one root
    # unit, held for the step and gathered once.
    per_layer = ZeRO3Strategy(log_stats=True, unit_modules=[torch.nn.Linear, torch.nn.LayerNorm])
    for name, strategy in (("zero1_stats", "zero1_stats"), ("zero3_stats", per_layer)):
        trainer = quiet_trainer(
            strategy=strategy,
            devices=world_size,
            max_steps=3,
            logger=CSVLogger(directory, name=name, version=0),
            log_every_n_steps=1,
        )
        trainer.fit(ParityNet(optimizer="adamw"))


def test_log_stats_writes_communication_and_memory_to_the_loggers() -> None:
    with tempfile.TemporaryDirectory() as directory:
        spawn(_logged_stats, world_size=2, directory=directory)
        for name, gathers in (("zero1_stats", 1), ("zero3_stats", 2)):
            with open(Path(directory, name, "version_0", "metrics.csv")) as f:
                rows = [r for r in csv.DictReader(f) if r.get("zero/comm_bytes")]
            assert [int(r["step"]) for r in rows] == [0, 1, 2], name  # one row per optimizer step
            for row in rows:
                assert float(row["zero/reduce_scatter_bytes"]) > 0
                gathered, reduced = float(row["zero/all_gather_bytes"]), float(row["zero/reduce_scatter_bytes"])
                # Stage 1 gathers the updated parameters once (the reduce-scatters carry a few bytes more: one
                # flag per rank's chunk, see grad_flags.py); stage 3 gathers every unit at least once in forward and
                # again in backward (the root unit, held for the step, once).
                assert 0 < reduced - gathered < 1024 if gathers == 1 else gathered > 1.5 * reduced, name
                assert float(row["zero/comm_seconds_max"]) > 0
                assert float(row["zero/memory_optimizer_states_bytes"]) > 0
