"""Asynchronous saves (``async_save=True``, or Lightning's ``AsyncCheckpointIO``), through a real Trainer and Fabric
on two CPU ranks, both formats:

- a save returns before its files exist; training goes on while they are written (the writes are held
  here until two more steps have run); what lands is what a synchronous save at the same step writes,
  bit for bit; ``ModelCheckpoint`` with top-k and ``save_last`` keeps exactly the files it keeps
  synchronously, and a run resumed from them equals DDP;
- a background save that fails on one rank fails on every rank, at the next save, with the synchronous
  save's message, and leaves nothing behind;
- ``AsyncCheckpointIO`` turns it on (its refusals: ``tests/test_setup_refusals.py``).

The kill matrix with saves in flight is in ``tests/test_checkpoint_safety.py``.
"""

from __future__ import annotations

import resource
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy, consolidate_checkpoint
from lightning_zero.engine.checkpoint import background
from lightning_zero.engine.errors import CheckpointSaveError
from lightning_zero.fabric import ZeRO3Strategy as ZeRO3FabricStrategy
from tests.distributed import spawn
from tests.models import ParityNet, quiet_trainer

STRATEGIES = {1: ZeRO1Strategy, 2: ZeRO2Strategy, 3: ZeRO3Strategy}


@contextmanager
def _held_writes() -> Iterator[threading.Event]:
    """Background writes wait until the event is set (at most a minute): the test decides when a save may land."""
    release = threading.Event()
    start = background.BackgroundSaves.start

    def held_start(self: Any, path: Path, write: Callable, staged: Any, ranks: Any) -> None:
        def held(r: Any) -> None:
            assert release.wait(60), "the test never released the write"
            write(r)

        start(self, path, held, staged, ranks)

    background.BackgroundSaves.start = held_start  # type: ignore[method-assign]
    try:
        yield release
    finally:
        release.set()
        background.BackgroundSaves.start = start  # type: ignore[method-assign]


class _SaveAtStep(Callback):
    """``trainer.save_checkpoint(path)`` after step ``at``; with ``release``, checks two steps later that the save
    has not landed yet (training went on), then lets it land."""

    def __init__(self, path: Path, at: int, release: threading.Event | None = None) -> None:
        self.path, self.at, self.release = path, at, release
        self.returned_before_written = False

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            trainer.save_checkpoint(self.path)
            self.returned_before_written = not self.path.exists()
        if self.release is not None and trainer.global_step == self.at + 2:
            assert not self.path.exists() and trainer.strategy.driver.saves.in_flight
            self.release.set()


class _MutatedEveryStep(Callback):
    """Objects a callback puts into the checkpoint (``on_save_checkpoint``) that are not tensors and that it changes in
    place every step (a set, a bytearray): a save holds them as they were at its step, as a synchronous save does,
    not as the background write finds them steps later."""

    def __init__(self) -> None:
        self.steps: set[int] = set()
        self.trail = bytearray()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps.add(trainer.global_step)
        self.trail.append(trainer.global_step)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint["mutable"] = {"steps": self.steps, "trail": self.trail}


def _entries_equal(got: Any, want: Any, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), (where, sorted(got), sorted(want))
        for key in want:
            if key != "callbacks":  # ModelCheckpoint's paths differ by directory
                _entries_equal(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _entries_equal(a, b, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


def _save_during_training(rank: int, root: Path) -> None:
    """Each stage and format: the held background save at step 2 equals a synchronous save at step 2."""
    cases = [(3, "full"), (3, "sharded"), (2, "full"), (1, "sharded")]
    for stage, checkpoint_format in cases:
        paths = {}
        for asynchronous in (False, True):
            path = root / f"stage{stage}-{checkpoint_format}-{'async' if asynchronous else 'sync'}.ckpt"
            torch.manual_seed(0)
            strategy = STRATEGIES[stage](checkpoint_format=checkpoint_format, async_save=asynchronous)
            with _held_writes() as release:
                callback = _SaveAtStep(path, at=2, release=release if asynchronous else None)
                callbacks = [_MutatedEveryStep(), callback]  # updated before the save of its step
                quiet_trainer(strategy=strategy, devices=2, max_steps=6, callbacks=callbacks).fit(_model())
            assert callback.returned_before_written == asynchronous, (stage, checkpoint_format)
            assert path.exists()  # the end of the run waited for it
            paths[asynchronous] = path
        got, want = consolidate_checkpoint(paths[True]), consolidate_checkpoint(paths[False])
        assert want["global_step"] == 2
        assert got["mutable"] == want["mutable"] == {"steps": {1, 2}, "trail": bytearray([1, 2])}, got["mutable"]
        _entries_equal(got, want, f"stage {stage} {checkpoint_format}")
        hidden = [p.name for p in root.iterdir() if p.name.startswith(".")]
        assert hidden == [], hidden


def _model() -> ParityNet:
    return ParityNet(optimizer="adamw", scheduler="step")


def _top_k_and_last(rank: int, root: Path) -> None:
    """ModelCheckpoint saving every step of one epoch (top 2 by step, and last): the same files as synchronously,
    equal contents, and a run resumed from last.ckpt equals DDP."""
    torch.manual_seed(0)
    ddp = _model()
    quiet_trainer(strategy=DDPStrategy(), devices=2, max_steps=16).fit(ddp)
    for checkpoint_format in ("full", "sharded"):
        kept = {}
        for asynchronous in (False, True):
            directory = root / f"{checkpoint_format}-{'async' if asynchronous else 'sync'}"
            torch.manual_seed(0)
            callback = ModelCheckpoint(
                dirpath=directory, monitor="step", mode="max", save_top_k=2, every_n_train_steps=1, save_last=True
            )
            plugins = [AsyncCheckpointIO()] if asynchronous else []
            strategy = ZeRO3Strategy(checkpoint_format=checkpoint_format)  # type: ignore[arg-type]
            trainer = quiet_trainer(
                strategy=strategy,
                devices=2,
                max_steps=8,
                enable_checkpointing=True,
                callbacks=[callback],
                plugins=plugins,
            )
            assert strategy.async_save == asynchronous
            trainer.fit(_model())
            kept[asynchronous] = sorted(p.name for p in directory.iterdir())
            assert str(callback.best_model_path).endswith("step=8.ckpt"), callback.best_model_path
        assert kept[True] == kept[False] == ["epoch=0-step=7.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"], kept
        for name in kept[True]:
            got = consolidate_checkpoint(root / f"{checkpoint_format}-async" / name)
            want = consolidate_checkpoint(root / f"{checkpoint_format}-sync" / name)
            _entries_equal(got, want, f"{checkpoint_format}/{name}")
        torch.manual_seed(1)  # everything must come from the checkpoint
        resumed = _model()
        strategy = ZeRO3Strategy(checkpoint_format=checkpoint_format, async_save=True)  # type: ignore[arg-type]
        callback = ModelCheckpoint(dirpath=root / f"{checkpoint_format}-async", save_last=True)
        quiet_trainer(strategy=strategy, devices=2, max_steps=16, enable_checkpointing=True, callbacks=[callback]).fit(
            resumed, ckpt_path="last"
        )
        assert resumed.losses == ddp.losses[8:], (checkpoint_format, len(resumed.losses))
        for key, value in ddp.state_dict().items():
            assert torch.equal(resumed.state_dict()[key], value), (checkpoint_format, key)


class _FailOnRankOne(Callback):
    """``path`` saved at step 1; then rank 1 may write no file beyond 1 byte (``RLIMIT_FSIZE``), so that the save of
    ``path`` at step 2 fails in the background (``EFBIG``, as on a broken or full disk); the save at step 3 is where
    the failure must be raised, on every rank."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 1:
            trainer.save_checkpoint(self.path)
        if trainer.global_step == 2:
            trainer.strategy.finish_saves()  # the limit must not reach the save of step 1, still being written
            if trainer.global_rank == 1:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                self.limits = resource.getrlimit(resource.RLIMIT_FSIZE)
                resource.setrlimit(resource.RLIMIT_FSIZE, (1, self.limits[1]))
            trainer.save_checkpoint(self.path)
        if trainer.global_step == 3:
            trainer.save_checkpoint(self.path.with_name("next.ckpt"))

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if hasattr(self, "limits"):
            resource.setrlimit(resource.RLIMIT_FSIZE, self.limits)


class _Steps(Callback):
    def __init__(self) -> None:
        self.at_failure = -1

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.at_failure = trainer.global_step


def _failure_on_one_rank(rank: int, root: Path) -> None:
    for checkpoint_format in ("full", "sharded"):
        directory = root / checkpoint_format
        torch.manual_seed(0)
        steps = _Steps()
        strategy = ZeRO3Strategy(checkpoint_format=checkpoint_format, async_save=True)  # type: ignore[arg-type]
        trainer = quiet_trainer(
            strategy=strategy, devices=2, max_steps=6, callbacks=[_FailOnRankOne(directory / "last.ckpt"), steps]
        )
        with pytest.raises(CheckpointSaveError, match=r"failed on rank\(s\) \[1\].*File too large"):
            trainer.fit(_model())
        assert steps.at_failure == 3, steps.at_failure  # raised by the next save, not later, not silently
        trainer.strategy.barrier()
        assert sorted(p.name for p in directory.iterdir()) == ["last.ckpt"], checkpoint_format  # nothing left behind
        assert consolidate_checkpoint(directory / "last.ckpt")["global_step"] == 1  # the previous one, intact


def _cases(rank: int, world_size: int, root: str) -> None:
    for name, case in (("during", _save_during_training), ("top-k", _top_k_and_last), ("fail", _failure_on_one_rank)):
        (Path(root) / name).mkdir(exist_ok=True)
        case(rank, Path(root) / name)


def test_background_saves_through_the_trainer_equal_synchronous_ones(tmp_path: Path) -> None:
    spawn(_cases, world_size=2, timeout=600, root=str(tmp_path))


def test_staging_copies_every_object_as_it_is_at_the_save() -> None:
    """``stage_on_host`` alone: objects that are not tensors are copied (what two entries share stays shared, a state
    dict's attributes too), so changes after the save do not reach it; an object that cannot be copied is refused
    with its place named."""
    seen = {1, 2}
    state = torch.nn.Linear(2, 2).state_dict()
    checkpoint = {"a": seen, "b": [seen, bytearray(b"12")], "state_dict": state}
    staged = background.stage_on_host(checkpoint, background.PinnedBuffers()).state
    seen.add(3)
    checkpoint["b"][1].append(ord("3"))
    state._metadata[""]["version"] = 99  # type: ignore[attr-defined]
    assert staged["a"] == {1, 2} and staged["b"] == [{1, 2}, bytearray(b"12")] and staged["a"] is staged["b"][0]
    assert staged["state_dict"]._metadata[""]["version"] == 1
    with pytest.raises(TypeError, match=r"checkpoint\['b'\]\[1\] \(a lock\) cannot be copied .*async_save=False"):
        background.stage_on_host({"a": 1, "b": [2, threading.Lock()]}, background.PinnedBuffers())


def test_the_save_thread_makes_the_save_device_current_first() -> None:
    """The thread runs the device setter with the save's device before anything else (see [Note: asynchronous
    saves], the thread's device): the explicit one, else the staged tensors' device; none on a CPU."""
    calls: list[tuple[str, Any]] = []

    def use_device(device: torch.device) -> None:
        calls.append((threading.current_thread().name, device))

    saves = background.BackgroundSaves(use_device=use_device)
    ranks = background.Ranks(0, 1, lambda obj: obj)

    def save(staged: background.Staged, device: torch.device | None = None) -> list[Any]:
        calls.clear()
        saves.start(Path("ckpt"), lambda r: calls.append("write"), staged, ranks, device)
        saves.wait()
        return [c if c == "write" else (c[0] != threading.current_thread().name, c[1]) for c in calls]

    assert save(background.Staged({}, []), torch.device("cuda", 3)) == [(True, torch.device("cuda", 3)), "write"]
    assert save(background.Staged({}, [], torch.device("cuda", 1))) == [(True, torch.device("cuda", 1)), "write"]
    if not torch.cuda.is_initialized():
        assert save(background.Staged({}, [])) == ["write"]  # nothing to set on a CPU
    background.use_device_in_thread(torch.device("cpu"))  # the default setter: a no-op off CUDA


# ---------------------------------------------------------------------- Fabric
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _fabric_steps(
    fabric: L.Fabric,
    model: Any,
    optimizer: Any,
    steps: int,
    generator: torch.Generator,
    mutated: tuple[set[int], bytearray],
) -> None:
    """``steps`` steps; each adds its number to the set and the bytearray of ``mutated``, in place."""
    seen, log = mutated
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        seen.add(len(seen) + 1)
        log.append(len(log) + 1)


def _fabric(rank: int, world_size: int, root: str) -> None:
    for checkpoint_format in ("full", "sharded"):
        saved = {}
        for asynchronous in (False, True):
            path = Path(root, f"{checkpoint_format}-{asynchronous}.ckpt")
            strategy = ZeRO3FabricStrategy(checkpoint_format=checkpoint_format, async_save=asynchronous)
            fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
            fabric.launch()
            fabric.seed_everything(0)
            module = _Net()
            model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
            generator = torch.Generator().manual_seed(2 + rank)
            mutated: tuple[set[int], bytearray] = (set(), bytearray())  # user values in the state, changed in place
            with _held_writes() as release:
                _fabric_steps(fabric, model, optimizer, 2, generator, mutated)
                state = {"model": model, "optimizer": optimizer, "step": 2, "seen": mutated[0], "log": mutated[1]}
                fabric.save(path, state)
                assert path.exists() != asynchronous
                _fabric_steps(fabric, model, optimizer, 2, generator, mutated)  # training goes on
                assert path.exists() != asynchronous
                release.set()
                fabric.strategy.finish_saves()
            assert path.exists()
            full = checkpoint_format == "full"
            saved[asynchronous] = torch.load(path, weights_only=True) if full else consolidate_checkpoint(path)
            assert saved[asynchronous]["step"] == 2
            assert (saved[asynchronous]["seen"], saved[asynchronous]["log"]) == ({1, 2}, bytearray([1, 2]))
            fabric.strategy.teardown()
        _entries_equal(saved[True], saved[False], f"fabric {checkpoint_format}")


def test_background_saves_through_fabric_equal_synchronous_ones(tmp_path: Path) -> None:
    spawn(_fabric, world_size=2, timeout=300, root=str(tmp_path))
