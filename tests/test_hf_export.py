"""A fine-tuned sharded model written as a Hugging Face checkpoint by every rank at once
(``strategy.save_pretrained(module, path)``, see [Note: writing a Hugging Face checkpoint] in
``lightning_zero/engine/checkpoint/hf_export.py``), read back by plain ``from_pretrained`` in a fresh process: the
weights and the logits are bitwise the trained ones, under the Trainer and under Fabric."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import lightning_zero
from lightning_zero import ZeRO3Strategy
from tests.distributed import spawn
from tests.models import quiet_trainer
from tests.real_models import build, dataset, logits

transformers = pytest.importorskip("transformers")
PROMPT = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))


class Export(L.LightningModule):
    def __init__(self, name: str, path: str, out: str, ckpt: str | None = None) -> None:
        super().__init__()
        self.name, self.path, self.out, self.ckpt = name, path, out, ckpt
        self.trained: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        self.model = lightning_zero.from_pretrained(transformers.AutoModelForCausalLM, self.path)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = logits(self.name, self.model, x)
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def on_train_end(self) -> None:
        self.trainer.strategy.save_pretrained(self.model, self.out)  # on every rank: each writes its file
        if self.ckpt is not None:  # a training checkpoint, for the offline conversion
            self.trainer.save_checkpoint(self.ckpt)
        self.trained = {k: v.clone() for k, v in self.model.state_dict().items()}
        with torch.no_grad():  # the sharded model's own forward (under stage 3 it gathers each unit)
            self.trained["<logits>"] = self.model(PROMPT).logits

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(self.name, 8), batch_size=1)


def _export(rank: int, world_size: int, paths: dict[str, str], root: str) -> dict[str, dict[str, torch.Tensor]]:
    trained = {}
    for name, path in paths.items():
        for strategy in ("zero2", "zero3"):
            ckpt = f"{root}/{name}-{strategy}-sharded.ckpt" if strategy == "zero3" else None
            module = Export(name, path, f"{root}/{name}-{strategy}", ckpt=ckpt)
            chosen = ZeRO3Strategy(checkpoint_format="sharded") if strategy == "zero3" else strategy
            quiet_trainer(strategy=chosen, devices=world_size, max_steps=3).fit(module)
            trained[f"{name}-{strategy}"] = module.trained
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy="zero3")
    fabric.launch()
    with fabric.init_module():
        model = lightning_zero.from_pretrained(transformers.AutoModelForCausalLM, paths["llama"])
    model = fabric.setup(model)
    fabric.strategy.save_pretrained(model, f"{root}/llama-fabric")
    trained["llama-fabric"] = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        trained["llama-fabric"]["<logits>"] = model(PROMPT).logits
    return trained


def test_export_as_a_hugging_face_checkpoint_from_every_rank(tmp_path: Path) -> None:
    paths = {}
    for name in ("llama", "gpt2"):
        torch.manual_seed(3)
        build(name, layers=3).save_pretrained(tmp_path / name)
        paths[name] = str(tmp_path / name)
    results = spawn(_export, world_size=2, timeout=600, paths=paths, root=str(tmp_path))
    for name in paths:  # offline, on this process: a sharded training checkpoint into a Hugging Face one
        trained = {k: v for k, v in results[0][f"{name}-zero3"].items() if k != "<logits>"}
        out = lightning_zero.export_pretrained(
            tmp_path / f"{name}-zero3-sharded.ckpt", tmp_path / f"{name}-offline", config=paths[name]
        )
        state = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
        assert set(state) == set(trained) and all(torch.equal(state[k], v) for k, v in trained.items()), name
    for key, trained in results[0].items():
        expected_logits = trained.pop("<logits>")
        out = tmp_path / key
        index = json.loads((out / "model.safetensors.index.json").read_text())
        files = set(index["weight_map"].values())
        assert files == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}, files
        assert (out / "config.json").is_file()
        if key.startswith("gpt2"):  # the tied head is stored once, under the input embeddings' name
            assert "lm_head.weight" not in index["weight_map"] and "transformer.wte.weight" in index["weight_map"]
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)  # this process: fresh, no strategy
        state = reloaded.state_dict()
        assert set(state) == set(trained), key
        assert all(torch.equal(state[k], v) for k, v in trained.items()), key
        with torch.no_grad():
            assert torch.equal(reloaded(PROMPT).logits, expected_logits), key
