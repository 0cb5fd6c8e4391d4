"""What user code does with the model as a whole during training: ``copy.deepcopy`` (an EMA or teacher copy),
``torch.save(submodule)`` and ``torch.load`` of it, through both doors, give DDP's values and a plain module (see
[Note: copies of a sharded module] in ``engine/core/hooks.py``); ``model.to(torch.float64)`` mid-fit is a clear
``ShardedConversionError`` on every rank instead of an error about gradient norms."""

from __future__ import annotations

import copy
import io
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_zero import ShardedConversionError
from tests.block_net import BLOCKS, WIDTH, Block, BlockNet
from tests.distributed import spawn
from tests.models import quiet_trainer

PROBE = torch.linspace(-1, 1, 2 * 8).reshape(2, 8)


def _plain(module: nn.Module) -> bool:
    """No lightning_zero class among the parameters, and no hook of the engine that would still act."""
    params_plain = all(type(p) is nn.Parameter for p in module.parameters())
    hooks = [h for m in module.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
    return params_plain and all(getattr(h, "__name__", "") == "detached_hook" for h in hooks)


def _copies_of(model: nn.Module, rank: int) -> dict[str, Any]:
    """A deep copy and a pickled block, made on every rank; used on rank 0 alone (a copy issues no collective)."""
    twin = copy.deepcopy(model)
    stream = io.BytesIO()
    torch.save(model.blocks[0], stream)
    got: dict[str, Any] = {"state": {k: v.clone() for k, v in twin.state_dict().items()}}
    if rank == 0:
        stream.seek(0)
        block = torch.load(stream, weights_only=False)
        twin.blocks[1].up.weight.data.mul_(2)  # a copy's weights are its own
        got.update(plain=_plain(twin) and _plain(block), out=twin(PROBE), block=block(twin.embed(PROBE)))
        got["sizes"] = sum(p.untyped_storage().nbytes() for p in block.parameters())
    return got


class _Copier(L.Callback):
    def __init__(self) -> None:
        self.copies: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        if trainer.global_step == 2:
            self.copies = _copies_of(pl_module, trainer.global_rank)


class _Converter(L.Callback):
    def __init__(self, when: str) -> None:
        self.when = when

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.when == "start":
            pl_module.double()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        if self.when == "step" and trainer.global_step == 2:
            pl_module.to(torch.float64)


def _fit(strategy: str, world_size: int, callback: L.Callback) -> BlockNet:
    torch.manual_seed(0)
    model = BlockNet()
    quiet_trainer(strategy=strategy, devices=world_size, max_steps=4, callbacks=[callback]).fit(model)
    return model


class _Blocks(nn.Module):
    """BlockNet's layers in a plain module, as Fabric loops use them (a LightningModule set up by Fabric keeps a
    reference to the Fabric object, which copies under no strategy)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _fabric_run(strategy: str, world_size: int, rank: int) -> dict[str, Any]:
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size)
    fabric.launch()
    torch.manual_seed(0)
    module = _Blocks()
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    generator = torch.Generator().manual_seed(2 + rank)
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return _copies_of(module, rank)


def _cases(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for strategy in ("ddp", "zero1", "zero3"):
        copier = _Copier()
        model = _fit(strategy, world_size, copier)
        results[strategy] = {"copies": copier.copies, "final": {k: v.clone() for k, v in model.state_dict().items()}}
        results[f"fabric-{strategy}"] = _fabric_run(strategy, world_size, rank)
    for strategy in ("zero1", "zero3"):
        for when in ("start", "step"):
            refused = r"converted during training .*float32 on cpu to torch.float64"
            with pytest.raises(ShardedConversionError, match=refused):
                _fit(strategy, world_size, _Converter(when))
            results[f"{strategy}-{when}"] = "refused"
    return results


def _assert_same_copies(got: dict[str, Any], ddp: dict[str, Any], where: str) -> None:
    for key, value in ddp["state"].items():
        assert torch.equal(got["state"][key], value), f"{where}: {key}"
    if "out" in ddp:
        assert got["plain"], f"{where}: the copy still carries the engine"
        assert torch.equal(got["out"], ddp["out"]) and torch.equal(got["block"], ddp["block"]), where
        if where.endswith("zero3"):  # sharded: pickled as the values alone (stages 1 and 2: views of the flat buffer)
            assert got["sizes"] == ddp["sizes"], f"{where}: a pickled parameter holds more than its own values"


def test_copies_and_pickles_of_the_model_are_ddp_s_and_conversions_are_refused_through_both_doors() -> None:
    results = spawn(_cases, world_size=2, timeout=600)
    for rank, result in enumerate(results):
        for strategy in ("zero1", "zero3"):
            _assert_same_copies(result[strategy]["copies"], result["ddp"]["copies"], f"rank {rank} {strategy}")
            _assert_same_copies(result[f"fabric-{strategy}"], result["fabric-ddp"], f"rank {rank} fabric {strategy}")
            for key, value in result["ddp"]["final"].items():  # the copies changed nothing in the run
                assert torch.equal(result[strategy]["final"][key], value), f"rank {rank} {strategy}: {key}"
            assert result[f"{strategy}-start"] == result[f"{strategy}-step"] == "refused"
