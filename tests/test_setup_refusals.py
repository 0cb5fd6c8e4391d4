"""Models the engine cannot shard with DDP's meaning are refused at setup, on every rank, with what to do; models
it can shard, however odd, train as under DDP. Each case goes through a real ``Trainer`` under every stage, and
through Fabric once."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy
from tests.distributed import spawn
from tests.models import quiet_trainer

STAGES = {"zero1": ZeRO1Strategy, "zero2": ZeRO2Strategy, "zero3": ZeRO3Strategy}


class _Net(L.LightningModule):
    """``Linear(4, 4)`` into ``body`` into ``Linear(4, 1)``; Adam; 16 samples, batch 2 per rank."""

    def __init__(self, body: nn.Module | None = None) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.body = body if body is not None else nn.Identity()
        self.b = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.b(self.body(self.a(batch[0]))).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=torch.Generator().manual_seed(0)))
        return torch.utils.data.DataLoader(data, batch_size=2)


class Aliased(_Net):
    """``view`` is a parameter over the first two rows of ``a.weight``'s storage."""

    def __init__(self) -> None:
        super().__init__()
        self.view = nn.Parameter(self.a.weight.data[:2])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) + self.view.sum()


class Complex(_Net):
    def __init__(self) -> None:
        super().__init__()
        self.phase = nn.Parameter(torch.randn(4, dtype=torch.complex64))


class Sparse(_Net):
    def __init__(self) -> None:
        super().__init__(nn.Embedding(8, 4, sparse=True))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.b(self.body((batch[0].abs() * 7).long().clamp(max=7)).sum(1)).square().mean()


class Empty(nn.Module):
    """A module whose only parameter has no elements: a unit of its own under ``unit_modules``."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.empty(0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.p.sum()


REFUSED = {
    Aliased: r"parameters 'view' and 'a\.weight' share memory \(one is a view of the other's storage\)",
    Complex: r"parameter 'phase' in unit '.*' is complex \(torch\.complex64\).*torch\.view_as_real",
    Sparse: r"'body' is a Embedding with sparse=True.*Build it with sparse=False",
}


def _trained(strategy: Any, world_size: int, model: L.LightningModule) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    quiet_trainer(strategy=strategy, devices=world_size, max_steps=3).fit(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _cases(rank: int, world_size: int) -> None:
    for name, cls in STAGES.items():
        for model_class, pattern in REFUSED.items():
            torch.manual_seed(0)
            model = model_class()
            before = {k: v.clone() for k, v in model.state_dict().items()}
            with pytest.raises(ValueError, match=pattern):
                quiet_trainer(strategy=cls(), devices=world_size, max_steps=1).fit(model)
            assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()), (name, model_class)
        # A unit of 0-element parameters trains as under DDP (it raised ZeroDivisionError in backward).
        torch.manual_seed(0)
        ddp = _trained("ddp", world_size, _Net(Empty()))
        torch.manual_seed(0)
        zero = _trained(cls(unit_modules=[nn.Linear, Empty]), world_size, _Net(Empty()))
        assert ddp.keys() == zero.keys() and all(torch.equal(ddp[k], zero[k]) for k in ddp), name
    # The Fabric door refuses the same models with the same messages.
    fabric = Fabric(strategy="zero3", accelerator="cpu", devices=world_size)
    fabric.launch()
    for model_class, pattern in REFUSED.items():
        with pytest.raises(ValueError, match=pattern):
            fabric.setup_module(model_class())


def test_unshardable_parameters_are_refused_at_setup_and_empty_units_train_as_ddp() -> None:
    spawn(_cases, world_size=2, timeout=600)


def test_checkpoint_io_plugins_the_strategies_would_never_call_are_refused_where_they_are_set() -> None:
    """``AsyncCheckpointIO()`` means ``async_save=True`` (see tests/test_async_save.py); a plugin the strategies would
    never call, alone or inside ``AsyncCheckpointIO``, is refused wherever it is set."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    import lightning_zero.fabric as zero_fabric

    class Remote(TorchCheckpointIO):  # a user's plugin: another destination for the same files
        pass

    for make in (
        lambda io: (
            L.Trainer(strategy=ZeRO3Strategy(), plugins=[io], accelerator="cpu", devices=2, logger=False).strategy
        ),
        lambda io: ZeRO2Strategy(checkpoint_io=io),
        lambda io: Fabric(strategy=zero_fabric.ZeRO1Strategy(), plugins=[io], accelerator="cpu", devices=2).strategy,
    ):
        assert make(AsyncCheckpointIO()).async_save is True
        with pytest.raises(ValueError, match=r"AsyncCheckpointIO\(Remote\(...\)\) would never call Remote"):
            make(AsyncCheckpointIO(Remote()))
        with pytest.raises(ValueError, match="the checkpoint_io plugin Remote would never be called"):
            make(Remote())
    with pytest.raises(TypeError, match="async_save must be True or False"):
        ZeRO3Strategy(async_save="yes")  # type: ignore[arg-type]
    # Lightning's default, given explicitly, is what the strategies do anyway.
    assert type(ZeRO3Strategy(checkpoint_io=TorchCheckpointIO()).checkpoint_io) is TorchCheckpointIO
