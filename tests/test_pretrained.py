"""Pretrained weights into sharded models: ``lightning_zero.from_pretrained`` and ``load_weights``, written in
``configure_model`` (or under ``fabric.init_module()``) as users write them, against DDP running the same code (the
plain ``from_pretrained`` there). The "pretrained" checkpoints are tiny models saved in the test with
``save_pretrained`` (no downloads). See [Note: pretrained weights under meta init] in
``lightning_zero/engine/meta/pretrained.py``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import lightning_zero
from lightning_zero.engine.comm.control import CollectiveMismatchError
from lightning_zero.engine.io.weight_files import WeightFiles
from lightning_zero.engine.meta.init_trace import MetaInitError
from tests.distributed import spawn
from tests.models import quiet_trainer
from tests.real_models import build, dataset, logits

REPO = Path(__file__).resolve().parents[1]
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")


class FineTune(L.LightningModule):
    """Fine-tunes the model saved at ``path``, loaded in ``configure_model`` (``plain``: by transformers' own call)."""

    def __init__(
        self,
        name: str,
        path: str,
        plain: bool = False,
        export: str | None = None,
        rank0_export: bool = False,
        lora: bool = False,
    ) -> None:
        super().__init__()
        self.name, self.path, self.plain, self.export, self.rank0_export = name, path, plain, export, rank0_export
        self.lora = lora
        self.model: nn.Module | None = None
        self.loaded: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        if self.model is None:
            load = transformers.AutoModelForCausalLM.from_pretrained if self.plain else None
            if load is not None:
                self.model = load(self.path)
            else:
                self.model = lightning_zero.from_pretrained(transformers.AutoModelForCausalLM, self.path)
            if self.lora:  # peft moves each adapted weight under base_layer: the load follows the tensors
                import peft

                config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
                self.model = peft.get_peft_model(self.model, config)

    def on_fit_start(self) -> None:
        self.loaded = {k: v.clone() for k, v in self.model.state_dict().items()}  # gathers, on every rank

    def on_train_end(self) -> None:
        if self.export is not None and self.rank0_export:  # the pattern that cannot work under stage 3
            if self.trainer.is_global_zero:
                self.model.save_pretrained(self.export)
        elif self.export is not None:  # on every rank, as the docs say: the state dict gathers, rank 0 writes
            self.model.save_pretrained(self.export, is_main_process=self.trainer.is_global_zero)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = logits(self.name, self.model, x)
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(self.name, 20), batch_size=1)  # 10 steps on 2 ranks


def _fit(
    name: str, path: str, strategy: str, export: str | None = None, lora: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    L.seed_everything(7, verbose=False)
    module = FineTune(name, path, export=export, lora=lora)
    quiet_trainer(strategy=strategy, devices=2, max_steps=10).fit(module)
    return module.loaded, {k: v.clone() for k, v in module.model.state_dict().items()}


def _files(path: str) -> dict[str, torch.Tensor]:
    files = WeightFiles.open(path)
    return {key: files.read_whole(key) for key in files.keys()}


def _trainer_cases(rank: int, world_size: int, paths: dict[str, str]) -> None:
    for name, path in paths.items():
        start, end = _fit(name.split("-")[0], path, "ddp")
        on_disk = _files(path)
        assert all(torch.equal(start[k], v.to(start[k].dtype)) for k, v in on_disk.items() if k in start), name
        for strategy in ("zero2", "zero3"):
            export = f"{path}-{strategy}-export"
            loaded, trained = _fit(name.split("-")[0], path, strategy, export=export)
            for key, value in start.items():
                assert torch.equal(loaded[key], value), (name, strategy, "loaded", key)
            for key, value in end.items():
                assert torch.equal(trained[key], value), (name, strategy, "trained", key)
            torch.distributed.barrier()
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(export).state_dict()
            assert all(torch.equal(reloaded[k], v) for k, v in end.items()), (name, strategy, "exported")
    # LoRA with peft on the loaded model: only the adapters train, bitwise as under DDP.
    start, end = _fit("llama", paths["llama"], "ddp", lora=True)
    for strategy in ("zero2", "zero3"):
        loaded, trained = _fit("llama", paths["llama"], strategy, lora=True)
        assert all(torch.equal(loaded[k], v) for k, v in start.items()), (strategy, "lora loaded")
        assert all(torch.equal(trained[k], v) for k, v in end.items()), (strategy, "lora trained")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in end.items())  # the adapters did train
    # transformers' own call cannot run on meta: the error names the function that does.
    module = FineTune("llama", paths["llama"], plain=True)
    with pytest.raises(MetaInitError, match=r"lightning_zero\.from_pretrained\(AutoModelForCausalLM, path"):
        quiet_trainer(strategy="zero3", devices=2, max_steps=1).fit(module)
    # save_pretrained on rank 0 only: its state_dict() gathers, which rank 1 does not join; named, with the fix.
    module = FineTune("llama", paths["llama"], export=f"{paths['llama']}-rank0", rank0_export=True)
    with pytest.raises(CollectiveMismatchError, match=r"is_main_process=trainer\.is_global_zero") as raised:
        quiet_trainer(strategy="zero3", devices=2, max_steps=1).fit(module)
    assert "(state_dict())" in str(raised.value) and "teardown" in str(raised.value), raised.value


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pretrained")
    paths = {}
    # One file each, and sharded with an index (model.safetensors.index.json, pytorch_model.bin.index.json).
    for name, safe, shard in (("llama", True, None), ("gpt2", True, None), ("gpt2-bin", False, "40KB")):
        torch.manual_seed(3)
        model = build(name.split("-")[0], layers=3)
        model.save_pretrained(root / name, safe_serialization=safe, max_shard_size=shard or "5GB")
        paths[name] = str(root / name)
    torch.manual_seed(3)
    build("llama", layers=3).save_pretrained(root / "llama-shards", max_shard_size="40KB")
    assert len(list((root / "llama-shards").glob("*.safetensors"))) > 1
    assert len(list((root / "gpt2-bin").glob("pytorch_model-*.bin"))) > 1
    paths["llama-shards"] = str(root / "llama-shards")
    return paths


def test_from_pretrained_in_configure_model_trains_as_ddp_does(pretrained: dict[str, str]) -> None:
    spawn(_trainer_cases, world_size=2, timeout=600, paths=pretrained)


def _fabric_and_load_weights(rank: int, world_size: int, path: str, state: str) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy="zero3")
    fabric.launch()
    with fabric.init_module():
        model = lightning_zero.from_pretrained(transformers.AutoModelForCausalLM, path)
    model = fabric.setup(model)
    expected = _files(path)
    for key, value in model.state_dict().items():
        if key in expected:
            assert torch.equal(value, expected[key].to(value.dtype)), key
    # Any state dict on disk into any module built on meta (here a torch.save file, as LitGPT's lit_model.pth).
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy="zero3")
    fabric.launch()
    with fabric.init_module():
        net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        lightning_zero.load_weights(net, state)
    net = fabric.setup(net)
    saved = torch.load(state, weights_only=True)
    assert all(torch.equal(net.state_dict()[k], v) for k, v in saved.items())
    # LitGPT's pretraining flow: its initialize_weights after the init_module block wrote on meta and did nothing;
    # refused, saying where the call goes. Inside the block it gives an ordinary construction's values.
    from litgpt import GPT, Config
    from litgpt.pretrain import initialize_weights

    config = Config(n_layer=2, n_embd=32, n_head=4, padded_vocab_size=64, block_size=8)
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy="zero3")
    fabric.launch()
    with fabric.init_module(empty_init=True):
        gpt = GPT(config)
    initialize_weights(fabric, gpt, n_layer=2, n_embd=32)
    with pytest.raises(MetaInitError, match=r"LitGPT: call initialize_weights\(fabric, model, \.\.\.\) there"):
        fabric.setup(gpt)
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy="zero3")
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        gpt = GPT(config)
        initialize_weights(fabric, gpt, n_layer=2, n_embd=32)
    gpt = fabric.setup(gpt)
    torch.manual_seed(0)
    reference = GPT(config)
    initialize_weights(fabric, reference, n_layer=2, n_embd=32)
    assert all(torch.equal(gpt.state_dict()[k], v) for k, v in reference.state_dict().items())


def test_from_pretrained_load_weights_and_litgpt_init_under_fabric(pretrained: dict[str, str], tmp_path: Path) -> None:
    torch.manual_seed(5)
    state = tmp_path / "net.pth"
    torch.save(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).state_dict(), state)
    spawn(_fabric_and_load_weights, world_size=2, timeout=300, path=pretrained["llama"], state=str(state))


_HUB_SCRIPT = """
import torch, transformers
import lightning_zero
from lightning_zero.engine import Comm, ShardedModel
from lightning_zero.engine.meta.init_trace import record_meta_init
with record_meta_init() as trace:  # as configure_model runs under stage 3
    model = lightning_zero.from_pretrained(transformers.AutoModelForCausalLM, "tiny-org/tiny-llama")
ShardedModel(model, stage=3, comm=Comm(), meta_init=trace)
reference = transformers.AutoModelForCausalLM.from_pretrained("tiny-org/tiny-llama")
state = model.state_dict()
assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())
print("hub id ok")
"""


def test_from_pretrained_takes_a_hub_id_from_the_cache(pretrained: dict[str, str], tmp_path: Path) -> None:
    """A hub id resolves to its snapshot in the Hugging Face cache (offline here: a cache made by hand)."""
    import shutil
    import subprocess
    import sys

    snapshot = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / "0"
    shutil.copytree(pretrained["llama"], snapshot)
    (tmp_path / "hub" / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("0")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _HUB_SCRIPT], env=env, capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert result.returncode == 0 and "hub id ok" in result.stdout, result.stdout + result.stderr
