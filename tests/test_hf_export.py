"""A fine-tuned sharded model written as a Hugging Face checkpoint by every rank at once
(``strategy.save_pretrained(module, path)``, see [Note: writing a Hugging Face checkpoint] in
``lightning_zero/engine/hf/export.py``), read back by plain ``from_pretrained`` in a fresh process: the
weights and the logits are bitwise the trained ones, under the Trainer and under Fabric, also into folders that
held another checkpoint (whose weights it replaces, keeping the other files), and the files put in place so that a
crash at any step leaves the earlier or the new checkpoint (see [Note: replacing a Hugging Face checkpoint] in
``lightning_zero/engine/io/weight_folder.py``). A peft ``PeftModel`` is saved as peft saves it: its adapter (peft's
files, loaded by peft) or the model with the adapter merged in, the same tensors as under DDP (see [Note: saving a
peft model] in ``lightning_zero/engine/hf/peft_export.py``)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import lightning_zero
from lightning_zero import ZeRO3Strategy
from lightning_zero.engine.errors import CheckpointSaveError, CollectiveMismatchError
from lightning_zero.engine.hf.export import replace_checkpoint
from lightning_zero.engine.io.ranks import Ranks
from lightning_zero.engine.io.weight_folder import is_weight_file, replacement_steps
from tests.distributed import spawn
from tests.models import quiet_trainer
from tests.real_models import build, dataset, logits, save_pretrained

transformers = pytest.importorskip("transformers")
# The output folders that already hold another model's checkpoint (its layouts, as save_pretrained's arguments).
HELD_ANOTHER = {
    "llama-zero3": ("llama", [{}]),
    "gpt2-zero2": ("gpt2", [{"safe_serialization": False}, {"max_shard_size": "60KB"}]),
    "llama-fabric": ("llama", [{"max_shard_size": "80KB"}]),  # two shards, of the names the new ones take
    "llama-after-fit": ("llama", [{"max_shard_size": "80KB"}]),
}
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


class PeftExport(Export):
    """``Export`` with peft's LoRA on the loaded Llama: saves the adapter and the merged model, through the strategy
    (``zero3``) or as peft users do under DDP (peft's own ``save_pretrained``, ``merge_and_unload`` on a copy)."""

    def configure_model(self) -> None:
        import peft

        super().configure_model()
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        self.model = peft.get_peft_model(self.model, config)

    def on_train_end(self) -> None:
        strategy = self.trainer.strategy
        if isinstance(strategy, ZeRO3Strategy):
            strategy.save_pretrained(self.model, self.out)  # the adapter
            strategy.save_pretrained(self.model, f"{self.out}-merged", merged=True)
            # What cannot be saved as asked is refused on every rank, before anything is gathered or written.
            with pytest.raises(CheckpointSaveError, match=r"holds peft's adapter layers .* pass the PeftModel itself"):
                strategy.save_pretrained(self.model.base_model.model, f"{self.out}-inner")
            with pytest.raises(CheckpointSaveError, match=r"merged=True\) merges a peft adapter into its base model"):
                strategy.save_pretrained(self.model.base_model.model.model, f"{self.out}-inner", merged=True)
            self.trainer.save_checkpoint(self.ckpt)
        else:
            self.model.save_pretrained(self.out, is_main_process=self.trainer.is_global_zero)
            if self.trainer.is_global_zero:
                copy.deepcopy(self.model).merge_and_unload().save_pretrained(f"{self.out}-merged")
        self.trained = {k: v.clone() for k, v in self.model.state_dict().items()}


def _export(rank: int, world_size: int, paths: dict[str, str], root: str) -> dict[str, dict[str, torch.Tensor]]:
    trained = {}
    # peft's LoRA on the Llama: the adapter and the merged model, from zero3 and as peft writes them under DDP.
    for strategy in ("ddp", "zero3"):
        L.seed_everything(7, verbose=False)  # the same initial adapter
        ckpt = f"{root}/lora-zero3.ckpt" if strategy == "zero3" else None
        module = PeftExport("llama", paths["llama"], f"{root}/lora-{strategy}", ckpt=ckpt)
        trainer = quiet_trainer(strategy=strategy, devices=world_size, max_steps=3)
        trainer.fit(module)
        trained[f"lora-{strategy}"] = module.trained
    # After fit the model is plain again: the same files, from its full parameters.
    trainer.strategy.save_pretrained(module.model, f"{root}/lora-after-fit")
    trainer.strategy.save_pretrained(module.model, f"{root}/lora-after-fit-merged", merged=True)
    for name, path in paths.items():
        for strategy in ("zero2", "zero3"):
            ckpt = f"{root}/{name}-{strategy}-sharded.ckpt" if strategy == "zero3" else None
            module = Export(name, path, f"{root}/{name}-{strategy}", ckpt=ckpt)
            chosen = ZeRO3Strategy(checkpoint_format="sharded") if strategy == "zero3" else strategy
            trainer = quiet_trainer(strategy=chosen, devices=world_size, max_steps=3)
            trainer.fit(module)
            trained[f"{name}-{strategy}"] = module.trained
            if (
                name == "llama" and strategy == "zero3"
            ):  # the model is plain again: transformers' own save, put in place
                trainer.strategy.save_pretrained(module.model, f"{root}/llama-after-fit")
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy="zero3")
    fabric.launch()
    with fabric.init_module():
        model = lightning_zero.from_pretrained(transformers.AutoModelForCausalLM, paths["llama"])
    model = fabric.setup(model)
    fabric.strategy.save_pretrained(model, f"{root}/llama-fabric")
    trained["llama-fabric"] = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        trained["llama-fabric"]["<logits>"] = model(PROMPT).logits
    # A PeftModel under Fabric (its LoRA B matrices made non-zero, as after training): its adapter, as above.
    import peft

    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy="zero3")
    fabric.launch()
    with fabric.init_module():
        model = lightning_zero.from_pretrained(transformers.AutoModelForCausalLM, paths["llama"])
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(model, lora)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param)
    model = fabric.setup(model)
    fabric.strategy.save_pretrained(model, f"{root}/lora-fabric")
    trained["lora-fabric"] = {k: v.clone() for k, v in model.state_dict().items()}
    # On rank 0 only (under stage 2 no gather would stop it): refused on both ranks before anything is written.
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy="zero2")
    fabric.launch()
    with fabric.init_module():
        model = lightning_zero.from_pretrained(transformers.AutoModelForCausalLM, paths["llama"])
    model = fabric.setup(model)
    with pytest.raises(CollectiveMismatchError, match=r"call it on every rank, not under `if trainer\.is_global_zero`"):
        if rank == 0:
            fabric.strategy.save_pretrained(model, f"{root}/llama-rank0")
        else:
            fabric.barrier()
    return trained


def test_export_as_a_hugging_face_checkpoint_from_every_rank(tmp_path: Path) -> None:
    paths = {}
    for name in ("llama", "gpt2"):
        torch.manual_seed(3)
        build(name, layers=3).save_pretrained(tmp_path / name)
        paths[name] = str(tmp_path / name)
    # Folders that already hold another model's checkpoint, which from_pretrained would read instead of shards and
    # an index written beside it: one model.safetensors; pytorch_model.bin and three shards; two shards of the
    # names the new ones take. Each has a README that must survive.
    for key, (name, layouts) in HELD_ANOTHER.items():
        torch.manual_seed(4)
        other = build(name, layers=3)
        for layout in layouts:
            save_pretrained(other, tmp_path / key, **layout)
        (tmp_path / key / "README.md").write_text("# my model\n")
    results = spawn(_export, world_size=2, timeout=600, paths=paths, root=str(tmp_path))
    _check_peft(results[0], paths["llama"], tmp_path)
    for name in paths:  # offline, on this process: a sharded training checkpoint into a Hugging Face one
        trained = {k: v for k, v in results[0][f"{name}-zero3"].items() if k != "<logits>"}
        out = lightning_zero.export_pretrained(
            tmp_path / f"{name}-zero3-sharded.ckpt", tmp_path / f"{name}-offline", config=paths[name]
        )
        state = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
        assert set(state) == set(trained) and all(torch.equal(state[k], v) for k, v in trained.items()), name
    # Into a folder holding another model's shards, index and pytorch_model.bin (which from_pretrained reads with
    # use_safetensors=False): only the new model.safetensors is left of any weights, the other files kept.
    trained, held = results[0]["llama-zero3"], tmp_path / "llama-offline-held"
    torch.manual_seed(4)
    for layout in ({"safe_serialization": False}, {"max_shard_size": "80KB"}):
        save_pretrained(build("llama", layers=3), held, **layout)
    (held / "README.md").write_text("# my model\n")
    lightning_zero.export_pretrained(tmp_path / "llama-zero3-sharded.ckpt", held, config=paths["llama"])
    kept = {"generation_config.json", "README.md"}  # the earlier save's other files
    assert {f.name for f in held.iterdir()} == {"model.safetensors", "config.json", *kept}
    state = transformers.AutoModelForCausalLM.from_pretrained(held).state_dict()
    assert all(torch.equal(state[k], v) for k, v in trained.items() if k != "<logits>")
    # After fit, rank 0's model.save_pretrained writes one model.safetensors: the earlier shards and index are gone.
    out, trained = tmp_path / "llama-after-fit", results[0]["llama-zero3"]
    state = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(state[k], v) for k, v in trained.items() if k != "<logits>")
    assert {f.name for f in out.iterdir() if is_weight_file(f.name)} == {"model.safetensors"}
    assert (out / "README.md").read_text() == "# my model\n"
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
        # The earlier checkpoint's weight files are gone (none left for any loader), its other files kept.
        assert {f.name for f in out.iterdir() if is_weight_file(f.name)} == {*files, "model.safetensors.index.json"}
        assert not any(f.name.startswith(".") for f in out.iterdir()), key  # nor anything of the save's staging
        if key in HELD_ANOTHER:
            assert (out / "README.md").read_text() == "# my model\n", key
    assert not (tmp_path / "llama-rank0").exists()  # the rank-0-only call wrote nothing


def _check_peft(results: dict[str, dict[str, torch.Tensor]], base: str, tmp_path: Path) -> None:
    """The peft cases of ``_export``, read back in this process (fresh, no strategy)."""
    import peft
    from safetensors.torch import load_file

    for key in ("lora-zero3", "lora-fabric"):
        out, trained = tmp_path / key, results.pop(key)
        assert {f.name for f in out.iterdir()} == {"adapter_model.safetensors", "adapter_config.json", "README.md"}
        model = transformers.AutoModelForCausalLM.from_pretrained(base)
        for reloaded in (
            peft.PeftModel.from_pretrained(model, out),
            peft.AutoPeftModelForCausalLM.from_pretrained(out),
        ):
            state = reloaded.state_dict()  # the base weights from `base`, the adapter's from the folder
            assert set(state) == set(trained), key
            assert all(torch.equal(state[k], v) for k, v in trained.items()), key
    # zero3's files hold DDP's tensors (training is bitwise DDP's): the adapter, as peft writes it, and the merged
    # model, as merge_and_unload() then save_pretrained write it.
    ddp, zero3 = tmp_path / "lora-ddp", tmp_path / "lora-zero3"
    assert json.loads((zero3 / "adapter_config.json").read_text()) == json.loads(
        (ddp / "adapter_config.json").read_text()
    )
    expected = load_file(ddp / "adapter_model.safetensors")
    for folder in (zero3, tmp_path / "lora-after-fit"):
        got = load_file(folder / "adapter_model.safetensors")
        assert set(got) == set(expected) and all(torch.equal(got[k], v) for k, v in expected.items()), folder
    assert any(v.abs().sum() > 0 for k, v in expected.items() if "lora_B" in k)  # the adapter trained
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lora-ddp-merged").state_dict()
    for folder in ("lora-zero3-merged", "lora-after-fit-merged"):
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / folder).state_dict()
        assert set(merged) == set(reference) and all(torch.equal(merged[k], v) for k, v in reference.items()), folder
    original = transformers.AutoModelForCausalLM.from_pretrained(base).state_dict()
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"], original["model.layers.0.self_attn.q_proj.weight"]
    )
    results.pop("lora-ddp")
    # Offline conversion of a PeftModel's training checkpoint: refused, saying how.
    with pytest.raises(ValueError, match=r"holds a peft PeftModel"):
        lightning_zero.export_pretrained(tmp_path / "lora-zero3.ckpt", tmp_path / "lora-offline", config=base)
    assert not (tmp_path / "lora-offline").exists()


def _state(folder: Path, **kwargs: Any) -> dict[str, torch.Tensor] | None:
    """What plain ``from_pretrained(folder)`` loads, or ``None`` where it refuses the folder."""
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs).state_dict()
    except OSError:
        return None


def _same(state: dict[str, torch.Tensor] | None, model: nn.Module) -> bool:
    return state is not None and all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("earlier", ["model.safetensors", "shards of the same names", "three shards", "bin"])
def test_a_crash_at_any_step_of_a_replacement_leaves_the_earlier_or_the_new_checkpoint(
    tmp_path: Path, earlier: str
) -> None:
    torch.manual_seed(0)
    old = build("llama", layers=1)
    torch.manual_seed(1)
    new = build("llama", layers=1)
    layout = {  # of the model's 54 KB
        "model.safetensors": {},
        "shards of the same names": {"max_shard_size": "32KB"},
        "three shards": {"max_shard_size": "21KB"},
        "bin": {"safe_serialization": False},
    }[earlier]
    save_pretrained(new, tmp_path / "new", max_shard_size="32KB")  # two shards and an index, as 2 ranks write them
    step, count = 0, None
    while count is None or step <= count:  # a crash after `step` steps, on a fresh copy each time
        folder = tmp_path / f"after-{step}"
        save_pretrained(old, folder, **layout)
        (folder / "README.md").write_text("kept")
        staging = folder / ".save_pretrained.tmp-0"
        shutil.copytree(tmp_path / "new", staging)
        staged = {f.name: f for f in staging.iterdir()}
        steps = replacement_steps(folder, staged)
        count = len(steps)
        for done in steps[:step]:
            done.apply()
        state = _state(folder)
        window = earlier == "shards of the same names" and state is None  # between the two indexes: refused
        assert _same(state, old) or _same(state, new) or window, (earlier, step)
        if step == count:
            assert _same(state, new) and (folder / "README.md").read_text() == "kept", earlier
            weights = {f.name for f in folder.iterdir() if is_weight_file(f.name)}
            assert weights == set(staged) - {"config.json", "generation_config.json"}, earlier
            assert _state(folder, use_safetensors=False) is None, earlier  # no .bin left to read the old weights
        else:
            assert _state(folder, use_safetensors=False) is None or _same(_state(folder, use_safetensors=False), old)
        step += 1


def test_a_failed_save_pretrained_leaves_the_folder_as_it_was(tmp_path: Path) -> None:
    alone = Ranks(0, 1, lambda obj: obj)
    torch.manual_seed(0)
    build("llama", layers=1).save_pretrained(tmp_path / "held")
    (tmp_path / "held" / "README.md").write_text("kept")
    before = {f.name: f.read_bytes() for f in (tmp_path / "held").iterdir()}

    def full_disk(staging: Path) -> list[str]:
        (staging / "model-00001-of-00001.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    for folder in (tmp_path / "held", tmp_path / "new" / "folder"):
        with pytest.raises(CheckpointSaveError, match=r"failed on rank\(s\) \[0\] \(rank 0: OSError: \[Errno 28\] No"):
            replace_checkpoint(alone, folder, full_disk)
    assert {f.name: f.read_bytes() for f in (tmp_path / "held").iterdir()} == before  # nothing new, nothing lost
    assert not (tmp_path / "new" / "folder").exists()  # the folder the save made is removed with it
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointSaveError, match=r"'.*file' is a file: save_pretrained writes a folder"):
        replace_checkpoint(alone, tmp_path / "file", full_disk)
    # A failure while the files are put in place names what from_pretrained reads then.
    (tmp_path / "held" / "model.safetensors.index.json").mkdir()

    def index(staging: Path) -> list[str]:
        (staging / "model.safetensors.index.json").write_text("{}")
        return ["model.safetensors.index.json"]

    with pytest.raises(
        CheckpointSaveError, match=r"from_pretrained now reads 'model\.safetensors' \(of the checkpoint"
    ):
        replace_checkpoint(alone, tmp_path / "held", index)
    assert not any(f.name.startswith(".") for f in (tmp_path / "held").iterdir())


def _lora(base: nn.Module, alpha: int, seed: int, **config: Any) -> nn.Module:
    """``base`` (a copy) with peft's LoRA on its attention's query projection, the B matrices drawn from ``seed``."""
    import peft

    torch.manual_seed(seed)
    lora = peft.LoraConfig(r=4, lora_alpha=alpha, target_modules=["q_proj"], lora_dropout=0.0, **config)
    model = peft.get_peft_model(copy.deepcopy(base), lora)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param)
    return model


def test_an_adapter_replaced_in_a_folder_is_read_as_the_earlier_the_new_or_refused(tmp_path: Path) -> None:
    import peft

    from lightning_zero.engine.hf.peft_export import ADAPTER_FOLDER, check_mergeable

    torch.manual_seed(0)
    base = build("llama", layers=1)
    old, new = _lora(base, alpha=8, seed=1), _lora(base, alpha=16, seed=2)  # the same shapes: a mix would load
    new.save_pretrained(tmp_path / "new")
    adapters = {"old": old, "new": new}

    def read(folder: Path) -> str | None:  # which adapter PeftModel.from_pretrained reads, None where it refuses
        try:
            loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), folder)
        except ValueError:
            return None
        state = loaded.state_dict()
        for label, adapter in adapters.items():
            same_config = loaded.peft_config["default"].lora_alpha == adapter.peft_config["default"].lora_alpha
            if same_config and all(torch.equal(state[k], v) for k, v in adapter.state_dict().items()):
                return label
        return "a mix"

    step, count = 0, None
    while count is None or step <= count:  # a crash after `step` steps, on a fresh copy each time
        folder = tmp_path / f"after-{step}"
        old.save_pretrained(folder, safe_serialization=False)  # adapter_model.bin, adapter_config.json, README.md
        (folder / "tokenizer.json").write_text("{}")
        staging = folder / ".save_pretrained.tmp-0"
        shutil.copytree(tmp_path / "new", staging)
        steps = ADAPTER_FOLDER.steps(folder, {f.name: f for f in staging.iterdir()})
        count = len(steps)
        for done in steps[:step]:
            done.apply()
        found = read(folder)
        assert found in ("old", "new", None), (step, found)
        assert (found is None) == (ADAPTER_FOLDER.read(folder) is None), step
        if step == count:
            assert found == "new" and (folder / "tokenizer.json").is_file()
            assert not (folder / "adapter_model.bin").exists()  # the earlier weights are gone
        step += 1
    # merged=True merges what merge_and_unload merges as peft's merge adds it; anything else is refused, saying how.
    check_mergeable(new)
    for config, problem in (({"use_dora": True}, "uses DoRA"), ({"modules_to_save": ["lm_head"]}, "modules_to_save")):
        with pytest.raises(CheckpointSaveError, match=rf"{problem}.*merge_and_unload\(\)\.save_pretrained"):
            check_mergeable(_lora(base, alpha=8, seed=1, **config))
