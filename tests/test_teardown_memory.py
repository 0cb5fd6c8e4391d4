"""The end of a run builds nothing whole that does not fit: a model that trains only because it is sharded also
ends cleanly (see [Note: what fits at the end] in ``lightning_zero/engine/free_memory.py``). When its full parameters
do not fit either, the model stays sharded, and the next runs of the same Trainer use it as it is."""

from __future__ import annotations

import resource
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_zero.engine.core.optimizer import ShardedOptimizerStateError
from lightning_zero.engine.core.placeholder import ShardedParameterReadError
from tests.distributed import spawn
from tests.models import quiet_trainer

WIDTH, DEPTH = 1024, 8  # 8.4M parameters: 34 MB of fp32 parameters, 67 MB of Adam states


class Stack(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layers(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.layers(batch[0]).square().mean(), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layers(batch[0]).sum(dim=1)

    def train_dataloader(self) -> Any:
        data = torch.utils.data.TensorDataset(torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(0)))
        return torch.utils.data.DataLoader(data, batch_size=2)

    test_dataloader = predict_dataloader = train_dataloader


def _address_space() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize")


class LimitMemoryAtTheEnd(L.Callback):
    """After the last step, cap this process's address space at what it uses plus ``room`` bytes: room for the full
    parameters (34 MB), not for the full optimizer states as well (67 MB more)."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.previous: tuple[int, int] | None = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.previous = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (_address_space() + self.room, self.previous[1]))

    def lift(self) -> None:
        if self.previous is not None:
            resource.setrlimit(resource.RLIMIT_AS, self.previous)


def _run(rank: int, world_size: int, root: str) -> None:
    torch.manual_seed(0)
    ddp = Stack()
    reference = quiet_trainer(strategy="ddp", devices=world_size, max_steps=2)
    reference.fit(ddp)
    ddp_test, ddp_predictions = reference.test(ddp, verbose=False), reference.predict(ddp)
    for name in ("zero1", "zero2", "zero3"):
        torch.manual_seed(0)
        model = Stack()
        limit = LimitMemoryAtTheEnd(room=80 << 20)
        trainer = quiet_trainer(strategy=name, devices=world_size, max_steps=2, callbacks=[limit])
        try:
            trainer.fit(model)  # ends cleanly: the parameters are gathered, the optimizer states stay sharded
        finally:
            limit.lift()
        for key, value in ddp.state_dict().items():  # the weights are DDP's, whole on every rank
            assert torch.equal(model.state_dict()[key], value), (name, key)
        (optimizer,) = trainer.optimizers
        with pytest.raises(ShardedOptimizerStateError, match=r"Adam's per-parameter states stayed sharded when the"):
            optimizer.state_dict()
        with pytest.raises(ShardedOptimizerStateError, match=r"weights_only=True"):
            optimizer.step()
        with pytest.raises(ShardedOptimizerStateError):  # never a checkpoint with shard-shaped states in it
            trainer.save_checkpoint(f"{root}/{name}-full.ckpt")
        trainer.save_checkpoint(f"{root}/{name}-weights.ckpt", weights_only=True)
        saved = torch.load(f"{root}/{name}-weights.ckpt", weights_only=True)["state_dict"]
        assert all(torch.equal(saved[k], v) for k, v in ddp.state_dict().items()), name
    # Room for neither: the parameters are not gathered either, and the model stays sharded between runs.
    torch.manual_seed(0)
    model = Stack()
    limit = LimitMemoryAtTheEnd(room=24 << 20)  # the full parameters need 34 MB
    trainer = quiet_trainer(strategy="zero3", devices=world_size, max_steps=2, callbacks=[limit])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model)
        finally:
            limit.lift()
    said = [str(w.message) for w in caught if "stays sharded" in str(w.message)]
    if rank == 0:
        assert len(said) == 1 and "full parameters were not gathered, since they need" in said[0], said
    else:
        assert not said, said
    with pytest.raises(
        ShardedParameterReadError, match=r"'layers\.0\.weight' \(unit 'layers\.0'\) was read between runs"
    ):
        model.layers[0].weight.sum()
    with pytest.raises(ValueError, match=r"still sharded by the lightning_zero strategy of an earlier run"):
        quiet_trainer(strategy="zero3", devices=world_size).test(model, verbose=False)
    # The same Trainer's next runs use it as it is, with DDP's results (and read it during them).
    assert trainer.test(model, verbose=False) == ddp_test
    assert all(torch.equal(a, b) for a, b in zip(trainer.predict(model), ddp_predictions))
    trainer.save_checkpoint(f"{root}/kept.ckpt", weights_only=True)  # on every rank, in pieces
    saved = torch.load(f"{root}/kept.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(saved[k], v) for k, v in ddp.state_dict().items())
    # Each run's end checks again: with the limit lifted, the end of predict gathered the parameters.
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ddp.state_dict().items())
    # With room for both (no limit), the end of fit leaves DDP's full optimizer states.
    torch.manual_seed(0)
    model = Stack()
    trainer = quiet_trainer(strategy="zero3", devices=world_size, max_steps=2)
    trainer.fit(model)
    assert trainer.optimizers[0].state_dict()["state"][0]["exp_avg"].shape == (WIDTH, WIDTH)


def test_a_model_whose_full_optimizer_states_do_not_fit_ends_its_run_cleanly(tmp_path: Path) -> None:
    spawn(_run, world_size=2, timeout=600, root=str(tmp_path))
