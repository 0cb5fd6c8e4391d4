"""``activation_checkpointing_policy`` (issue 29, part 1): the selected modules recompute their forward in backward,
through both doors, under every stage, bitwise as DDP with the same modules checkpointed by hand (and as no
checkpointing at all where nothing is random), each block run twice per micro-batch and, under stage 3, no unit
gathered more than twice per micro-batch; names, state dicts and checkpoints as without it.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDP
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy
from lightning_zero.engine.comm.comm import Comm
from lightning_zero.engine.schedule.recompute import apply_activation_checkpointing, selected_modules
from lightning_zero.fabric import ZeRO3Strategy as ZeRO3FabricStrategy
from tests.distributed import spawn
from tests.models import quiet_trainer

WIDTH, BLOCKS, STEPS, ACCUMULATE = 16, 3, 3, 2
STAGES = {"zero1": ZeRO1Strategy, "zero2": ZeRO2Strategy, "zero3": ZeRO3Strategy}


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.drop = nn.Dropout(dropout)
        self.calls = 0  # forward calls, recomputations included

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.drop(self.down(torch.relu(self.up(self.norm(x)))))


class Net(L.LightningModule):
    """Blocks in a ModuleList (the default units), a frozen bias inside one of them, a head tied to nothing."""

    def __init__(self, dropout: float = 0.0, by_hand: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(Block(dropout) for _ in range(BLOCKS))
        self.blocks[1].up.bias.requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)
        if by_hand:  # the reference: torch's own checkpoint on the same modules, no policy
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

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator))
        return DataLoader(data, batch_size=4)


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


@contextmanager
def _gathers_counted() -> Iterator[Counter]:
    """Every all-gather the engine issues meanwhile, by unit name (``Comm.all_gather`` wrapped in this process)."""
    counts: Counter = Counter()
    original = Comm.all_gather

    def counting(self: Comm, output: torch.Tensor, source: torch.Tensor, name: str = "", **kwargs: Any) -> Any:
        counts[name] += 1
        return original(self, output, source, name=name, **kwargs)

    Comm.all_gather = counting  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        Comm.all_gather = original  # type: ignore[method-assign]


def _fit(strategy: Any, model: Net, accumulate: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = Losses()
    trainer = quiet_trainer(
        strategy=strategy, devices=2, max_steps=STEPS, accumulate_grad_batches=accumulate, callbacks=[losses]
    )
    trainer.fit(model)
    return losses.losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(got: tuple[list[float], dict], want: tuple[list[float], dict], where: str) -> None:
    assert got[0] == want[0], (where, got[0], want[0])
    assert got[1].keys() == want[1].keys(), where
    for key, value in want[1].items():
        assert torch.equal(got[1][key], value), (where, key)


def _trainer_cases(rank: int, world_size: int) -> None:
    for dropout in (0.1, 0.0):
        L.seed_everything(0)
        by_hand = _fit(DDPStrategy(), Net(dropout, by_hand=True))
        for stage, cls in STAGES.items():
            L.seed_everything(0)
            model = Net(dropout)
            got = _fit(cls(activation_checkpointing_policy={Block}), model)
            _same(got, by_hand, f"{stage} dropout={dropout}: against DDP with the blocks checkpointed by hand")
            # Each block's forward twice per micro-batch (the recomputation), as in the reference.
            assert [b.calls for b in model.blocks] == [2 * STEPS] * BLOCKS, (stage, model.blocks[0].calls)
        if dropout == 0.0:  # nothing random: checkpointing changes no bit
            L.seed_everything(0)
            plain = _fit(DDPStrategy(), Net(dropout))
            _same(by_hand, plain, "checkpointed by hand against no checkpointing")
    # Stage 3 with a unit per block and gradient accumulation: against the same stage with the blocks checkpointed
    # by hand (DDP sums the micro-batches before its reduction, stage 3 after: see docs/parity.md), and the gathers
    # counted: the recomputation adds none (it runs on the unit that backward gathered), so each block is gathered as
    # often as without checkpointing, at most twice per micro-batch (plus once when the module is made whole at the
    # end of fit).
    L.seed_everything(0)
    reference = _fit(ZeRO3Strategy(unit_modules=[Block]), Net(0.1, by_hand=True), ACCUMULATE)
    L.seed_everything(0)
    model = Net(0.1)
    with _gathers_counted() as counts:
        got = _fit(ZeRO3Strategy(unit_modules=[Block], activation_checkpointing_policy={Block}), model, ACCUMULATE)
    _same(got, reference, "zero3 with accumulation: against the blocks checkpointed by hand")
    micro_batches = STEPS * ACCUMULATE
    assert [b.calls for b in model.blocks] == [2 * micro_batches] * BLOCKS, model.blocks[0].calls
    L.seed_everything(0)
    with _gathers_counted() as without:
        _fit(ZeRO3Strategy(unit_modules=[Block]), Net(0.1), ACCUMULATE)
    blocks = [f"blocks.{i}" for i in range(BLOCKS)]
    assert [counts[b] for b in blocks] == [without[b] for b in blocks], (counts, without)
    assert all(counts[b] <= 2 * micro_batches + 1 for b in blocks), counts
    # Class names (YAML configs) and FSDP's policy callables select the same modules.
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    names = [name for name, _ in selected_modules(Net(), {"Block"})]
    assert names == ["blocks.0", "blocks.1", "blocks.2"], names
    assert [n for n, _ in selected_modules(Net(), ModuleWrapPolicy({Block}))] == names
    assert [n for n, _ in selected_modules(Net(), lambda m: isinstance(m, Block))] == names
    # A model that checkpoints already keeps what it has, with a warning (as Lightning's FSDPStrategy).
    model = Net(by_hand=True)
    with pytest.warns(UserWarning, match="already checkpoints activations"):
        assert apply_activation_checkpointing(model, {nn.Linear}) == []


def _fabric_case(rank: int, world_size: int) -> None:
    results = []
    for strategy in (FabricDDP(), ZeRO3FabricStrategy(activation_checkpointing_policy={"Block"})):
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric.launch()
        fabric.seed_everything(0)
        module = Net(0.1, by_hand=isinstance(strategy, FabricDDP))
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
        model, optimizer = fabric.setup(module, optimizer)
        generator = torch.Generator().manual_seed(2 + rank)
        losses = []
        for _ in range(STEPS):
            x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        results.append((losses, state))
        assert [b.calls for b in module.blocks] == [2 * STEPS] * BLOCKS
    _same(results[1], results[0], "Fabric zero3 against Fabric DDP with the blocks checkpointed by hand")


def _cases(rank: int, world_size: int) -> None:
    _trainer_cases(rank, world_size)
    _fabric_case(rank, world_size)


def test_activation_checkpointing_policy_matches_ddp_with_the_same_checkpoints_by_hand() -> None:
    spawn(_cases, world_size=2)
