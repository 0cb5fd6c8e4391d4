"""A small stack of blocks for the toolkit's tests (activation checkpointing, local accumulation): the default units
are the blocks' parent, ``unit_modules=[Block]`` makes each block a unit; runs through the Trainer and Fabric that
record what the tests compare (losses, the final state dict) with DDP's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from tests.models import quiet_trainer

WIDTH, BLOCKS = 16, 3


class Block(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.drop = nn.Dropout(dropout)
        self.calls = 0  # forward calls, recomputations included

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.drop(self.down(torch.relu(self.up(self.norm(x)))))


class BlockNet(L.LightningModule):
    """``BLOCKS`` blocks between an input and an output layer, one frozen tensor (the up-projection's bias of block
    1: its unit waits for its inputs' gradients, see [Note: frozen units]); ``by_hand`` checkpoints every block with
    torch's own API."""

    def __init__(self, dropout: float = 0.0, by_hand: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(Block(dropout) for _ in range(BLOCKS))
        self.blocks[1].up.bias.requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)
        self.most_gathered = 0  # stage 3: the most units other than the root gathered at once in a micro-batch
        if by_hand:
            for block in self.blocks:
                checkpoint(block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        sharded = getattr(self.trainer.strategy, "sharded_model", None)
        if sharded is not None and sharded.stage3 is not None:
            sharded.gathered.reset()

    def on_after_backward(self) -> None:  # the most units gathered at once in this micro-batch, the root aside
        sharded = getattr(self.trainer.strategy, "sharded_model", None)
        if sharded is not None and sharded.stage3 is not None:
            gathered = sum(name != sharded.root_unit.name for name in sharded.gathered.at_peak)
            self.most_gathered = max(self.most_gathered, gathered)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(96, 8, generator=generator), torch.randn(96, 1, generator=generator))
        return DataLoader(data, batch_size=4)


class Record(L.Callback):
    """Every training batch's loss, and the reduce-scatter bytes of the run (ZeRO strategies)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.reduce_scatter_bytes = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        sharded = getattr(trainer.strategy, "sharded_model", None)
        if sharded is not None:
            self.reduce_scatter_bytes = sharded.comm.stats.by_kind["reduce_scatter"].bytes_sent


Run = tuple[list[float], dict[str, torch.Tensor], Record]


def fit(strategy: Any, model: BlockNet, steps: int, accumulate: int = 1) -> Run:
    """``trainer.fit(model)`` on 2 CPU ranks for ``steps`` optimizer steps: losses, final state dict, the record."""
    record = Record()
    trainer = quiet_trainer(
        strategy=strategy, devices=2, max_steps=steps, accumulate_grad_batches=accumulate, callbacks=[record]
    )
    trainer.fit(model)
    return record.losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, record


def fabric_run(strategy: Any, make: Callable[[], BlockNet], steps: int, accumulate: int = 1) -> Run:
    """The same in a Fabric loop: ``accumulate`` micro-batches per step, all but the last under
    ``fabric.no_backward_sync``; each rank its own batches."""
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    module = make()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(module, optimizer)
    generator = torch.Generator().manual_seed(2 + fabric.global_rank)
    losses = []
    for micro_batch in range(steps * accumulate):
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)
        last = (micro_batch + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not last):
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss / accumulate)
        if last:
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in module.state_dict().items()}, Record()


def assert_same(got: Run, want: Run, where: str) -> None:
    """The same losses and the same final state dict (names and bits)."""
    assert got[0] == want[0], (where, got[0], want[0])
    assert got[1].keys() == want[1].keys(), where
    for key, value in want[1].items():
        assert torch.equal(got[1][key], value), (where, key)
