"""Small LightningModules shared by the Trainer-level tests.

``ParityNet`` switches on, one flag at a time, every case the parity invariant lists: several
param groups, LR schedulers, frozen parameters, a weight tied between two submodules, a module
called twice, a root-level parameter, parameters unused in some steps, BatchNorm buffers and
manual optimization with two optimizers. ``rank_dependent`` uses a layer on rank 0 only
(DDP with ``find_unused_parameters=True`` and stages 1 and 2 handle it; stage 3 cannot, see docs).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, DIM, HIDDEN, SEQ = 13, 8, 16, 6


def token_data(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class ParityNet(L.LightningModule):
    def __init__(
        self,
        optimizer: str = "adamw",
        param_groups: bool = False,
        scheduler: str | None = None,
        frozen: bool = False,
        unused: bool = False,
        rank_dependent: bool = False,
        batchnorm: bool = False,
        manual: bool = False,
        batch_size: int = 4,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = not manual
        self.emb = nn.Embedding(VOCAB, DIM)
        self.scale = nn.Parameter(torch.ones(DIM))  # owned by the LightningModule itself
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.norm = nn.BatchNorm1d(DIM) if batchnorm else nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.sometimes = nn.Linear(DIM, DIM) if unused or rank_dependent else None
        self.fixed = nn.Linear(DIM, DIM) if frozen else None
        if frozen:
            self.fixed.requires_grad_(False)
            self.down.bias.requires_grad_(False)
        self.critic = nn.Sequential(nn.Linear(VOCAB, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1)) if manual else None
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) * self.scale
        for _ in range(2):  # the same submodules twice in one forward
            h = h + self.down(torch.relu(self.up(h)))
        if self.fixed is not None:
            h = h + self.fixed(h)
        use_sometimes = self.global_rank == 0 if self.hparams.rank_dependent else self.global_step % 2 == 0
        if self.sometimes is not None and use_sometimes:
            h = h + self.sometimes(h)
        if isinstance(self.norm, nn.BatchNorm1d):
            h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        else:
            h = self.norm(h)
        return self.head(h)

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        if self.critic is None:
            loss = self._loss(batch)
            self.losses.append(loss.item())
            return loss
        gen_opt, critic_opt = self.optimizers()
        x, _ = batch
        fake = self(x).softmax(-1)
        with self.toggled_optimizer(critic_opt):  # critic: real one-hots up, generated down
            real = nn.functional.one_hot(batch[1], VOCAB).float()
            critic_loss = self.critic(fake.detach()).mean() - self.critic(real).mean()
            critic_opt.zero_grad()
            self.manual_backward(critic_loss)
            critic_opt.step()
        with self.toggled_optimizer(gen_opt):
            gen_loss = -self.critic(self(x).softmax(-1)).mean() + 0.1 * self._loss(batch)
            gen_opt.zero_grad()
            self.manual_backward(gen_loss)
            gen_opt.step()
        self.losses.append(critic_loss.item())
        self.losses.append(gen_loss.item())
        return None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def _make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        kind = self.hparams.optimizer
        if kind == "adamw":
            return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        if kind == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
        if kind == "rmsprop":
            return torch.optim.RMSprop(params, lr=1e-2, momentum=0.5)
        if kind == "adagrad":
            return torch.optim.Adagrad(params, lr=0.1)
        if kind == "lbfgs":
            return torch.optim.LBFGS(params)
        raise ValueError(kind)

    def configure_optimizers(self) -> Any:
        if self.critic is not None:
            critic = set(self.critic.parameters())
            gen = [p for p in self.parameters() if p not in critic]
            return [self._make_optimizer(gen), self._make_optimizer(list(critic))]
        if self.hparams.param_groups:
            matrices = [p for p in self.parameters() if p.dim() >= 2]
            vectors = [p for p in self.parameters() if p.dim() < 2]
            groups = [{"params": matrices}, {"params": vectors, "lr": 3e-3, "weight_decay": 0.0}]
            optimizer = self._make_optimizer(groups)
        else:
            optimizer = self._make_optimizer(self.parameters())
        if self.hparams.scheduler == "step":
            sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if self.hparams.scheduler == "epoch":
            sched = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.7)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}
        return optimizer

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_data(64, seed=0), batch_size=self.hparams.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(token_data(16, seed=1), batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(token_data(16, seed=2), batch_size=self.hparams.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(token_data(16, seed=3), batch_size=self.hparams.batch_size)


def quiet_trainer(**kwargs: Any) -> L.Trainer:
    """A Trainer for tests: CPU, no logger, no checkpoints, no progress bar, no sanity check."""
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    defaults.update(kwargs)
    return L.Trainer(**defaults)
