"""Through a real Trainer on two processes: evaluation, full state dicts, checkpoints, examples, errors."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

import lightning_zero  # noqa: F401  registers the strategy names
from lightning_zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy, ZeROPrecision, ZeROStrategy
from lightning_zero.driver.checkpointing import consolidate
from lightning_zero.engine import UnsupportedOptimizerError
from lightning_zero.engine.core.memory import theory_bytes, theory_comm_bytes
from lightning_zero.engine.schedule.reduce import reduce_numel, reduce_width
from tests.distributed import spawn
from tests.models import ParityNet, quiet_trainer

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = ("zero1", "zero2", "zero3")


class FullStateAtTrainEnd(Callback):
    """The full state dict while the model is still sharded: ``strategy.full_state_dict()`` (what
    ``lightning_module_state_dict()`` hands the checkpoint writer has the same keys, in the same order)."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, ZeROStrategy):
            self.state = {k: v.clone() for k, v in strategy.full_state_dict().items()}
            assert list(strategy.lightning_module_state_dict()) == list(self.state)
        else:
            self.state = {k: v.clone() for k, v in strategy.lightning_module_state_dict().items()}


class ModelCalledFromCallback(Callback):
    """Calls the model between steps, as a sample-generation or EMA callback would."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        with torch.no_grad():
            self.outputs = [*getattr(self, "outputs", []), pl_module(torch.arange(12).view(2, 6) % 13)]


def _fit_and_evaluate(strategy: Any, world_size: int) -> dict[str, Any]:
    L.seed_everything(0)
    model = ParityNet(optimizer="sgd")
    snapshot, caller = FullStateAtTrainEnd(), ModelCalledFromCallback()
    trainer = quiet_trainer(
        strategy=strategy,
        devices=world_size,
        max_steps=4,
        limit_val_batches=2,
        val_check_interval=2,
        callbacks=[snapshot, caller],
    )
    trainer.fit(model)
    during_fit = float(trainer.callback_metrics["val_loss"])
    validated = trainer.validate(model, verbose=False)[0]["val_loss"]
    tested = trainer.test(model, verbose=False)[0]["test_loss"]
    predictions = torch.cat(trainer.predict(model))
    return {
        "val_during_fit": during_fit,
        "validate": validated,
        "test": tested,
        "predict": predictions,
        "state_in_fit": snapshot.state,
        "called_from_callback": torch.stack(caller.outputs),
        "state_after": {k: v.clone() for k, v in model.state_dict().items()},
    }


def _evaluation(rank: int, world_size: int) -> None:
    ddp = _fit_and_evaluate(DDPStrategy(), world_size)
    for name in STRATEGIES:
        got = _fit_and_evaluate(name, world_size)
        for key in ("val_during_fit", "validate", "test"):
            assert got[key] == ddp[key], (name, key)
        assert torch.equal(got["predict"], ddp["predict"]), name
        assert torch.equal(got["called_from_callback"], ddp["called_from_callback"]), name
        assert list(got["state_in_fit"]) == list(ddp["state_in_fit"]), name  # same keys, same order
        for key, value in ddp["state_in_fit"].items():
            assert torch.equal(got["state_in_fit"][key], value), (name, key)
            assert torch.equal(got["state_after"][key], value), (name, key)


def test_validate_test_predict_and_full_state_dict_match_ddp() -> None:
    spawn(_evaluation, world_size=2)


def _resume(rank: int, world_size: int, directory: str) -> None:
    for name in STRATEGIES:
        L.seed_everything(0)
        straight = ParityNet(optimizer="adamw", scheduler="step")
        quiet_trainer(strategy=name, devices=world_size, max_epochs=2).fit(straight)

        L.seed_everything(0)
        first = ParityNet(optimizer="adamw", scheduler="step")
        # Checkpoints written during training must not disturb it (the straight run writes none).
        saver = ModelCheckpoint(dirpath=f"{directory}/{name}-every-step", every_n_train_steps=1, save_top_k=-1)
        trainer = quiet_trainer(
            strategy=name, devices=world_size, max_epochs=1, enable_checkpointing=True, callbacks=[saver]
        )
        trainer.fit(first)
        path = trainer.strategy.broadcast(f"{directory}/{name}.ckpt")
        trainer.save_checkpoint(path)  # after fit: the module is plain again
        # Written by ModelCheckpoint during fit, by every rank in parallel while everything was sharded: must be
        # the same file content as the one saved from the plain module after fit.
        during = consolidate(f"{directory}/{name}-every-step/epoch=0-step=8.ckpt")
        after = torch.load(path, weights_only=True)
        for key, value in after["state_dict"].items():
            assert torch.equal(during["state_dict"][key], value), (name, key)
        for index, state in after["optimizer_states"][0]["state"].items():
            for key, value in state.items():
                assert torch.equal(during["optimizer_states"][0]["state"][index][key], value), (name, index, key)

        # A different init: everything must come from the checkpoint. (Not seed_everything, which would
        # also change the DistributedSampler's shuffling seed.)
        torch.manual_seed(1)
        second = ParityNet(optimizer="adamw", scheduler="step")
        quiet_trainer(strategy=name, devices=world_size, max_epochs=2).fit(second, ckpt_path=path)
        assert second.losses == straight.losses[8:], name
        for key, value in straight.state_dict().items():
            assert torch.equal(second.state_dict()[key], value), (name, key)

        # The file is what DDPStrategy writes: a full state dict and full per-parameter states.
        checkpoint = torch.load(path, weights_only=True)
        assert set(checkpoint["state_dict"]) == set(first.state_dict())
        params = list(first.parameters())
        for index, state in checkpoint["optimizer_states"][0]["state"].items():
            assert state["exp_avg"].shape == params[index].shape, name


def test_checkpoint_resume_continues_exactly() -> None:
    with tempfile.TemporaryDirectory() as directory:
        spawn(_resume, world_size=2, directory=directory)


def _errors(rank: int, world_size: int) -> None:
    with pytest.raises(UnsupportedOptimizerError, match="LBFGS cannot run on ZeRO shards"):
        quiet_trainer(strategy="zero2", devices=world_size, max_steps=1).fit(ParityNet(optimizer="lbfgs"))

    class NoParameters(ParityNet):
        def __init__(self) -> None:
            L.LightningModule.__init__(self)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            return None

        def configure_optimizers(self) -> None:
            return None

    with pytest.raises(ValueError, match="has no parameters"):
        quiet_trainer(strategy="zero3", devices=world_size, max_steps=1).fit(NoParameters())

    # Unfreezing and add_param_group during fit work (tests/test_callbacks.py); a tensor that is not a parameter of
    # the module cannot be stepped on shards, and says so at that optimizer's next step.
    class AddsForeignTensor(ParityNet):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == 1:
                self.trainer.optimizers[0].add_param_group({"params": [nn.Parameter(torch.zeros(3))]})

    with pytest.raises(ValueError, match="not a parameter of the LightningModule"):
        quiet_trainer(strategy="zero1", devices=world_size, max_steps=3).fit(AddsForeignTensor())

    # A parameter registered on the module after setup is named, with the way that works (register it frozen first).
    class RegistersLate(ParityNet):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == 1:
                self.late = nn.Parameter(torch.zeros(3))
                self.trainer.optimizers[0].add_param_group({"params": [self.late]})

    late = r"holds the parameter 'late', which was registered on the LightningModule after the strategy sharded it"
    with pytest.raises(ValueError, match=late):
        quiet_trainer(strategy="zero3", devices=world_size, max_steps=3).fit(RegistersLate())


def test_bad_optimizer_and_empty_model_fail_at_setup_on_every_rank() -> None:
    assert spawn(_errors, world_size=2, timeout=120) == [None, None]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"unit_modules": "Block"}, TypeError, "unit_modules must be a list"),
        ({"unit_modules": [42]}, TypeError, "entries must be nn.Module subclasses"),
        ({"broadcast_buffers": "yes"}, TypeError, "broadcast_buffers"),
        ({"process_group_backend": "carrier-pigeon"}, ValueError, "not a torch.distributed backend"),
        ({"timeout": 30}, ValueError, "timeout must be a positive datetime.timedelta"),
        ({"start_method": "teleport"}, ValueError, "start_method must be one of"),
        ({"checkpoint_format": "zip"}, ValueError, "checkpoint_format must be one of"),
        ({"log_stats": "often"}, TypeError, "log_stats must be True or False"),
        ({"nonfinite_grads": "pray"}, ValueError, "nonfinite_grads must be one of"),
        ({"collective_checks": "sometimes"}, ValueError, "collective_checks must be one of"),
    ],
)
def test_invalid_options_fail_at_construction(kwargs: dict, error: type, match: str) -> None:
    for cls in (ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy):
        with pytest.raises(error, match=match):
            cls(**kwargs)


def test_unsupported_precision_fails_at_trainer_construction() -> None:
    with pytest.raises(ValueError, match=r"support precision in .*DoublePrecision"):
        L.Trainer(strategy="zero3", accelerator="cpu", devices=2, precision="64-true", logger=False)
    with pytest.raises(ValueError, match=r"param_dtype='int8' is not a dtype"):
        ZeRO3Strategy(param_dtype="int8")
    with pytest.raises(TypeError, match="offload_optimizer must be True or False"):
        ZeRO2Strategy(offload_optimizer="yes")


def test_precision_reaches_the_strategy() -> None:
    for precision, dtype in (("bf16-mixed", torch.bfloat16), ("bf16-true", torch.bfloat16), ("32-true", None)):
        trainer = L.Trainer(strategy="zero3", accelerator="cpu", devices=2, precision=precision, logger=False)
        plugin = trainer.strategy.precision_plugin
        assert isinstance(plugin, ZeROPrecision) and plugin.precision == precision
        assert plugin.half_dtype == dtype


def test_strategies_are_registered_by_name() -> None:
    for name, cls in (("zero1", ZeRO1Strategy), ("zero2", ZeRO2Strategy), ("zero3", ZeRO3Strategy)):
        trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
        assert type(trainer.strategy) is cls


class _MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 16))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 16)), batch_size=4)


class _StepAccounting(Callback):
    """What one training step sends, counted from the end of one step to the end of the next, for the step before
    the last: stage 3 issues a step's first gathers at the end of the previous optimizer step (none after the last
    one), so each window between two batch ends but the last holds exactly one step's gathers (see [Note: gathers
    at the start of a batch])."""

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        trainer.strategy.sharded_model.comm.stats.reset()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        sharded = trainer.strategy.sharded_model
        if trainer.global_step == trainer.max_steps - 1:
            self.stats = sharded.comm.stats.as_dict()
            self.memory = sharded.memory_stats()
            self.units = [(u.layout.padded_numel, u.layout.shard_numel) for u in sharded.units]
            self.reduced = sum(reduce_numel(u) for u in sharded.units)  # with each chunk's slot and alignment
            self.chunks = sum(reduce_width(u.layout, u.reduce_dtype) for u in sharded.units)  # one rank's chunks
        sharded.comm.stats.reset()


def _accounting(rank: int, world_size: int) -> None:
    ring = (world_size - 1) / world_size
    for stage, name in ((1, "zero1"), (2, "zero2"), (3, "zero3")):
        accounting = _StepAccounting()
        model = _MLP()
        numel = sum(p.numel() for p in model.parameters())
        quiet_trainer(strategy=name, devices=world_size, max_steps=3, callbacks=[accounting]).fit(model)
        padded = sum(p for p, _ in accounting.units)
        shard = sum(s for _, s in accounting.units)
        stats, memory = accounting.stats, accounting.memory
        # Per step: one reduce-scatter per unit, one all-gather per unit (two under stage 3, except for the unit
        # that ends forward, which stays gathered for backward once the order is recorded), bytes as theory.
        kept = accounting.units[-1][0] if stage == 3 else 0  # net.2 ends this model's forward
        assert stats["reduce_scatter"]["calls"] == len(accounting.units)
        assert stats["all_gather"]["calls"] == len(accounting.units) * (2 if stage == 3 else 1) - (stage == 3)
        # One unused-parameter slot per rank's chunk (see grad_flags.py), and zeros that align each chunk to 16 bytes.
        slots = accounting.reduced - padded
        sent = stats["reduce_scatter"]["bytes_sent"] - slots * 4 * ring + stats["all_gather"]["bytes_sent"]
        assert sent == ((3 if stage == 3 else 2) * padded - kept) * 4 * ring
        assert (stage == 3 or sent >= theory_comm_bytes(stage, numel, world_size)) and sent <= theory_comm_bytes(
            stage, numel, world_size
        ) * padded / numel
        # Persistent model state per rank: theory up to shard padding, from the storage sizes.
        expected = theory_bytes(stage, numel, world_size)
        assert memory["params"] == (shard if stage == 3 else padded) * 4
        # (each gradient shard is a view of its reduction's chunk: with the slot and the alignment padding)
        assert memory["grads"] == accounting.chunks * 4 and memory["optimizer_states"] <= shard * 8
        assert expected.params <= memory["params"] <= expected.params + 4 * (padded - numel)
        assert expected.optimizer_states - 8 * (padded - numel) <= memory["optimizer_states"]


def test_step_communication_and_memory_through_trainer() -> None:
    spawn(_accounting, world_size=2)


def test_overlap_options_are_checked_at_construction() -> None:
    with pytest.raises(ValueError, match="bucket_size_mb applies to stages 1 and 2"):
        ZeRO3Strategy(bucket_size_mb=10)
    with pytest.raises(ValueError, match=r"bucket_size_mb must be a number of megabytes >= 0"):
        ZeRO1Strategy(bucket_size_mb=-1)
    with pytest.raises(ValueError, match="prefetch must be an integer >= 0"):
        ZeRO3Strategy(prefetch=-1)
    with pytest.raises(TypeError, match="reshard_after_forward must be True or False"):
        ZeRO3Strategy(reshard_after_forward="no")
    for options in ({"prefetch": 2}, {"reshard_after_forward": False}):
        with pytest.raises(ValueError, match="apply to stage 3"):
            ZeRO2Strategy(**options)
    assert ZeRO1Strategy().bucket_size_mb == 25.0 and ZeRO1Strategy(unit_modules=["Linear"]).bucket_size_mb is None
