"""Ranks that take different paths get a clear error in seconds, or train as DDP would; never a hang.

Each case runs through a real ``Trainer`` on 2 CPU ranks, well inside a wall-clock limit far under
the process group's 30-minute default timeout. The cases that end in an agreement (see [Note:
agreements] in ``engine/comm/control.py``) leave the process group usable, so they share one pair of
processes; the cases that leave a collective in flight (one rank on the recorded track, the other
off it, or a rank that failed) get a pair each, which exits without a final barrier.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy
from lightning_zero.engine import CollectiveMismatchError
from lightning_zero.engine.errors import PeerFailureError
from lightning_zero.tools.processes import LeaveBroken
from tests.distributed import spawn
from tests.models import ParityNet, quiet_trainer, token_data

STAGES = {"zero1": ZeRO1Strategy, "zero2": ZeRO2Strategy, "zero3": ZeRO3Strategy}
PER_LAYER = [torch.nn.Linear, torch.nn.LayerNorm]
LIMIT = 60.0  # seconds any case may take, on a loaded 2-core machine (the default timeout is 1800)


def _strategy(stage: str) -> Any:
    return STAGES[stage](unit_modules=PER_LAYER) if stage == "zero3" else STAGES[stage]()


def _outcome(trainer: L.Trainer, model: L.LightningModule) -> dict[str, Any]:
    """``trainer.fit(model)``: how long it took and what it raised (on this rank)."""
    started = time.monotonic()
    try:
        trainer.fit(model)
        error: BaseException | None = None
    except (Exception, SystemExit) as caught:  # what each rank sees (Lightning's SIGTERMException is a SystemExit)
        error = caught
    return {
        "seconds": time.monotonic() - started,
        "global_step": trainer.global_step,
        "type": None if error is None else type(error).__name__,
        "message": "" if error is None else str(error),
    }


class UnevenSampler(torch.utils.data.Sampler):
    """A custom sampler (``use_distributed_sampler=False``) that gives rank 1 two batches fewer."""

    def __init__(self, n: int, rank: int) -> None:
        self.indices = list(range(rank, n, 2))[: None if rank == 0 else -8]

    def __iter__(self) -> Any:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class UnevenData(ParityNet):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_data(64), batch_size=4, sampler=UnevenSampler(64, self.global_rank))


class CalledMoreOnRank1(ParityNet):
    """A submodule called a data-dependent number of times, different per rank (from step ``at`` on)."""

    def __init__(self, at: int = 0) -> None:
        super().__init__(optimizer="sgd")
        self.at = at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) * self.scale
        calls = 3 if self.global_rank == 1 and self.global_step >= self.at else 2
        for _ in range(calls):
            h = h + self.down(torch.relu(self.up(h)))
        return self.head(self.norm(h))


class NoGradOnRank1(ParityNet):
    """Rank 1 runs one batch's forward under ``torch.no_grad()`` (its loss then comes from the scale only)."""

    def __init__(self, at: int = 0) -> None:
        super().__init__(optimizer="sgd")
        self.at = at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1 and batch_idx == self.at:
            with torch.no_grad():
                logits = self(batch[0])
            return logits.sum() * 0 + self.scale.sum() * 0 + self.up.bias.sum() * 0
        return self._loss(batch)


class SaveOnRank0Only(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.is_global_zero and trainer.global_step == 2:
            trainer.save_checkpoint(self.path)


# Longer than a line (and than 300 characters): the other ranks are told it whole, to its last word.
FAILURE = "rank 1's training_step divided by zero at batch 3, " + "and went on explaining why, " * 12 + "to its end."


class FailsOnRank1(ParityNet):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1 and batch_idx == 3:
            raise ZeroDivisionError(FAILURE)
        return super().training_step(batch, batch_idx)


class DirectReduceOnRank0(L.Callback):
    """A ``torch.distributed`` collective that only rank 0 calls (as a metric synced on one rank would)."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.is_global_zero and trainer.global_step == 2:
            torch.distributed.all_reduce(torch.ones(3))


class DirectReduceOnRank1(L.Callback):
    """The same on rank 1, while rank 0, which hosts the rendezvous store, waits in the next step's agreement."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 2:
            torch.distributed.all_reduce(torch.ones(3))


class ReadOnRank0Only(L.Callback):
    """Reads a stage-3 parameter's values on rank 0 only (``if trainer.is_global_zero: print(...)``): under stage 3 a
    collective that rank 1 does not make."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.is_global_zero and trainer.global_step == 2:
            float(pl_module.up.weight.detach().sum())


class ReadOnRank0AtTrainEnd(L.Callback):
    """The same read in ``on_train_end``, once the training loop has ended, while rank 1 goes on to the teardown."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            float(pl_module.up.weight.detach().sum())


class SigtermOnRank1(L.Callback):
    """Rank 1 receives a real SIGTERM (handled by the handlers Lightning registered) after step 2."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)


class Watched(torch.utils.data.Dataset):
    """``token_data`` that records, at every item fetched, whether the strategy's step agreement is in flight."""

    def __init__(self, strategy: Any, seen: list[bool]) -> None:
        self.data, self.strategy, self.seen = token_data(64), strategy, seen

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        self.seen.append(self.strategy._step_agreement.in_flight)
        return self.data[index]


class FetchedWhileAgreeing(ParityNet):
    """Records whether the step agreement is in flight while its batch is fetched, and settled at the batch's
    first hook (see [Note: the start of a training batch])."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.fetching: list[bool] = []
        self.at_batch_start: list[bool] = []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Watched(self.trainer.strategy, self.fetching), batch_size=4)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.at_batch_start.append(self.trainer.strategy._step_agreement.in_flight)


def _frozen_on_rank1(whole_layer: bool) -> ParityNet:
    model = ParityNet(optimizer="sgd")
    if torch.distributed.get_rank() == 1:
        (model.up if whole_layer else model.up.bias).requires_grad_(False)
    return model


def _agreements(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """The cases that end in an agreement: one process group for all of them."""
    results: dict[str, Any] = {}
    for stage in STAGES:
        for name, whole in (("one tensor frozen on rank 1", False), ("a layer frozen on rank 1", True)):
            model = _frozen_on_rank1(whole)
            trainer = quiet_trainer(strategy=_strategy(stage), devices=world_size, max_steps=2)
            results[f"{stage}: {name}"] = _outcome(trainer, model)
        model = UnevenData(optimizer="sgd")
        trainer = quiet_trainer(
            strategy=_strategy(stage), devices=world_size, max_epochs=1, use_distributed_sampler=False
        )
        results[f"{stage}: uneven batches"] = _outcome(trainer, model)
        path = Path(directory, f"{stage}-rank0-only.ckpt")
        trainer = quiet_trainer(
            strategy=_strategy(stage), devices=world_size, max_steps=4, callbacks=[SaveOnRank0Only(str(path))]
        )
        results[f"{stage}: save on rank 0 only"] = _outcome(trainer, ParityNet(optimizer="sgd"))
        results[f"{stage}: save on rank 0 only"]["written"] = sorted(p.name for p in Path(directory).iterdir())
        if stage != "zero3":  # well defined without stage 3 (as DDP with find_unused_parameters=True): trains
            for name, model in (
                ("more calls on rank 1", CalledMoreOnRank1()),
                ("no_grad forward on rank 1", NoGradOnRank1(at=1)),
            ):
                trainer = quiet_trainer(strategy=_strategy(stage), devices=world_size, max_steps=3)
                results[f"{stage}: {name}"] = _outcome(trainer, model)
        model = FetchedWhileAgreeing()
        trainer = quiet_trainer(strategy=_strategy(stage), devices=world_size, max_steps=4)
        results[f"{stage}: agreement in flight during the fetch"] = _outcome(trainer, model)
        results[f"{stage}: agreement in flight during the fetch"].update(
            fetching=model.fetching, at_batch_start=model.at_batch_start
        )
    # Lightning stops every rank when one receives SIGTERM; the flag travels in the step agreement (waited for
    # after the fetch, under stage 3 at once before the first batch, which no optimizer step precedes).
    for stage in ("zero2", "zero3"):
        trainer = quiet_trainer(
            strategy=_strategy(stage), devices=world_size, max_steps=6, callbacks=[SigtermOnRank1()]
        )
        results[f"{stage}: SIGTERM on rank 1"] = _outcome(trainer, ParityNet(optimizer="sgd"))
    trainer = quiet_trainer(strategy=_strategy("zero3"), devices=world_size, max_steps=4, callbacks=[ReadOnRank0Only()])
    results["zero3: parameter read on rank 0 only"] = _outcome(trainer, ParityNet(optimizer="sgd"))
    trainer = quiet_trainer(
        strategy=_strategy("zero3"), devices=world_size, max_steps=2, callbacks=[ReadOnRank0AtTrainEnd()]
    )
    results["zero3: parameter read on rank 0 only, in on_train_end"] = _outcome(trainer, ParityNet(optimizer="sgd"))
    return results


def test_ranks_that_disagree_on_steps_saves_or_trainable_sets_fail_fast_or_train(tmp_path: Path) -> None:
    started = time.monotonic()
    results = spawn(_agreements, world_size=2, timeout=600, directory=str(tmp_path))
    for case in results[0]:
        outcomes = [r[case] for r in results]
        for rank, outcome in enumerate(outcomes):
            assert outcome["seconds"] < LIMIT, (case, rank, outcome)
        if "more calls" in case or "no_grad" in case:
            assert all(o["type"] is None for o in outcomes), (case, outcomes)
            continue
        if "in flight" in case:
            for outcome in outcomes:
                assert outcome["type"] is None and outcome["at_batch_start"] == [False] * 4, (case, outcome)
                # Each batch is fetched while its agreement travels; under stage 3 batch 0's waited at once, its
                # first gathers issued on the answer (no optimizer step precedes it).
                first = 4 if case.startswith("zero3") else 0
                assert outcome["fetching"] == [False] * first + [True] * (16 - first), (case, outcome["fetching"])
            continue
        if "SIGTERM" in case:  # as under DDP: every rank raises SIGTERMException before step 3's batch
            assert all(o["type"] == "SIGTERMException" and o["global_step"] == 2 for o in outcomes), outcomes
            continue
        for rank, outcome in enumerate(outcomes):
            assert outcome["type"] == "CollectiveMismatchError", (case, rank, outcome)
            assert "rank 0:" in outcome["message"] and "rank 1:" in outcome["message"], (case, outcome)
        message = outcomes[0]["message"]
        if "on_train_end" in case:  # after the last step: named by the hook, not as a collective of that step
            assert "(a read of up.weight outside its forward)" in message, message
            assert "elements, in on_train_end, after the training loop)" in message, message
            assert "of training step" not in message, message
            assert "rank 1: teardown at the end of trainer.fit()" in message, message
            assert "This collective was issued in on_train_end" in message and "batches" not in message, message
        elif "frozen" in case:
            assert "setup with" in message and "frozen: 'up." in message and "requires_grad" in message, message
        elif "read" in case:  # the read is a gather that rank 1 never joins: named, and where rank 1 was
            assert "(a read of up.weight outside its forward)" in message and "rank 1: start training step 3" in message
        elif "uneven" in case:
            assert "rank 0: start training step 7" in message and "same number of batches" in message, message
        else:  # a save that rank 1 never joins: named, and nothing written
            assert "rank 0: save_checkpoint(" in message and "rank 1: start training step 3" in message, message
            assert "call it on every rank" in message
            assert outcomes[0]["written"] == [], outcomes[0]
    assert time.monotonic() - started < 600


def _one_case(rank: int, world_size: int, case: str, stage: str) -> LeaveBroken:
    if case == "more calls":
        model: ParityNet = CalledMoreOnRank1(at=2)
    elif case == "no_grad":
        model = NoGradOnRank1(at=2)
    elif case == "fails":
        model = FailsOnRank1(optimizer="sgd")
    else:
        model = ParityNet(optimizer="sgd")
    callbacks = {"direct": [DirectReduceOnRank0()], "direct on rank 1": [DirectReduceOnRank1()]}.get(case, [])
    trainer = quiet_trainer(strategy=_strategy(stage), devices=world_size, max_steps=6, callbacks=callbacks)
    return LeaveBroken(_outcome(trainer, model))


@pytest.mark.parametrize(
    ("case", "stage"),
    [
        ("more calls", "zero3"),
        ("no_grad", "zero3"),
        ("fails", "zero1"),
        ("fails", "zero2"),
        ("fails", "zero3"),
        ("direct", "zero2"),
        ("direct on rank 1", "zero1"),
    ],
)
def test_ranks_that_part_ways_inside_a_step_fail_fast_naming_them(case: str, stage: str) -> None:
    # A TCPStore hosted by rank 0, as under torchrun and Lightning's launchers: it ends with rank 0's process.
    outcomes = spawn(_one_case, world_size=2, timeout=120, rendezvous="tcp", case=case, stage=stage)
    for rank, outcome in enumerate(outcomes):
        assert outcome["seconds"] < LIMIT, (rank, outcome)
    if case == "fails":
        assert outcomes[1]["type"] == "ZeroDivisionError", outcomes
        # Rank 0 either stops waiting when rank 1 reports its failure (PeerFailureError), or sees rank 1's
        # connection close first; either way its error says what happened on rank 1.
        assert outcomes[0]["type"] in (PeerFailureError.__name__, "RuntimeError"), outcomes
        assert f"rank 1 failed with ZeroDivisionError: {FAILURE}" in outcomes[0]["message"], outcomes
        return
    if case == "direct on rank 1":
        # Rank 0 finds the deadlock and hosts the store: it stays until rank 1's monitor has read the verdict, so
        # rank 1, the rank at fault, is told why its call failed (the verdict, not a bare "Connection closed").
        assert outcomes[0]["type"] == CollectiveMismatchError.__name__, outcomes
        for outcome in outcomes:
            assert "rank 1: torch.distributed.all_reduce, called from" in outcome["message"], outcomes
            assert "rank 0: waiting for the other ranks to agree on: start training step 3" in outcome["message"]
        return
    if case == "direct":
        # Rank 1 waits in the next step's agreement and names rank 0, blocked in a collective this library does
        # not issue; rank 0's call then fails on the closed connection, with the same diagnosis appended.
        assert outcomes[1]["type"] == CollectiveMismatchError.__name__, outcomes
        for outcome in outcomes:
            assert "rank 0: torch.distributed.all_reduce, called from" in outcome["message"], outcomes
            assert "rank 1: waiting for the other ranks to agree on: start training step 3" in outcome["message"]
        return
    for rank, outcome in enumerate(outcomes):
        assert outcome["type"] == CollectiveMismatchError.__name__, (rank, outcome)
        assert "rank 0:" in outcome["message"] and "rank 1:" in outcome["message"], (rank, outcome)


def _gathered_agreements(rank: int, world_size: int) -> LeaveBroken:
    """At three ranks an agreement is a gather and a broadcast (see [Note: agreements at scale]): what every rank
    learns, pipelined, dropped, refused; then the Trainer's cases that end in one, and Fabric's; last, a deadlock
    (which leaves the group unusable)."""
    from lightning_zero.engine.comm import control as control_module
    from lightning_zero.engine.comm.control import ControlChannel

    assert world_size >= control_module.TREE_FROM
    results: dict[str, Any] = {}
    channel = ControlChannel.create(poll_seconds=0.5)
    assert channel is not None
    results["shared"] = channel.agree([1, 2], lambda: "the same step", shared=10 + rank)
    pending = channel.agree_later([3], lambda: "a pipelined step", shared=rank)
    results["in flight"] = not pending.settled
    results["pipelined"] = pending.result()
    # A pending agreement dropped by this rank alone, or by every rank: the next one still pairs up.
    for forgetting in ([0], [0, 1, 2]):
        pending = channel.agree_later([4], lambda: "a step given up", shared=rank)
        if rank in forgetting:
            channel.forget_pending()
        else:
            pending.result()
        results[f"after forgetting on {forgetting}"] = channel.agree([5], lambda: "the next step", shared=rank)
    try:
        channel.agree([6, 1 if rank == 2 else 0], lambda: f"step {6 + (rank == 2)}")
        results["mismatch"] = None
    except CollectiveMismatchError as error:
        results["mismatch"] = str(error)
    results["issued"] = dict(channel.issued)
    for stage in ("zero1", "zero3"):
        model = UnevenData(optimizer="sgd")
        trainer = quiet_trainer(
            strategy=_strategy(stage), devices=world_size, max_epochs=1, use_distributed_sampler=False
        )
        results[f"{stage}: uneven batches"] = _outcome(trainer, model)
    trainer = quiet_trainer(strategy=_strategy("zero2"), devices=world_size, max_steps=6, callbacks=[SigtermOnRank1()])
    results["zero2: SIGTERM on rank 1"] = _outcome(trainer, ParityNet(optimizer="sgd"))
    results["fabric zero2"] = _fabric_steps_then_a_barrier_on_rank_2(world_size)
    trainer = quiet_trainer(
        strategy=_strategy("zero2"), devices=world_size, max_steps=6, callbacks=[DirectReduceOnRank0()]
    )
    results["zero2: direct on rank 0"] = _outcome(trainer, ParityNet(optimizer="sgd"))
    return LeaveBroken(results)


def _fabric_steps_then_a_barrier_on_rank_2(world_size: int) -> dict[str, Any]:
    """The Fabric door over the same channel: three steps on every rank, then rank 2 calls ``barrier()`` where
    the others start a fourth step."""
    from lightning.fabric import Fabric
    from torch import nn

    from lightning_zero.fabric import ZeRO2Strategy as FabricZeRO2

    fabric = Fabric(strategy=FabricZeRO2(), accelerator="cpu", devices=world_size)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(fabric.global_rank)
    losses: list[float] = []

    def step() -> None:
        loss = model(torch.randn(4, 8, generator=generator)).square().mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    outcome: dict[str, Any] = {"type": None, "message": ""}
    try:
        for _ in range(3):
            step()
        if fabric.global_rank == 2:
            fabric.barrier()
        else:
            step()
    except CollectiveMismatchError as error:
        outcome = {"type": type(error).__name__, "message": str(error)}
    return {**outcome, "losses": losses}


def test_gathered_agreements_at_three_ranks_agree_pipeline_and_fail_fast() -> None:
    outcomes = spawn(_gathered_agreements, world_size=3, timeout=300, rendezvous="tcp")
    for rank, outcome in enumerate(outcomes):
        assert outcome["shared"] == [10, 11, 12] and outcome["pipelined"] == [0, 1, 2], outcome
        assert outcome["in flight"] or rank == 0, outcome  # (rank 0's gather may be in before it looks)
        for forgetting in ([0], [0, 1, 2]):
            assert outcome[f"after forgetting on {forgetting}"] == [0, 1, 2], (rank, outcome)
        message = outcome["mismatch"]
        assert message is not None and all(f"rank {q}: step {6 + (q == 2)}" in message for q in range(3)), message
        for case in ("zero1: uneven batches", "zero3: uneven batches", "zero2: SIGTERM on rank 1"):
            assert outcome[case]["seconds"] < LIMIT, (case, rank, outcome[case])
        for stage in ("zero1", "zero3"):
            uneven = outcome[f"{stage}: uneven batches"]
            assert uneven["type"] == "CollectiveMismatchError", (stage, rank, uneven)
            assert "rank 0: start training step 7" in uneven["message"], uneven
            assert "rank 2:" in uneven["message"] and "same number of batches" in uneven["message"], uneven
        sigterm = outcome["zero2: SIGTERM on rank 1"]
        assert sigterm["type"] == "SIGTERMException" and sigterm["global_step"] == 2, (rank, sigterm)
        fabric = outcome["fabric zero2"]
        assert len(fabric["losses"]) == 3, (rank, fabric)  # three steps agreed and trained everywhere
        assert fabric["type"] == "CollectiveMismatchError", (rank, fabric)
        assert "rank 2:" in fabric["message"] and "barrier" in fabric["message"], fabric["message"]
        direct = outcome["zero2: direct on rank 0"]
        assert direct["seconds"] < LIMIT and "rank 0: torch.distributed.all_reduce, called from" in direct["message"]
    # Every rank has issued the same collectives on the channel: rank 0's broadcasts, issued as each agreement was
    # settled (or dropped), included.
    assert len({str(o["issued"]) for o in outcomes}) == 1, [o["issued"] for o in outcomes]
    assert all(o["zero2: direct on rank 0"]["type"] is not None for o in outcomes), outcomes
    assert any(o["zero2: direct on rank 0"]["type"] == "CollectiveMismatchError" for o in outcomes[1:]), outcomes


# ------------------------------------------------------------------ waits for the device (see device_wait.py)


class NotReadyFor:
    """A fake CUDA event: ``query()`` says "not ready" for its first ``polls`` calls (forever with ``None``, up to a
    bound that fails the test instead of hanging it); each call records what rank 0 has published."""

    def __init__(self, store: Any, polls: int | None) -> None:
        self.store, self.polls, self.calls = store, polls, 0
        self.published: list[dict[str, Any]] = []

    def query(self) -> bool:
        self.calls += 1
        assert self.calls < 5000, "the wait for the device neither completed nor raised"
        self.published.append(json.loads(self.store.get("state/0")))
        return self.polls is not None and self.calls > self.polls

    def synchronize(self) -> None:
        raise AssertionError("a wait for the device must poll, not block in synchronize()")


def _state(status: str, token: int, group: str = "", index: int = -1, issued: Any = None, what: str = "") -> bytes:
    """A rank's state as the control channel publishes it (``stall._State``)."""
    fields = {"status": status, "token": token, "group": group, "index": index, "issued": issued, "what": what}
    return json.dumps(fields).encode()


def test_a_wait_for_the_device_is_reported_like_a_blocked_collective_and_raises_on_a_verdict() -> None:
    """Rank 0 of two, in-process: the other rank is a state written into the store by hand."""
    from lightning_zero.engine.comm.control import ControlChannel
    from lightning_zero.engine.comm.device_wait import wait_for_device
    from lightning_zero.engine.comm.sequence import CollectiveSequence
    from lightning_zero.engine.comm.stats import CommStats

    def pause(_seconds: float) -> None:
        time.sleep(0.01)  # ten milliseconds per poll, whatever the back-off asks for

    cases = {
        # Rank 1 is running: the wait is published, then completes, and this rank is running again.
        "completes": (_state("running", 1), 30),
        # Rank 1 found a mismatch (its monitor, or its own wait): the same error here, not a wait forever.
        "mismatch": (_state("mismatch", 1, what="the ranks are about to do different things"), None),
        # Rank 1 waits in an agreement this rank never joins, and this rank waits behind a collective rank 1 never
        # issued: a deadlock, seen the same on two reads in a row.
        "deadlock": (_state("waiting", 1, "side", 5, {"main": 1, "side": 6}, "agreeing on: step 9"), None),
    }
    for case, (other, polls) in cases.items():
        store = dist.HashStore()
        channel = ControlChannel(None, store, rank=0, world_size=2, poll_seconds=0.05)  # type: ignore[arg-type]
        try:
            store.set("state/1", other)
            channel.issued.update(main=3, side=5)  # collectives 0, 1, 2 of the main group issued here
            sequence = CollectiveSequence("auto", channel, 2, CommStats(), waits_block_host=False)
            event = NotReadyFor(store, polls)
            wait_for_device(sequence, None, "nothing queued")  # no event (a CPU): immediate
            start = time.monotonic()
            try:
                wait_for_device(sequence, event, "reading the gradients' flags", sleep=pause)
                outcome = None
            except CollectiveMismatchError as error:
                outcome = str(error)
            seconds = time.monotonic() - start
            waiting = [s for s in event.published if s["status"] == "waiting"]
            assert waiting, (case, event.published)
            assert waiting[0]["group"] == "main" and waiting[0]["index"] == 2, (case, waiting[0])
            text = "waiting for the device after collective #3 of the main group (reading the gradients' flags)"
            assert waiting[0]["what"] == text, (case, waiting[0])
            assert event.published[0]["status"] == "running", (case, event.published[0])  # the first poll: silent
            if case == "completes":
                assert outcome is None and event.calls == 31 and not sequence.broken, (case, outcome)
                assert json.loads(store.get("state/0"))["status"] == "running", case
                continue
            assert outcome is not None and sequence.broken and seconds < 10, (case, outcome, seconds)
            if case == "mismatch":
                assert outcome == "the ranks are about to do different things", outcome
            else:
                assert "a deadlock" in outcome and f"rank 0: {text}" in outcome, outcome
                assert "rank 1: agreeing on: step 9" in outcome, outcome
                assert json.loads(store.get("state/0"))["status"] == "mismatch", case  # told to rank 1
        finally:
            channel.close(destroy_group=False)
