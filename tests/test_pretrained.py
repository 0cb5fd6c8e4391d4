"""Pretrained weights into sharded models: ``lightning_zero.from_pretrained`` and ``load_weights``, written in
``configure_model`` (or under ``fabric.init_module()``) as users write them, against DDP running the same code (the
plain ``from_pretrained`` there). The "pretrained" checkpoints are tiny models saved in the test with
``save_pretrained`` (no downloads). See [Note: pretrained weights under meta init] in
``lightning_zero/engine/hf/weights.py``."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import lightning_zero
from lightning_zero.engine.comm.control import CollectiveMismatchError
from lightning_zero.engine.errors import CorruptCheckpointError
from lightning_zero.engine.hf.weight_files import WeightFiles
from lightning_zero.engine.hf.weights import plan_weight_load
from lightning_zero.engine.meta.init_trace import MetaInitError, record_meta_init
from tests.distributed import spawn
from tests.models import quiet_trainer
from tests.real_models import build, dataset, logits, save_pretrained

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
        load_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.name, self.path, self.plain, self.export, self.rank0_export = name, path, plain, export, rank0_export
        self.lora, self.load_kwargs = lora, load_kwargs or {}
        self.model: nn.Module | None = None
        self.loaded: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        if self.model is None:
            load = transformers.AutoModelForCausalLM.from_pretrained if self.plain else None
            if load is not None:
                self.model = load(self.path, **self.load_kwargs)
            else:
                self.model = lightning_zero.from_pretrained(
                    transformers.AutoModelForCausalLM, self.path, **self.load_kwargs
                )
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


def _trainer_cases(rank: int, world_size: int, paths: dict[str, str], hostile: dict[str, str]) -> None:
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
    # save_pretrained on rank 0 only: its state_dict() gathers, which rank 1 does not join; named, with what to pass.
    module = FineTune("llama", paths["llama"], export=f"{paths['llama']}-rank0", rank0_export=True)
    with pytest.raises(CollectiveMismatchError, match=r"is_main_process=trainer\.is_global_zero") as raised:
        quiet_trainer(strategy="zero3", devices=2, max_steps=1).fit(module)
    assert "(state_dict())" in str(raised.value) and "teardown" in str(raised.value), raised.value
    # What transformers wrote before its state_dict() call stays, as the message and docs/huggingface.md say.
    assert sorted(os.listdir(f"{paths['llama']}-rank0")) == ["config.json", "generation_config.json"]
    assert "has written config.json (and generation_config.json" in str(raised.value), raised.value
    # Forged offsets (one tensor's bytes inside another's): refused on every rank when the file is opened, naming it
    # and the tensors, where the model would otherwise train on the wrong bytes.
    module = FineTune("llama", hostile["overlap"])
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors' is not a valid safetensors file") as raised:
        quiet_trainer(strategy="zero3", devices=2, max_steps=1).fit(module)
    assert "overlaps tensor 'model.norm.weight'" in str(raised.value), raised.value
    # An int32 tensor for a float weight is not cast into it (transformers refuses it too).
    module = FineTune("llama", hostile["int32"])
    with pytest.raises(MetaInitError, match=r"model\.norm\.weight \(the file's 'model\.norm\.weight' is I32"):
        quiet_trainer(strategy="zero3", devices=2, max_steps=1).fit(module)
    # A bf16 checkpoint with unused float8 and uint16 tensors: no dtype gives transformers' (DDP's) float32, "auto"
    # the checkpoint's bfloat16, with the same values and the same config.
    for load_kwargs in ({}, {"dtype": "auto"}, {"torch_dtype": "auto"}):
        reference = transformers.AutoModelForCausalLM.from_pretrained(hostile["bf16"], **load_kwargs)
        L.seed_everything(7, verbose=False)
        module = FineTune("llama", hostile["bf16"], load_kwargs=load_kwargs)
        quiet_trainer(strategy="zero3", devices=2, max_steps=1).fit(module)
        assert module.model.config.dtype == reference.config.dtype, load_kwargs
        for key, value in reference.state_dict().items():
            assert module.loaded[key].dtype == value.dtype and torch.equal(module.loaded[key], value), load_kwargs


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pretrained")
    paths = {}
    # One file each, and sharded with an index (model.safetensors.index.json, pytorch_model.bin.index.json).
    for name, safe, shard in (("llama", True, None), ("gpt2", True, None), ("gpt2-bin", False, "40KB")):
        torch.manual_seed(3)
        model = build(name.split("-")[0], layers=3)
        save_pretrained(model, root / name, safe_serialization=safe, max_shard_size=shard or "5GB")
        paths[name] = str(root / name)
    torch.manual_seed(3)
    build("llama", layers=3).save_pretrained(root / "llama-shards", max_shard_size="40KB")
    assert len(list((root / "llama-shards").glob("*.safetensors"))) > 1
    assert len(list((root / "gpt2-bin").glob("pytorch_model-*.bin"))) > 1
    paths["llama-shards"] = str(root / "llama-shards")
    return paths


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], edit: Any = None) -> None:
    """``tensors`` as a safetensors file, its header changed by ``edit(header)`` first (forged), the data kept."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + length])
    if edit is not None:
        edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + length :])


def _hostile_checkpoints(source: str, root: Path) -> dict[str, str]:
    """Copies of the llama checkpoint at ``source``: forged offsets, an int32 weight, bf16 with unused tensors."""
    from safetensors.torch import load_file

    tensors = load_file(f"{source}/model.safetensors")
    paths = {}
    for name in ("overlap", "int32", "bf16"):
        shutil.copytree(source, root / name)
        paths[name] = str(root / name)

    def overlap(header: dict[str, Any]) -> None:  # model.norm.weight's bytes moved onto the embedding's first ones
        begin = header["model.embed_tokens.weight"]["data_offsets"][0]
        norm = header["model.norm.weight"]["data_offsets"]
        header["model.norm.weight"]["data_offsets"] = [begin, begin + norm[1] - norm[0]]

    _write_safetensors(root / "overlap" / "model.safetensors", tensors, overlap)
    ints = {**tensors, "model.norm.weight": torch.ones_like(tensors["model.norm.weight"], dtype=torch.int32)}
    _write_safetensors(root / "int32" / "model.safetensors", ints)
    halves = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
    halves["unused.f8"] = torch.ones(4).to(torch.float8_e4m3fn)
    halves["unused.u16"] = torch.ones(4, dtype=torch.uint16)
    _write_safetensors(root / "bf16" / "model.safetensors", halves)
    config = json.loads((root / "bf16" / "config.json").read_text())
    config["dtype"] = "bfloat16"  # as save_pretrained records a bf16 model
    (root / "bf16" / "config.json").write_text(json.dumps(config))
    return paths


def test_from_pretrained_in_configure_model_trains_as_ddp_does(pretrained: dict[str, str], tmp_path: Path) -> None:
    hostile = _hostile_checkpoints(pretrained["llama"], tmp_path)
    spawn(_trainer_cases, world_size=2, timeout=600, paths=pretrained, hostile=hostile)


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
    # LitGPT's pretraining flow as pretrain.py writes it: the build under init_module(empty_init=True), then
    # initialize_weights, max_seq_length and tied embeddings after the block, before setup: recorded and replayed,
    # DDP's values (DDP's build runs under Lightning's _EmptyInit, which skips the construction's init calls).
    from lightning.fabric.utilities.init import _EmptyInit
    from litgpt import GPT, Config
    from litgpt.pretrain import initialize_weights

    config = Config(n_layer=2, n_embd=32, n_head=4, padded_vocab_size=64, block_size=16)
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy="zero3")
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        gpt = GPT(config)
    initialize_weights(fabric, gpt, n_layer=2, n_embd=32)
    gpt.transformer.wte.weight = gpt.lm_head.weight
    gpt.max_seq_length = 8  # rebuilds the rotary buffers, on meta
    gpt = fabric.setup(gpt)
    after = torch.rand(3)  # the random stream continues where DDP's does
    torch.manual_seed(0)
    with _EmptyInit(enabled=True):
        reference = GPT(config)
    initialize_weights(fabric, reference, n_layer=2, n_embd=32)
    reference.transformer.wte.weight = reference.lm_head.weight
    reference.max_seq_length = 8
    assert torch.equal(after, torch.rand(3))
    assert gpt.state_dict().keys() == reference.state_dict().keys()
    assert all(torch.equal(gpt.state_dict()[k], v) for k, v in reference.state_dict().items())
    assert torch.equal(gpt.module.cos, reference.cos) and gpt.module.cos.shape[0] == 8
    # A write the recording cannot see (one below the dispatcher, stood for by bumping the version counter as an
    # in-place write does) is still refused at setup.
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy="zero3")
    fabric.launch()
    with fabric.init_module():
        net = nn.Linear(4, 4)
    torch.autograd.graph.increment_version(net.weight)
    with pytest.raises(MetaInitError, match="written in place by code the meta-init recording cannot see"):
        fabric.setup(net)
    # LitGPT's finetune_lora: a base checkpoint loaded after setup with its own load_checkpoint
    # (model.load_state_dict(lazy_load(path), strict=False)), its LoRA layers renaming qkv.weight to
    # qkv.linear.weight (and lm_head.weight to lm_head.linear.weight) in their _load_from_state_dict.
    from litgpt.lora import GPT as LoRAGPT
    from litgpt.lora import Config as LoRAConfig
    from litgpt.utils import load_checkpoint

    base = Path(state).with_name("lit_model.pth")
    if fabric.global_rank == 0:
        torch.save(reference.state_dict(), base)
    fabric.barrier()
    lora = dict(lora_r=4, lora_alpha=8, lora_query=True, lora_value=True, lora_projection=True, lora_head=True)
    lora_config = LoRAConfig(n_layer=2, n_embd=32, n_head=4, padded_vocab_size=64, block_size=8, **lora)
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy="zero3")
    fabric.launch()
    torch.manual_seed(1)
    with fabric.init_module(empty_init=True):
        adapted = LoRAGPT(lora_config)
    adapted = fabric.setup(adapted)
    load_checkpoint(fabric, adapted, base, strict=False)
    torch.manual_seed(1)
    expected = LoRAGPT(lora_config)
    expected.load_state_dict(torch.load(base, weights_only=True), strict=False)
    got = adapted.state_dict()
    assert got.keys() == expected.state_dict().keys()
    assert all(torch.equal(got[k], v) for k, v in expected.state_dict().items() if "lora_" not in k)
    # The LoRA matrices the file does not hold: under empty_init=True DDP leaves lora_A uninitialized memory (its
    # kaiming_uniform_ skipped by _EmptyInit); here the skipped call is replayed, since nothing overwrote it, with
    # the random stream put back after it: defined values, the same on every rank.
    lora_a = torch.cat([v.flatten() for k, v in got.items() if k.endswith("lora_A")])
    assert bool(torch.isfinite(lora_a).all()) and bool(lora_a.abs().max() > 0)
    gathered = [torch.empty_like(lora_a) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, lora_a)
    assert all(torch.equal(g, lora_a) for g in gathered)
    assert all(not v.any() for k, v in got.items() if k.endswith("lora_B"))  # zeros_: not skipped, as under DDP


def test_from_pretrained_load_weights_and_litgpt_init_under_fabric(pretrained: dict[str, str], tmp_path: Path) -> None:
    torch.manual_seed(5)
    state = tmp_path / "net.pth"
    torch.save(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).state_dict(), state)
    spawn(_fabric_and_load_weights, world_size=2, timeout=300, path=pretrained["llama"], state=str(state))


_HUB_SCRIPT = """
import torch, transformers
import lightning_zero
from lightning_zero.engine import Comm, shard_model
from lightning_zero.engine.meta.init_trace import record_meta_init
with record_meta_init() as trace:  # as configure_model runs under stage 3
    model = lightning_zero.from_pretrained(transformers.AutoModelForCausalLM, "tiny-org/tiny-llama")
shard_model(model, stage=3, comm=Comm(), meta_init=trace)
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


def _two_tensors(path: Path, length: int | None = None, data: bytes = bytes(32), **entries: Any) -> Path:
    """A safetensors file written by hand: ``a`` (F32 [4], bytes [0, 16]) and ``b`` (F32 [2, 2], bytes [16, 32]),
    an entry replaced by ``entries``, and the header length ``length`` (default: the true one)."""
    header: dict[str, Any] = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 32]},
    }
    header.update(entries)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


_FORGED: dict[str, tuple[dict[str, Any], str]] = {
    "overlapping": (
        {"b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}},
        r"tensor 'b' \(bytes \[8, 24\]\) overlaps tensor 'a', which ends at 16",
    ),
    "negative": (
        {"a": {"dtype": "F32", "shape": [4], "data_offsets": [-8, 8]}},
        r"tensor 'a' has data_offsets \[-8, 8\], outside the data region of 32 bytes",
    ),
    "out of bounds": (
        {"b": {"dtype": "F32", "shape": [8], "data_offsets": [16, 48]}},
        r"tensor 'b' has data_offsets \[16, 48\], outside the data region of 32 bytes",
    ),
    "size not dtype x shape": (
        {"b": {"dtype": "F32", "shape": [2, 3], "data_offsets": [16, 32]}},
        r"tensor 'b' has data_offsets \[16, 32\] \(16 bytes\), but its dtype F32 and shape \[2, 3\] need 24 bytes",
    ),
    "hole": (
        {"b": {"dtype": "F32", "shape": [2], "data_offsets": [24, 32]}},
        r"bytes \[16, 24\] after tensor 'a' belong to no tensor \(before 'b'\)",
    ),
    "unknown dtype": ({"b": {"dtype": "F7", "shape": [4], "data_offsets": [16, 32]}}, r"dtype 'F7', which the format"),
    "offsets not integers": (
        {"b": {"dtype": "F32", "shape": [4], "data_offsets": [16.0, 32.0]}},
        r"tensor 'b' has data_offsets \[16\.0, 32\.0\], not two integers",
    ),
    "shape not integers": (
        {"b": {"dtype": "F32", "shape": [True, 4], "data_offsets": [16, 32]}},
        r"tensor 'b' has shape \[True, 4\], not a list of integers >= 0",
    ),
    "entry not a tensor": ({"b": [16, 32]}, r"the entry of tensor 'b' is not an object with dtype, shape"),
}


@pytest.mark.parametrize("case", list(_FORGED))
def test_forged_safetensors_offsets_are_refused_naming_the_file_and_tensor(tmp_path: Path, case: str) -> None:
    entries, message = _FORGED[case]
    path = _two_tensors(tmp_path / "model.safetensors", **entries)
    with pytest.raises(CorruptCheckpointError, match=message) as raised:
        WeightFiles.open(tmp_path)
    assert str(raised.value).startswith(f"{str(path)!r} is not a valid safetensors file: "), raised.value


def test_safetensors_header_lengths_and_shapes_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    valid = _two_tensors(path).read_bytes()
    true_length = struct.unpack("<Q", valid[:8])[0]
    assert WeightFiles.open(path).keys() == ["a", "b"]
    cases = {
        # A huge header length is refused with its figure, before anything is allocated for it.
        2**40: r"its header length says 1099511627776 bytes, more than the format's limit of 100000000",
        true_length + 100: rf"its header length says {true_length + 100} bytes, past the end of the file",
        true_length - 5: rf"its {true_length - 5}-byte header is not JSON",  # cut inside the JSON
        true_length + 8: rf"its {true_length + 8}-byte header is not JSON",  # reaching into the data
    }
    for length, message in cases.items():
        _two_tensors(path, length=length)
        with pytest.raises(CorruptCheckpointError, match=message):
            WeightFiles.open(path)
    _two_tensors(path, data=bytes(40))  # bytes after the last tensor
    with pytest.raises(CorruptCheckpointError, match=r"the last 8 bytes of the file \(after byte 32 of the data\)"):
        WeightFiles.open(path)
    path.write_bytes(b"\x10\x00\x00")
    with pytest.raises(CorruptCheckpointError, match="it has 3 bytes, fewer than the 8 of the header length"):
        WeightFiles.open(path)
    raw = b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "a": {"dtype": "F32", "shape": [4], ' + (
        b'"data_offsets": [16, 32]}}'
    )
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(32))
    with pytest.raises(CorruptCheckpointError, match="the header names 'a' twice"):
        WeightFiles.open(path)
    path.write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(CorruptCheckpointError, match="its header is a JSON list, not an object of tensors"):
        WeightFiles.open(path)


def test_unused_float8_and_unsigned_tensors_load_and_integer_tensors_are_not_cast(tmp_path: Path) -> None:
    """Every safetensors dtype is known: tensors nothing loads are not refused; an integer tensor is not cast into a
    float parameter, and a tensor torch cannot hold (F4) is refused only when a parameter asks for it."""
    weight, bias = torch.randn(3, 2), torch.randn(3)
    extra = {
        "f8": torch.ones(4).to(torch.float8_e4m3fn),
        "e5m2": torch.ones(4).to(torch.float8_e5m2),
        "u16": torch.ones(4, dtype=torch.uint16),
        "u32": torch.ones(4, dtype=torch.uint32),
        "u64": torch.ones(4, dtype=torch.uint64),
    }
    _write_safetensors(tmp_path / "w.safetensors", {"weight": weight, "bias": bias, **extra})
    files = WeightFiles.open(tmp_path / "w.safetensors")
    assert [files.dtype_name(k) for k in extra] == ["F8_E4M3", "F8_E5M2", "U16", "U32", "U64"]
    assert torch.equal(files.read_whole("f8").float(), torch.ones(4)) and files.dtype("u16") == torch.uint16
    linear = lightning_zero.load_weights(nn.Linear(2, 3), tmp_path / "w.safetensors")
    assert torch.equal(linear.weight, weight) and torch.equal(linear.bias, bias)
    # An int32 weight: refused naming the key, its dtype and the parameter's (load_state_dict would cast it).
    _write_safetensors(tmp_path / "int.safetensors", {"weight": weight.to(torch.int32), "bias": bias})
    with pytest.raises(MetaInitError, match=r"weight \(the file's 'weight' is I32 \(torch\.int32\), the model's is "):
        lightning_zero.load_weights(nn.Linear(2, 3), tmp_path / "int.safetensors")
    # A float8 weight is cast into a float32 parameter, as transformers casts it.
    _write_safetensors(tmp_path / "f8.safetensors", {"weight": weight.to(torch.float8_e5m2), "bias": bias})
    linear = lightning_zero.load_weights(nn.Linear(2, 3), tmp_path / "f8.safetensors")
    assert torch.equal(linear.weight, weight.to(torch.float8_e5m2).float())
    # F4 (two elements a byte) has no torch dtype: known to the header check, refused when a parameter needs it.
    header = {
        "weight": {"dtype": "F4", "shape": [3, 2], "data_offsets": [0, 3]},
        "bias": {"dtype": "F32", "shape": [3], "data_offsets": [3, 15]},
    }
    raw = json.dumps(header).encode()
    (tmp_path / "f4.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(15))
    files = WeightFiles.open(tmp_path / "f4.safetensors")
    assert files.dtype("weight") is None and files.shape("weight") == (3, 2)
    with pytest.raises(MetaInitError, match=r"the file's 'weight' is stored as F4, which torch .* has no dtype for"):
        plan_weight_load(nn.Linear(2, 3), files)


def _save_llama(path: Path, seed: int, **kwargs: Any) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = build("llama", layers=1)
    save_pretrained(model, path, **kwargs)
    return model.state_dict()


def test_a_directory_with_several_layouts_is_read_as_transformers_reads_it(tmp_path: Path) -> None:
    """model.safetensors before its sharded index, the sharded index before pytorch_model.bin, pytorch_model.bin
    before its index: each time the files transformers' from_pretrained loads."""
    layouts = [  # (what the folder holds first, what is added beside it)
        ({"max_shard_size": "20KB"}, {}),  # an index and shards, then model.safetensors: the single file wins
        ({}, {"max_shard_size": "20KB"}),  # model.safetensors, then an index beside it: still the single file
        ({"safe_serialization": False}, {"max_shard_size": "20KB"}),  # pytorch_model.bin, then a safetensors index
        ({"safe_serialization": False, "max_shard_size": "20KB"}, {"safe_serialization": False}),  # bin index + bin
    ]
    for number, (first, second) in enumerate(layouts):
        folder = tmp_path / str(number)
        _save_llama(folder, 1, **first)
        kept = {p.name: p.read_bytes() for p in folder.iterdir()}
        _save_llama(folder / "second", 2, **second)
        for extra in (folder / "second").iterdir():
            if extra.name not in kept or extra.name == "config.json":
                shutil.move(extra, folder / extra.name)
        shutil.rmtree(folder / "second")
        reference = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
        loaded = _files(str(folder))
        assert all(torch.equal(loaded[k], v) for k, v in reference.items() if k in loaded), (number, first, second)


def test_from_pretrained_dtype_and_subfolder_are_transformers_own(tmp_path: Path) -> None:
    """No dtype, "auto" (from the config, or from the weights where the config records none), a name and a
    torch.dtype, and a subfolder: the model built on meta and loaded has transformers' dtypes, values and config."""
    from lightning_zero.engine import Comm, shard_model

    torch.manual_seed(4)
    build("llama", layers=1).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    shutil.copytree(tmp_path / "bf16", tmp_path / "unrecorded")
    config = json.loads((tmp_path / "unrecorded" / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (tmp_path / "unrecorded" / "config.json").write_text(json.dumps(config))
    shutil.copytree(tmp_path / "bf16", tmp_path / "nested" / "inner")
    cases = [
        ("bf16", {}),  # float32 in transformers 4, not the checkpoint's bfloat16
        (
            "bf16",
            {"torch_dtype": "auto"},
        ),  # "auto": the config's dtype, as transformers reads it (not a torch attribute)
        ("bf16", {"dtype": "auto"}),
        ("unrecorded", {"dtype": "auto"}),
        ("bf16", {"torch_dtype": "float16"}),
        ("bf16", {"dtype": torch.float64, "torch_dtype": torch.float16}),  # dtype wins, as there
        ("nested", {"subfolder": "inner", "dtype": "auto"}),  # the weights are read from 'nested/inner'
    ]
    for name, kwargs in cases:
        path = str(tmp_path / name)
        with record_meta_init() as trace:
            model = lightning_zero.from_pretrained(transformers.AutoModelForCausalLM, path, **kwargs)
        shard_model(model, stage=3, comm=Comm(), meta_init=trace)
        reference = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
        assert model.config.dtype == reference.config.dtype, (name, kwargs)
        state = model.state_dict()
        for key, value in reference.state_dict().items():
            assert state[key].dtype == value.dtype and torch.equal(state[key], value), (name, kwargs, key)
    with pytest.raises(ValueError, match=r"dtype='float17' is not a dtype: pass a torch\.dtype"):
        with record_meta_init():
            lightning_zero.from_pretrained(transformers.AutoModelForCausalLM, str(tmp_path / "bf16"), dtype="float17")
