"""Checkpoints through a real Trainer: exact resume, another world size, another stage, DDP's files,
consolidation, ``load_from_checkpoint`` on the default file. (Damaged, hostile, killed and failed
saves: ``tests/test_checkpoint_safety.py``.)

One set of checkpoints is written at the end of epoch 0 on two ranks (every stage with the default
full file, stages 1 and 3 sharded, DDP). They are then loaded at 1, 2, 3 and 4 ranks. The reference
for every continued run is ``DDPStrategy`` resumed from DDP's own file at the same world size; at two
ranks the straight, uninterrupted run of each stage is compared too.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

import lightning_zero
from lightning_zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy, consolidate_checkpoint
from lightning_zero.engine.checkpoint.sharded import CheckpointMismatchError, CorruptCheckpointError
from lightning_zero.engine.io.safe_read import UnsafeCheckpointError
from tests.distributed import spawn
from tests.models import ParityNet, quiet_trainer

REPO = Path(__file__).resolve().parents[1]
KINDS = {  # name -> (strategy factory, file written at the end of epoch 0)
    "zero1": (lambda: "zero1", "zero1/epoch0.ckpt"),
    "zero2": (lambda: "zero2", "zero2/epoch0.ckpt"),
    "zero3": (lambda: "zero3", "zero3/epoch0.ckpt"),
    "zero1-sharded": (lambda: ZeRO1Strategy(checkpoint_format="sharded"), "zero1-sharded/epoch0.ckpt"),
    "zero3-sharded": (lambda: ZeRO3Strategy(checkpoint_format="sharded"), "zero3-sharded/epoch0.ckpt"),
    "ddp": (lambda: DDPStrategy(), "ddp/epoch0.ckpt"),
}
SHARDED = ("zero1-sharded", "zero3-sharded")


def _model() -> ParityNet:
    return ParityNet(optimizer="adamw", scheduler="step")


def _run(strategy: Any, world_size: int, directory: str | None = None, ckpt_path: str | None = None) -> ParityNet:
    callbacks = []
    if directory is not None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=directory,
                filename="epoch{epoch}",
                auto_insert_metric_name=False,
                save_top_k=-1,
                save_on_train_epoch_end=True,
            )
        )
    torch.manual_seed(1 if ckpt_path else 0)  # a resumed run must take everything from the checkpoint
    model = _model()
    trainer = quiet_trainer(
        strategy=strategy,
        devices=world_size,
        max_epochs=1 if directory else 2,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return model


def _write_and_resume_on_two_ranks(rank: int, world_size: int, root: str) -> None:
    L.seed_everything(0)
    for name, (factory, file) in KINDS.items():
        _run(factory(), world_size, directory=f"{root}/{Path(file).parent}")
        assert Path(root, file).is_dir() == (name in SHARDED), name
    # Resume is exact: epoch 0 saved, epoch 1 resumed == two epochs straight, under every stage.
    for name in ("zero1", "zero2", "zero3", "zero3-sharded"):
        factory, file = KINDS[name]
        straight = _run(factory(), world_size)
        resumed = _run(factory(), world_size, ckpt_path=f"{root}/{file}")
        assert resumed.losses == straight.losses[8:], name
        for key, value in straight.state_dict().items():
            assert torch.equal(resumed.state_dict()[key], value), (name, key)


def _continue_elsewhere(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Resume every checkpoint kind under other stages at this world size; compare with DDP."""
    reference = _run(DDPStrategy(), world_size, ckpt_path=f"{root}/{KINDS['ddp'][1]}")
    pairs = [
        ("zero3-sharded", "zero1"),
        ("zero1-sharded", "zero3"),
        ("ddp", "zero1"),
        ("ddp", "zero2"),
        ("ddp", "zero3"),
        ("zero3", "zero2"),
    ]
    for saved, loader in pairs:
        resumed = _run(KINDS[loader][0](), world_size, ckpt_path=f"{root}/{KINDS[saved][1]}")
        where = f"saved by {saved} on 2 ranks, resumed by {loader} on {world_size}"
        # Tolerance: at 3 and 4 ranks gradients are summed in another order than DDP's all-reduce.
        torch.testing.assert_close(resumed.losses, reference.losses, rtol=1e-6, atol=0, msg=where)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(resumed.state_dict()[key], value, rtol=1e-6, atol=1e-7, msg=f"{where}: {key}")
    return {"steps": len(reference.losses)}


@pytest.fixture(scope="module")
def checkpoints() -> Any:
    with tempfile.TemporaryDirectory() as root:
        spawn(_write_and_resume_on_two_ranks, world_size=2, timeout=500, root=root)
        yield root


def test_resume_is_exact_under_every_stage(checkpoints: str) -> None:
    assert Path(checkpoints, KINDS["zero3-sharded"][1], "meta.pt").is_file()
    assert Path(checkpoints, KINDS["zero3"][1]).is_file()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_any_checkpoint_resumes_at_any_world_size_under_any_stage(checkpoints: str, world_size: int) -> None:
    results = spawn(_continue_elsewhere, world_size=world_size, timeout=500, root=checkpoints)
    assert results[0]["steps"] > 0


def test_consolidated_checkpoint_is_what_ddp_saves(checkpoints: str, tmp_path: Path) -> None:
    ddp = torch.load(Path(checkpoints, KINDS["ddp"][1]), weights_only=True)
    output = tmp_path / "consolidated.ckpt"
    command = [
        sys.executable,
        "-m",
        "lightning_zero",
        "consolidate",
        str(Path(checkpoints, KINDS["zero3-sharded"][1])),
        str(output),
    ]
    done = subprocess.run(command, check=True, cwd=REPO, capture_output=True, text=True)
    assert done.stderr.startswith(f"wrote {output}: ") and done.stderr.count("\n") == 1, done.stderr  # no warnings
    merged = torch.load(output, weights_only=True)
    assert list(merged["state_dict"]) == list(ddp["state_dict"])
    for key, value in ddp["state_dict"].items():
        assert torch.equal(merged["state_dict"][key], value), key
    for got, want in zip(merged["optimizer_states"], ddp["optimizer_states"]):
        assert got["param_groups"] == want["param_groups"]
        for index, state in want["state"].items():
            for key, value in state.items():
                assert torch.equal(got["state"][index][key], value), (index, key)
    assert merged["epoch"] == ddp["epoch"] and merged["global_step"] == ddp["global_step"]
    assert merged["lr_schedulers"] == ddp["lr_schedulers"]

    # A plain model loads it without this package's help and computes what DDP's model computes.
    x = torch.arange(24).view(4, 6) % 13
    plain = ParityNet.load_from_checkpoint(output).eval()
    reference = ParityNet.load_from_checkpoint(Path(checkpoints, KINDS["ddp"][1])).eval()
    assert torch.equal(plain(x), reference(x))

    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    weights = tmp_path / "weights.safetensors"
    with warnings.catch_warnings(record=True) as caught:  # one process on purpose: nothing to warn about
        warnings.simplefilter("always")
        consolidate_checkpoint(Path(checkpoints, KINDS["zero1-sharded"][1]), weights)
    assert not caught, [str(w.message) for w in caught]
    fresh = _model()
    fresh.load_state_dict(load_file(weights))
    assert torch.equal(fresh.eval()(x), reference(x))


def test_default_checkpoint_is_ddps_file_and_loads_the_lightning_way(checkpoints: str) -> None:
    """The default checkpoint (``ModelCheckpoint`` under ``"zero3"``, no options) is DDP's file, written by both
    ranks without a gather, and ``LightningModule.load_from_checkpoint`` reads it in a fresh process."""
    ours = torch.load(Path(checkpoints, KINDS["zero3"][1]), weights_only=True)
    ddp = torch.load(Path(checkpoints, KINDS["ddp"][1]), weights_only=True)
    assert list(ours["state_dict"]) == list(ddp["state_dict"])
    for key, value in ddp["state_dict"].items():
        assert torch.equal(ours["state_dict"][key], value), key
    assert ours["state_dict"]["head.weight"].data_ptr() == ours["state_dict"]["emb.weight"].data_ptr()  # tied
    for got, want in zip(ours["optimizer_states"], ddp["optimizer_states"]):
        assert got["param_groups"] == want["param_groups"]
        assert set(got["state"]) == set(want["state"])
        for index, state in want["state"].items():
            for key, value in state.items():
                assert torch.equal(got["state"][index][key], value), (index, key)
    for key in ("epoch", "global_step", "lr_schedulers", "hyper_parameters", "loops"):
        assert ours[key] == ddp[key], key
    code = (
        "import sys, torch; from tests.models import ParityNet; x = torch.arange(24).view(4, 6) % 13; "
        "ours, ddp = (ParityNet.load_from_checkpoint(p).eval() for p in sys.argv[1:]); "
        "assert torch.equal(ours(x), ddp(x)); assert 'lightning_zero' not in sys.modules; print('same')"
    )
    paths = [str(Path(checkpoints, KINDS[k][1])) for k in ("zero3", "ddp")]
    fresh = subprocess.run([sys.executable, "-c", code, *paths], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 0 and fresh.stdout.strip() == "same", fresh.stderr[-3000:]


def test_checkpoint_from_another_model_names_the_mismatch(checkpoints: str) -> None:
    spawn(_load_into_wider, world_size=2, root=checkpoints)


def _load_into_wider(rank: int, world_size: int, root: str) -> None:
    model = ParityNet(optimizer="adamw", scheduler="step", unused=True)
    with pytest.raises(
        CheckpointMismatchError, match=r"missing from the checkpoint: sometimes\.bias, sometimes\.weight"
    ):
        quiet_trainer(strategy="zero2", devices=world_size, max_epochs=2).fit(
            model, ckpt_path=f"{root}/{KINDS['zero3-sharded'][1]}"
        )


class Arbitrary:
    """Any class: rebuilding it means running pickled code."""


def test_pickled_code_is_not_loaded_unless_allowed(tmp_path: Path) -> None:
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": Arbitrary()}, path)
    # One message: what torch refused (the class), then how to load a trusted file anyway.
    with pytest.raises(UnsafeCheckpointError, match=r"GLOBAL tests\.test_checkpoints\.Arbitrary .*weights_only=False"):
        consolidate_checkpoint(path)
    assert lightning_zero.consolidate_checkpoint(path, weights_only=False)["payload"] is not None


class OneNumber(L.LightningModule):
    """A single one-element parameter: on two ranks, rank 1's shard holds only padding."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([2.0]))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return (self.weight * batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(8, 1)), batch_size=2)


class _SaveEveryStep(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        trainer.save_checkpoint(self.path)  # every rank joins, even one with nothing to write


def _save_with_an_empty_shard(rank: int, world_size: int, root: str) -> list[float]:
    weights = []
    for checkpoint_format in ("full", "sharded"):
        trainer = quiet_trainer(
            strategy=ZeRO3Strategy(checkpoint_format=checkpoint_format), devices=world_size, max_steps=2
        )
        model = OneNumber()
        path = f"{root}/tiny-{checkpoint_format}.ckpt"
        trainer.callbacks.append(_SaveEveryStep(path))
        trainer.fit(model)
        resumed = OneNumber()
        quiet_trainer(strategy="zero1", devices=world_size, max_steps=3).fit(resumed, ckpt_path=path)
        weights.append(float(resumed.weight))
    return weights


def test_a_rank_with_an_empty_shard_still_saves_and_loads(tmp_path: Path) -> None:
    weights = spawn(_save_with_an_empty_shard, world_size=2, timeout=120, root=str(tmp_path))
    assert weights[0] == weights[1] and weights[0][0] == weights[0][1] != 2.0


# ---------------------------------------------------------------------- foreign sharded checkpoints
def _copy(checkpoints: str, kind: str, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / "copy.ckpt"
    shutil.copytree(Path(checkpoints, KINDS[kind][1]), target)
    return target


def test_metadata_pointing_outside_the_directory_is_refused(checkpoints: str, tmp_path: Path) -> None:
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    hostile = _copy(checkpoints, "zero1-sharded", tmp_path)
    (shards,) = hostile.glob("shards-*")
    metadata = FileSystemReader(shards).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (shards / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CorruptCheckpointError, match="outside its directory"):
        consolidate_checkpoint(hostile)


def test_another_tools_sharded_checkpoint_is_named_as_such(checkpoints: str, tmp_path: Path) -> None:
    foreign = _copy(checkpoints, "zero1-sharded", tmp_path)
    meta = torch.load(foreign / "meta.pt", weights_only=True)
    del meta["lightning_zero"]
    torch.save(meta, foreign / "meta.pt")
    with pytest.raises(CorruptCheckpointError, match="written by another tool"):
        consolidate_checkpoint(foreign)


def _resume_weights_only(rank: int, world_size: int, root: str) -> None:
    from lightning_zero.driver.checkpointing import WeightsOnlyCheckpointError

    sharded = ZeRO2Strategy(checkpoint_format="sharded")
    quiet_trainer(strategy=sharded, devices=world_size, max_steps=2, callbacks=[_SaveWeightsOnly(root)]).fit(_model())
    with pytest.raises(WeightsOnlyCheckpointError, match="contains only the model"):
        quiet_trainer(strategy="zero3", devices=world_size, max_steps=4).fit(_model(), ckpt_path=f"{root}/w.ckpt")


class _SaveWeightsOnly(L.Callback):
    def __init__(self, root: str) -> None:
        self.root = root

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(f"{self.root}/w.ckpt", weights_only=True)  # still sharded: a directory


def test_weights_only_checkpoint_cannot_resume_training(tmp_path: Path) -> None:
    spawn(_resume_weights_only, world_size=2, timeout=120, root=str(tmp_path))
    assert (tmp_path / "w.ckpt" / "meta.pt").is_file()


@dataclasses.dataclass
class TrainingConfig:
    width: int = 8


class ConfiguredNet(ParityNet):
    """Hyper-parameters holding a dataclass: the checkpoint pickles it, so ``weights_only=True`` refuses it."""

    def __init__(self, config: TrainingConfig | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()


def _resume_with_a_dataclass(rank: int, world_size: int, root: str) -> None:
    path = f"{root}/configured.ckpt"
    torch.manual_seed(0)
    first = quiet_trainer(strategy="zero3", devices=world_size, max_steps=2)
    first.fit(ConfiguredNet(TrainingConfig()))
    first.save_checkpoint(path)
    advice = (
        r"If you trust the file, allow tests\.test_checkpoints\.TrainingConfig around the call that loads it: "
        r"`with torch\.serialization\.safe_globals\(\[tests\.test_checkpoints\.TrainingConfig\]\)"
    )
    with pytest.raises(UnsafeCheckpointError, match=advice):
        quiet_trainer(strategy="zero3", devices=world_size, max_steps=4).fit(ConfiguredNet(), ckpt_path=path)
    with torch.serialization.safe_globals([TrainingConfig]):  # the advice, followed: the run resumes
        trainer = quiet_trainer(strategy="zero3", devices=world_size, max_steps=4)
        trainer.fit(ConfiguredNet(), ckpt_path=path)
    assert trainer.global_step == 4


def test_a_dataclass_in_the_hyper_parameters_gets_advice_that_works(tmp_path: Path) -> None:
    spawn(_resume_with_a_dataclass, world_size=2, root=str(tmp_path))


def _sharded_after_fit(rank: int, world_size: int, root: str) -> None:
    for name, cls in (("zero1", ZeRO1Strategy), ("zero3", ZeRO3Strategy)):
        torch.manual_seed(0)
        model = ParityNet(optimizer="adamw")
        trainer = quiet_trainer(strategy=cls(checkpoint_format="sharded"), devices=world_size, max_steps=3)
        trainer.fit(model)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer = trainer.optimizers[0].state_dict()
        path = Path(trainer.strategy.broadcast(f"{root}/{name}-after-fit.ckpt"))
        trainer.save_checkpoint(path)  # the module is whole again: the sharded format all the same
        assert path.is_dir() and (path / "meta.pt").is_file(), name
        full = consolidate_checkpoint(path)
        assert all(torch.equal(full["state_dict"][k], v) for k, v in expected.items()), name
        for index, entry in optimizer["state"].items():
            for key, value in entry.items():
                assert torch.equal(full["optimizer_states"][0]["state"][index][key], value), (name, index, key)
        assert full["optimizer_states"][0]["param_groups"] == optimizer["param_groups"], name
        resumed = quiet_trainer(strategy=cls(checkpoint_format="sharded"), devices=world_size, max_steps=4)
        resumed.fit(ParityNet(optimizer="adamw"), ckpt_path=path)
        assert resumed.global_step == 4, name


def test_a_sharded_save_after_fit_writes_the_sharded_format(tmp_path: Path) -> None:
    spawn(_sharded_after_fit, world_size=2, root=str(tmp_path))
