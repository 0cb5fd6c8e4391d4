"""``model.generate(...)`` in ``validation_step`` with a different number of new tokens per rank (as when one rank
reaches the end-of-sequence token first): under stage 3 the ranks then run different numbers of forwards, and the
ranks that are done keep serving the gathers of those still generating (the evaluation join, see [Note: uneven
evaluation] in ``lightning_zero/strategies/agreement.py``), so the tokens are DDP's with or without
``synced_gpus=True``."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from tests.distributed import spawn
from tests.models import quiet_trainer
from tests.real_models import build

pytest.importorskip("transformers")


class Generate(L.LightningModule):
    """Greedy generation of ``1 + 4 * rank`` new tokens per prompt (``synced``: with ``synced_gpus=True``)."""

    def __init__(self, synced: bool) -> None:
        super().__init__()
        self.synced = synced
        self.generated: list[torch.Tensor] = []

    def configure_model(self) -> None:
        torch.manual_seed(0)  # inside configure_model: under stage 3 this is recorded and replayed in order
        self.model = build("gpt2", layers=3)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        out = self.model.generate(
            batch[0], max_new_tokens=1 + 4 * self.global_rank, do_sample=False, pad_token_id=0, synced_gpus=self.synced
        )
        self.generated.append(out)

    def val_dataloader(self) -> DataLoader:
        prompts = torch.randint(1, 64, (6, 3), generator=torch.Generator().manual_seed(1))
        return DataLoader(torch.utils.data.TensorDataset(prompts), batch_size=1)


def _generate(rank: int, world_size: int) -> None:
    results = {}
    for strategy, synced in (("ddp", False), ("zero3", False), ("zero3", True)):
        module = Generate(synced)
        quiet_trainer(strategy=strategy, devices=world_size, limit_val_batches=None).validate(module, verbose=False)
        results[strategy, synced] = module.generated
    reference = results["ddp", False]
    assert len(reference) == 3 and max(t.shape[1] for t in reference) > (3 + 1 if rank == 1 else 3)  # rank 1: more
    for key in (("zero3", False), ("zero3", True)):
        assert all(torch.equal(a, b) for a, b in zip(reference, results[key], strict=True)), key


def test_generate_with_lengths_that_differ_per_rank() -> None:
    spawn(_generate, world_size=2, timeout=300)
