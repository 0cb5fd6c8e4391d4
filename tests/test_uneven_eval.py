"""Evaluation with different numbers of batches per rank runs as under DDP (see [Note: uneven evaluation] in
``strategies/agreement.py``).

9 samples on 2 ranks in batches of 2: rank 0 gets 3 batches, rank 1 gets 2 (Lightning's own, unpadded predict
sampler; a per-rank slice with ``use_distributed_sampler=False`` for validation and test). Stages 1 and 2 need no
collective in evaluation; under stage 3 rank 1 serves rank 0's gathers for the third batch. Every case is compared
with ``DDPStrategy`` on the same seed: the same predictions on each rank (exactly), the same logged metrics. One
process group runs every case that ends cleanly; the stage-3 refusal that leaves a collective in flight gets its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset, Subset

from lightning_zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy
from lightning_zero.engine import CollectiveMismatchError
from lightning_zero.tools.processes import LeaveBroken
from tests.distributed import spawn
from tests.models import ParityNet, quiet_trainer, token_data

PER_LAYER = [torch.nn.Linear, torch.nn.LayerNorm, torch.nn.BatchNorm1d]
STRATEGIES = {
    "ddp": lambda: "ddp",
    "zero1": ZeRO1Strategy,
    "zero2": ZeRO2Strategy,
    "zero3": lambda: ZeRO3Strategy(unit_modules=PER_LAYER),
    "zero3 default units": lambda: "zero3",
}
BATCHES = {0: 3, 1: 2}  # per rank, for 9 samples in batches of 2


class UnevenNet(ParityNet):
    """``ParityNet`` whose evaluation data give rank 0 three batches and rank 1 two."""

    def _own_part(self, seed: int) -> DataLoader:  # with use_distributed_sampler=False: rank 0 5 samples, rank 1 4
        return DataLoader(Subset(token_data(9, seed=seed), range(self.global_rank, 9, 2)), batch_size=2)

    def val_dataloader(self) -> DataLoader:
        return self._own_part(seed=1)

    def test_dataloader(self) -> DataLoader:
        return self._own_part(seed=2)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(token_data(9, seed=3), batch_size=2)  # Lightning shards it, without padding

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True)  # reduced once, after the last batch, as under DDP
        self.log("val_loss_here", loss)  # this rank's own

    def test_step(self, batch: Any, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        self.log("test_loss_here", loss)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])  # the logits: compared exactly


class SyncedEveryBatch(UnevenNet):
    """Validation that reduces over ranks on every batch, which a rank that has run out of batches never joins."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True, on_step=True, on_epoch=False)


class Stream(IterableDataset):
    """Samples without a length (Lightning accepts an empty stream, where it refuses an empty sized loader)."""

    def __init__(self, samples: Any) -> None:
        self.samples = samples

    def __iter__(self) -> Iterator[Any]:
        return iter(self.samples)


class NoBatchOnRank1(UnevenNet):
    """Rank 1's validation stream is empty: its loop ends before any batch. Nothing is synced."""

    def val_dataloader(self) -> DataLoader:
        data = token_data(9, seed=1)
        return DataLoader(Stream([data[i] for i in range(9)] if self.global_rank == 0 else []), batch_size=2)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss_here", self._loss(batch))


class Record(L.Callback):
    """What each run did on this rank: metrics after every validation loop, gathers issued, steps served."""

    def __init__(self) -> None:
        self.validations: list[dict[str, float]] = []
        self.gathers: int | None = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.validations.append({k: float(v) for k, v in sorted(trainer.callback_metrics.items())})

    def _count(self, trainer: L.Trainer) -> None:
        driver = getattr(trainer.strategy, "driver", None)  # None under DDPStrategy
        sharded = driver.sharded if driver is not None else None
        if sharded is not None:
            self.gathers = sharded.comm.stats.calls("all_gather")

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._count(trainer)


def _model(**kwargs: Any) -> UnevenNet:
    torch.manual_seed(0)
    return UnevenNet(optimizer="sgd", **kwargs)


def _own_data_trainer(strategy: Any, world_size: int, **kwargs: Any) -> L.Trainer:
    """A Trainer that leaves each rank its own evaluation data (``UnevenNet._own_part``)."""
    return quiet_trainer(
        strategy=strategy, devices=world_size, use_distributed_sampler=False, limit_val_batches=1.0, **kwargs
    )


def _validate_outcome(trainer: L.Trainer, model: L.LightningModule) -> dict[str, Any]:
    """What ``trainer.validate(model)`` raised on this rank (a ``CollectiveMismatchError`` or nothing), and how
    long it took."""
    started = time.monotonic()
    try:
        trainer.validate(model)
        error: BaseException | None = None
    except CollectiveMismatchError as caught:
        error = caught
    return {
        "type": None if error is None else type(error).__name__,
        "message": "" if error is None else str(error),
        "seconds": time.monotonic() - started,
    }


def _served(trainer: L.Trainer, phase: str) -> int:
    return getattr(trainer.strategy, "_steps", {}).get(f"{phase} served", 0)


def _runs(rank: int, world_size: int) -> dict[str, Any]:
    """Every case that ends cleanly, under DDP and each stage; one process group for all."""
    results: dict[str, Any] = {}
    for name, make in STRATEGIES.items():
        record = Record()
        trainer = quiet_trainer(strategy=make(), devices=world_size, callbacks=[record])
        predictions = trainer.predict(_model())
        results[f"{name}: predict"] = {
            "batches": len(predictions),
            "predictions": [p.tolist() for p in predictions],
            "served": _served(trainer, "predict"),
            "gathers": record.gathers,
        }

        trainer = _own_data_trainer(make(), world_size)
        (validated,) = trainer.validate(_model())
        results[f"{name}: validate"] = {"metrics": validated, "served": _served(trainer, "validation")}
        trainer = _own_data_trainer(make(), world_size)
        (tested,) = trainer.test(_model())
        results[f"{name}: test"] = {"metrics": tested, "served": _served(trainer, "test")}

        # Validation inside fit, twice, with the sanity check; BatchNorm buffers are broadcast at the first
        # validation batch after training (as DDP does), which under stages 1 and 2 agrees on that batch.
        record = Record()
        model = _model(batchnorm=True)
        trainer = _own_data_trainer(
            make(), world_size, max_epochs=2, limit_train_batches=3, num_sanity_val_steps=2, callbacks=[record]
        )
        trainer.fit(model)
        results[f"{name}: fit"] = {
            "losses": model.losses,
            "validations": record.validations,
            "params": [p.detach().clone() for p in model.parameters()],
            "served": _served(trainer, "validation"),
        }

        # A rank with no validation batch at all: stages 1 and 2 run it as DDP does; stage 3 refuses at once.
        trainer = _own_data_trainer(make(), world_size)
        results[f"{name}: no batch on rank 1"] = _validate_outcome(trainer, NoBatchOnRank1(optimizer="sgd"))
        if name in ("zero1", "zero2"):  # a per-batch synced log on uneven data: refused at once (DDP fails later)
            trainer = _own_data_trainer(make(), world_size)
            results[f"{name}: synced every batch"] = _validate_outcome(trainer, SyncedEveryBatch(optimizer="sgd"))
    return results


def _assert_close(actual: Any, expected: Any, case: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-7, msg=lambda m: f"{case}: {m}")


def test_uneven_evaluation_runs_as_under_ddp() -> None:
    results = spawn(_runs, world_size=2, timeout=600)
    for rank, here in enumerate(results):
        ddp_predict = here["ddp: predict"]
        assert ddp_predict["batches"] == BATCHES[rank], ddp_predict
        for name in STRATEGIES:
            if name == "ddp":
                continue
            predict = here[f"{name}: predict"]
            assert predict["batches"] == BATCHES[rank], (name, rank, predict["batches"])
            assert predict["predictions"] == ddp_predict["predictions"], (name, rank)  # exactly
            for phase in ("validate", "test"):
                metrics, expected = here[f"{name}: {phase}"]["metrics"], here[f"ddp: {phase}"]["metrics"]
                assert metrics.keys() == expected.keys(), (name, phase, metrics, expected)
                _assert_close(metrics, expected, f"{name} {phase} rank {rank}")
            fit, ddp_fit = here[f"{name}: fit"], here["ddp: fit"]
            _assert_close(fit["losses"], ddp_fit["losses"], f"{name} fit losses rank {rank}")
            assert len(fit["validations"]) == len(ddp_fit["validations"]) == 3, fit["validations"]  # sanity + 2
            _assert_close(fit["validations"], ddp_fit["validations"], f"{name} fit validations rank {rank}")
            _assert_close(fit["params"], ddp_fit["params"], f"{name} fit parameters rank {rank}")
            # Stage 3: rank 1 served rank 0's third batch in each loop; stages 1 and 2 need no serving.
            served = 1 if "zero3" in name and rank == 1 else 0
            assert predict["served"] == served, (name, rank, predict)
            assert here[f"{name}: validate"]["served"] == here[f"{name}: test"]["served"] == served, (name, rank)
            assert fit["served"] == 2 * served, (name, rank, fit["served"])  # two validations (the sanity check: even)
        # The synced value is the same on both ranks, each rank's own differs (rank 1 has no third batch).
        assert here["ddp: validate"]["metrics"]["val_loss"] == results[0]["ddp: validate"]["metrics"]["val_loss"]
    assert (
        results[0]["ddp: validate"]["metrics"]["val_loss_here"]
        != results[1]["ddp: validate"]["metrics"]["val_loss_here"]
    )
    for name in ("zero3", "zero3 default units"):  # every rank issued the same gathers
        assert results[0][f"{name}: predict"]["gathers"] == results[1][f"{name}: predict"]["gathers"], name

    for name in STRATEGIES:
        outcomes = [r[f"{name}: no batch on rank 1"] for r in results]
        if "zero3" not in name:
            assert all(o["type"] is None for o in outcomes), (name, outcomes)
            continue
        for outcome in outcomes:
            assert outcome["type"] == CollectiveMismatchError.__name__ and outcome["seconds"] < 60, (name, outcome)
        message = outcomes[0]["message"]
        assert "rank 0: start validation step 1 (no training steps yet)" in message, message
        assert "rank 1: teardown at the end of trainer.validate(), after this rank's 0 validation batches" in message
        assert "different numbers of validation batches" in message and "no validation batch at all" in message
        assert "use stage 1 or 2" not in message and "sampler must give" not in message, message

    for name in ("zero1", "zero2"):
        outcomes = [r[f"{name}: synced every batch"] for r in results]
        for outcome in outcomes:
            assert outcome["type"] == CollectiveMismatchError.__name__, (name, outcome)
            assert outcome["seconds"] < 60, outcome
        message = outcomes[0]["message"]
        assert "rank 0: start validation step 3 (no training steps yet)" in message, message
        assert "rank 1: teardown at the end of trainer.validate(), after this rank's 2 validation batches" in message
        assert "different numbers of validation batches" in message and "Stages 1 and 2 run that as DDP" in message
        assert "use stage 1 or 2" not in message and "sampler must give" not in message, message


def _synced_every_batch_under_stage3(rank: int, world_size: int) -> LeaveBroken:
    trainer = _own_data_trainer(ZeRO3Strategy(unit_modules=PER_LAYER), world_size)
    started = time.monotonic()
    try:
        trainer.validate(SyncedEveryBatch(optimizer="sgd"))
        outcome = {"type": None, "message": ""}
    except Exception as error:  # rank 0 may see the peer's closed connection, with the verdict appended
        outcome = {"type": type(error).__name__, "message": str(error)}
    outcome["seconds"] = time.monotonic() - started
    return LeaveBroken(outcome)  # the reduce rank 0 waited in is still in flight


def test_stage3_refuses_a_per_batch_collective_that_a_finished_rank_cannot_serve() -> None:
    outcomes = spawn(_synced_every_batch_under_stage3, world_size=2, timeout=120)
    assert any(o["type"] == CollectiveMismatchError.__name__ for o in outcomes), outcomes
    for outcome in outcomes:
        assert outcome["seconds"] < 60, outcome
        message = outcome["message"]
        assert 'rank 0: all_reduce of "Lightning\'s reduce (self.log(..., sync_dist=True))"' in message, message
        assert "collective" in message and "of validation step 3" in message, message
        # Rank 0's reduce is agreed (the first collective after its forward: see [Note: joined forwards] in
        # engine/schedule/joined.py), so it meets rank 1's agreement at once.
        assert (
            "rank 1: start validation step 4 (no training steps yet; this "
            "rank's 2 validation batches are done: it serves the gathers of the ranks still running)" in message
        ), message
        assert "keeps serving the parameter gathers" in message and "use stage 1 or 2" not in message, message
