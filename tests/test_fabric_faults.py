"""Fabric's saves and failures give the Trainer's guarantees, from the same code (``driver/``): a ``fabric.save``
killed at any point of its protocol leaves the previous checkpoint loadable, a save that fails on one rank fails on
every rank and leaves nothing behind, and a rank whose step raises makes the others stop at once, with a teardown
that gathers nothing (see ``tests/test_checkpoint_safety.py`` and ``tests/test_faults.py`` for the Trainer's)."""

from __future__ import annotations

import os
import resource
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_zero.engine.errors import CheckpointSaveError, PeerFailureError
from lightning_zero.engine.io.files import KILL_AT
from lightning_zero.fabric import ZeRO3Strategy
from lightning_zero.tools.processes import LeaveBroken
from tests.distributed import spawn, spawn_killed

KILLS = [  # (format, kill point, the step the checkpoint left behind holds)
    ("full", "start", 1),
    ("full", "partial", 1),
    ("full", "before-commit", 1),
    ("full", "after-commit", 2),
    ("full", "end", 2),
    ("sharded", "partial", 1),
    ("sharded", "before-commit", 1),
    ("sharded", "after-commit", 2),
]


def _setup(world_size: int, checkpoint_format: str) -> tuple[Fabric, Any, torch.optim.Optimizer]:
    fabric = Fabric(strategy=ZeRO3Strategy(checkpoint_format=checkpoint_format), accelerator="cpu", devices=world_size)
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module():
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    return fabric, model, optimizer


def _train(fabric: Fabric, model: Any, optimizer: torch.optim.Optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(fabric.global_rank)
    for _ in range(steps):
        loss = model(torch.randn(4, 8, generator=generator)).square().mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def _save_and_die(rank: int, world_size: int, directory: str, checkpoint_format: str, point: str) -> None:
    fabric, model, optimizer = _setup(world_size, checkpoint_format)
    path = Path(directory) / "last.ckpt"
    _train(fabric, model, optimizer, 2)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    _train(fabric, model, optimizer, 2)
    os.environ[KILL_AT] = f"{point}@last.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})


def _load_each(rank: int, world_size: int, root: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for checkpoint_format, point, _ in KILLS:
        directory = Path(root, f"{checkpoint_format}-{point}")
        fabric, model, optimizer = _setup(world_size, checkpoint_format)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(directory / "last.ckpt", state)
        _train(fabric, model, optimizer, 1)  # the loaded state trains
        fabric.save(directory / "last.ckpt", state)  # and the next save cleans up what the killed one left
        hidden = sorted(p.name for p in directory.iterdir() if p.name.startswith("."))
        shards = len(list((directory / "last.ckpt").glob("shards-*"))) if checkpoint_format == "sharded" else 1
        found[f"{checkpoint_format}/{point}"] = (state["step"], hidden, shards)
        fabric.strategy.teardown()
    return found


def test_a_fabric_save_killed_at_any_point_leaves_a_checkpoint_that_loads(tmp_path: Path) -> None:
    for checkpoint_format, point, _ in KILLS:
        directory = tmp_path / f"{checkpoint_format}-{point}"
        spawn_killed(
            _save_and_die, timeout=120, directory=str(directory), checkpoint_format=checkpoint_format, point=point
        )
        assert (directory / "last.ckpt").exists(), (checkpoint_format, point)
    for found in spawn(_load_each, world_size=2, timeout=300, root=str(tmp_path)):
        assert found == {f"{f}/{p}": (step, [], 1) for f, p, step in KILLS}


def _fail_on_one_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for checkpoint_format in ("full", "sharded"):
        directory = Path(root, checkpoint_format)
        fabric, model, optimizer = _setup(world_size, checkpoint_format)
        _train(fabric, model, optimizer, 1)
        fabric.save(directory / "last.ckpt", {"model": model, "optimizer": optimizer, "step": 1})
        _train(fabric, model, optimizer, 1)
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        if rank == 1:  # its writes fail with EFBIG, as on a broken or full disk
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1, limits[1]))
        try:
            with pytest.raises(CheckpointSaveError, match=r"failed on rank\(s\) \[.*1\].*File too large") as error:
                fabric.save(directory / "last.ckpt", {"model": model, "optimizer": optimizer, "step": 2})
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        fabric.barrier()
        left = sorted(p.name for p in directory.iterdir())
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(directory / "last.ckpt", state)  # the previous checkpoint, intact
        results[checkpoint_format] = (left, state["step"], "previous checkpoint" in str(error.value))
        fabric.strategy.teardown()
    return results


def test_a_fabric_save_that_fails_on_one_rank_fails_everywhere_and_leaves_nothing_behind(tmp_path: Path) -> None:
    for results in spawn(_fail_on_one_rank, world_size=2, timeout=300, root=str(tmp_path)):
        assert results == {"full": (["last.ckpt"], 1, True), "sharded": (["last.ckpt"], 1, True)}


class _RaisesOnRankOne(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 3 and torch.distributed.get_rank() == 1:
            raise ValueError("a bug in rank 1's forward")
        return self.layer(x)


def _one_rank_raises(rank: int, world_size: int) -> LeaveBroken:
    fabric = Fabric(strategy=ZeRO3Strategy(timeout=timedelta(seconds=60)), accelerator="cpu", devices=world_size)
    fabric.launch()
    model = fabric.setup_module(_RaisesOnRankOne())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    start = time.monotonic()
    try:
        for _ in range(5):
            fabric.backward(model(torch.randn(2, 8)).sum())
            optimizer.step()
            optimizer.zero_grad()
        error: BaseException | None = None
    except BaseException as raised:
        error = raised
    stopped = time.monotonic() - start
    teardown_start = time.monotonic()
    fabric.strategy.teardown()  # gathers nothing after a failure: no rank waits for the other here
    # The collective rank 0 was told to stop in is still in flight on the default group (rank 1 never joined it):
    # the harness's closing barrier would wait for the timeout, so the process exits without one.
    return LeaveBroken(
        {
            "error": type(error).__name__,
            "message": str(error),
            "stopped_after": stopped,
            "teardown_seconds": time.monotonic() - teardown_start,
            "params_still_views": all(p.is_meta is False for p in model.parameters()),
        }
    )


def test_a_rank_whose_fabric_step_raises_stops_the_others_at_once() -> None:
    rank0, rank1 = spawn(_one_rank_raises, world_size=2, timeout=120)
    assert rank1["error"] == "ValueError"
    assert rank0["error"] == PeerFailureError.__name__, rank0
    assert "rank 1" in rank0["message"] and "a bug in rank 1's forward" in rank0["message"], rank0["message"]
    assert rank0["stopped_after"] < 30, rank0  # told by the failing rank, long before the 60 s timeout
    assert rank0["teardown_seconds"] < 10 and rank1["teardown_seconds"] < 10
