"""Checkpoints you can trust, through a real Trainer on two CPU ranks (both formats):

- damaged and hostile checkpoints are refused before anything loads, by ``fit``, ``validate`` and
  ``consolidate`` alike: no payload runs, nothing outside the checkpoint is read, memory stays bounded,
  and shards of another save are refused;
- a save killed at each point of its protocol resumes, through Lightning's own ``ckpt_path="last"``,
  from the newest complete checkpoint, with DDP's losses (saves written in the foreground, and in the
  background with ``async_save``);
- a save that fails on one rank (a write error, a full disk) fails on every rank, leaves nothing behind
  and the previous checkpoint intact;
- two jobs saving one name into one directory delete none of each other's saves in progress.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from lightning_zero import ZeRO3Strategy, consolidate_checkpoint
from lightning_zero.__main__ import main as cli_main
from lightning_zero.engine.checkpoint.saving import CheckpointSaveError
from lightning_zero.engine.io import files
from lightning_zero.engine.io.checksums import records, tensor_records
from lightning_zero.engine.io.files import KILL_AT, hold, new_token, release, temporary_path
from lightning_zero.engine.io.safe_read import CorruptCheckpointError, UnsafeCheckpointError
from tests.distributed import spawn, spawn_killed
from tests.models import ParityNet, quiet_trainer

REPO = Path(__file__).resolve().parents[1]
STEPS_PER_EPOCH = 8  # 64 samples, batch 4, 2 ranks


def _model() -> ParityNet:
    return ParityNet(optimizer="adamw", scheduler="step")


def _strategy(checkpoint_format: str, asynchronous: bool = False) -> ZeRO3Strategy:
    return ZeRO3Strategy(checkpoint_format=checkpoint_format, async_save=asynchronous)  # type: ignore[arg-type]


class _SaveAtEnd(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)  # while still sharded


def _write(rank: int, world_size: int, root: str) -> None:
    for name, checkpoint_format, seed in (("a", "sharded", 0), ("b", "sharded", 1), ("full", "full", 0)):
        torch.manual_seed(seed)
        callback = _SaveAtEnd(f"{root}/{name}.ckpt")
        quiet_trainer(strategy=_strategy(checkpoint_format), devices=world_size, max_steps=2, callbacks=[callback]).fit(
            _model()
        )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    spawn(_write, world_size=2, timeout=300, root=str(root))
    assert (root / "a.ckpt").is_dir() and (root / "full.ckpt").is_file()
    return root


# ---------------------------------------------------------------------- the full file, written in pieces
def test_pieces_written_by_two_ranks_make_the_file_torch_save_would_write(tmp_path: Path) -> None:
    """The writer on one process, playing both ranks: a 3x4 weight split 7/5 elements, tied under two names,
    an optimizer state split the same way, a real buffer and a step counter."""
    from lightning_zero.engine.io.checksums import RecordChecksumError, join_checksums, write_checksums
    from lightning_zero.engine.io.torch_file import FlatPiece, write_pieces, write_skeleton

    weight, state = torch.randn(3, 4), torch.randn(3, 4)
    flat_w, flat_s = weight.reshape(-1), state.reshape(-1)

    def rank(lo: int, hi: int) -> tuple[FlatPiece, FlatPiece]:
        return (
            FlatPiece("model/w", weight.shape, weight.dtype, flat_w[lo:hi].clone(), lo),
            FlatPiece("optim/0/0/exp_avg", state.shape, state.dtype, flat_s[lo:hi].clone(), lo),
        )

    (w0, s0), (w1, s1) = rank(0, 7), rank(7, 12)
    checkpoint = {
        "state_dict": {"w": w0, "tied": w0, "buffer": torch.arange(3.0)},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(5.0), "exp_avg": s0}}, "param_groups": []}],
        "epoch": 2,
    }
    path = tmp_path / "parallel.ckpt"
    skeleton = write_skeleton(checkpoint, path)
    checksums = write_pieces(path, [w0, s0], skeleton.offsets) + write_pieces(path, [w1, s1], skeleton.offsets)
    records = join_checksums(checksums, skeleton.record_names, skeleton.record_sizes)
    write_checksums(path, {**skeleton.checksums, **records})
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None  # a valid zip: every record's checksum matches its bytes
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["state_dict"]["w"], weight) and torch.equal(loaded["state_dict"]["tied"], weight)
    assert loaded["state_dict"]["w"].data_ptr() == loaded["state_dict"]["tied"].data_ptr()  # one storage
    assert torch.equal(loaded["state_dict"]["buffer"], torch.arange(3.0)) and loaded["epoch"] == 2
    assert torch.equal(loaded["optimizer_states"][0]["state"][0]["exp_avg"], state)
    assert loaded["optimizer_states"][0]["state"][0]["step"] == 5
    with pytest.raises(RecordChecksumError, match=r"the ranks wrote 28 of the 48 bytes of 'model/w'"):
        join_checksums(checksums[:2] + checksums[3:], skeleton.record_names, skeleton.record_sizes)  # w1 lost
    with pytest.raises(TypeError, match="cannot be pickled on its own"):
        pickle.dumps(w0)


# ---------------------------------------------------------------------- hostile and damaged checkpoints
def _shards(checkpoint: Path) -> Path:
    (shards,) = checkpoint.glob("shards-*")
    return shards


def _stack_global_payload(command: str) -> bytes:
    """The pickle of the report: STACK_GLOBAL('torch.distributed.checkpoint.metadata', 'os.system')(command)."""

    def text(value: str) -> bytes:
        return b"\x8c" + bytes([len(value.encode())]) + value.encode()

    module, name = "torch.distributed.checkpoint.metadata", "os.system"
    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(command) + b"\x85R."


class _Payload:
    """Unpickling this runs ``os.system``: ``torch.load(weights_only=True)`` must refuse it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def _forge_metadata(checkpoint: Path, numel: int) -> None:
    """Claim that the first ``step`` entry holds ``numel`` float32 elements (its file holds a few bytes)."""
    shards = _shards(checkpoint)
    metadata = FileSystemReader(shards).read_metadata()
    key = next(k for k in metadata.state_dict_metadata if k.endswith("/step"))
    entry = metadata.state_dict_metadata[key]
    info = metadata.storage_data.pop(MetadataIndex(key, entry.chunks[0].offsets))
    entry.size = torch.Size([numel])
    entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([numel]))]
    metadata.storage_data[MetadataIndex(key, torch.Size([0]))] = info
    (shards / ".metadata").write_bytes(pickle.dumps(metadata))


def _flip_byte(path: Path, position: int) -> None:
    with open(path, "r+b") as stream:
        stream.seek(position)
        value = stream.read(1)[0]
        stream.seek(position)
        stream.write(bytes([value ^ 0x10]))


def _cases(saved: Path, work: Path, marker: Path) -> list[tuple[str, str, str, str]]:
    """(name, path, error kind, message pattern) for every damaged or hostile checkpoint."""
    cases = []

    def copy(source: str, name: str) -> Path:
        target = work / f"{name}.ckpt"
        if (saved / source).is_dir():
            shutil.copytree(saved / source, target)
        else:
            shutil.copyfile(saved / source, target)
        return target

    path = copy("a.ckpt", "payload-metadata")
    (_shards(path) / ".metadata").write_bytes(_stack_global_payload(f"touch {marker}"))
    asks = r"asks for torch\.distributed\.checkpoint\.metadata\.os\.system"
    cases.append(("payload-metadata", path, "corrupt", asks))

    path = copy("a.ckpt", "payload-meta-pt")
    meta = torch.load(path / "meta.pt", weights_only=True)
    torch.save({**meta, "payload": _Payload(marker)}, path / "meta.pt")
    cases.append(("payload-meta-pt", path, "unsafe", "only arbitrary pickle code can rebuild"))

    path = work / "payload-full.ckpt"
    full = torch.load(saved / "full.ckpt", weights_only=True)
    torch.save({**full, "payload": _Payload(marker)}, path)
    cases.append(("payload-full", path, "unsafe", "only arbitrary pickle code can rebuild"))

    outside = work / "outside.distcp"
    shutil.copyfile(_shards(saved / "a.ckpt") / "__1_0.distcp", outside)
    path = copy("a.ckpt", "symlink-shard")
    (_shards(path) / "__1_0.distcp").unlink()
    (_shards(path) / "__1_0.distcp").symlink_to(outside)
    cases.append(("symlink-shard", path, "corrupt", r"__1_0\.distcp' is a symbolic link"))

    path = copy("a.ckpt", "symlink-meta")
    shutil.move(path / "meta.pt", work / "outside-meta.pt")
    (path / "meta.pt").symlink_to(work / "outside-meta.pt")
    cases.append(("symlink-meta", path, "corrupt", r"meta\.pt' is a symbolic link"))

    path = copy("a.ckpt", "size-1GB")
    _forge_metadata(path, 2**28)
    cases.append(("size-1GB", path, "corrupt", r"claims 1073741824 bytes .* refusing to allocate"))

    path = copy("a.ckpt", "size-4TB")
    _forge_metadata(path, 2**40)
    cases.append(("size-4TB", path, "corrupt", r"claims 4398046511104 bytes .* refusing to allocate"))

    path = copy("a.ckpt", "shard-of-another-run")
    shutil.copyfile(_shards(saved / "b.ckpt") / "__1_0.distcp", _shards(path) / "__1_0.distcp")
    cases.append(("shard-of-another-run", path, "corrupt", r"__1_0\.distcp' belongs to another save"))

    path = copy("a.ckpt", "truncated-shard")
    shard = _shards(path) / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    cases.append(("truncated-shard", path, "corrupt", r"__1_0\.distcp' is truncated"))

    path = copy("a.ckpt", "no-meta")
    (path / "meta.pt").unlink()
    cases.append(("no-meta", path, "corrupt", "is a directory without meta.pt, so it is not a lightning_zero"))

    raw = (saved / "full.ckpt").read_bytes()
    for name, data in (("truncated-full-end", raw[:-10]), ("truncated-full-half", raw[: len(raw) // 2])):
        (work / f"{name}.ckpt").write_bytes(data)
        cases.append((name, work / f"{name}.ckpt", "corrupt", "is truncated or corrupted and was not loaded"))

    path = work / "bit-flip-full.ckpt"
    shutil.copyfile(saved / "full.ckpt", path)
    with open(path, "rb") as stream, zipfile.ZipFile(stream) as archive:
        largest = max(tensor_records(records(archive, stream)), key=lambda r: r.stored_size)
    _flip_byte(path, largest.data_start + largest.stored_size // 2)
    cases.append(("bit-flip-full", path, "corrupt", rf"record '{largest.name}' do not match the checksum"))

    path = copy("a.ckpt", "bit-flip-shard")
    entries = FileSystemReader(_shards(path)).read_metadata().storage_data.values()
    entry = max((e for e in entries if e.relative_path == "__1_0.distcp"), key=lambda e: e.length)
    _flip_byte(_shards(path) / "__1_0.distcp", entry.offset + entry.length // 2)
    cases.append(("bit-flip-shard", path, "corrupt", r"__1_0\.distcp' is corrupted: the bytes of its piece of"))

    (work / "random.ckpt").write_bytes(os.urandom(4096))
    cases.append(("foreign-random-bytes", work / "random.ckpt", "corrupt", "is not a checkpoint or is corrupted"))

    torch.save(_model().state_dict(), work / "plain-state-dict.ckpt")
    cases.append(("foreign-state-dict", work / "plain-state-dict.ckpt", "corrupt", "is not a Lightning checkpoint"))

    with zipfile.ZipFile(work / "zip.ckpt", "w") as archive:
        archive.writestr("notes.txt", "not a checkpoint")
    cases.append(("foreign-zip", work / "zip.ckpt", "corrupt", "is a zip archive but not one torch.save wrote"))
    return [(name, str(path), kind, pattern) for name, path, kind, pattern in cases]


ERRORS = {"corrupt": CorruptCheckpointError, "unsafe": UnsafeCheckpointError}


def _refuse_everywhere(rank: int, world_size: int, cases: list, marker: str) -> dict[str, tuple[float, float]]:
    """Every case through fit and (for the payloads) validate: refused on every rank, the model untouched."""
    measured = {}
    for name, path, kind, pattern in cases:
        entry_points = ("fit", "validate") if name.startswith("payload") else ("fit",)
        for entry in entry_points:
            torch.manual_seed(3)
            model = _model()
            before = {k: v.clone() for k, v in model.state_dict().items()}
            trainer = quiet_trainer(strategy="zero3", devices=world_size, max_steps=4, limit_val_batches=1)
            peak, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
            with pytest.raises(ERRORS[kind], match=pattern):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    getattr(trainer, entry)(model, ckpt_path=path)
            seconds = time.perf_counter() - start
            grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
            measured[f"{name} ({entry})"] = (seconds, grown_mib)
            for key, value in before.items():
                assert torch.equal(model.state_dict()[key], value), (name, entry, key)
            assert not Path(marker).exists(), f"{name}: the payload ran"
    return measured


def test_hostile_and_damaged_checkpoints_are_refused_by_every_entry_point(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "payload-ran"
    # The payload is live: the plain unpickler that DCP uses runs it.
    canary = tmp_path / "canary"
    pickle.loads(_stack_global_payload(f"touch {canary}"))
    assert canary.exists()

    cases = _cases(saved, tmp_path, marker)
    for name, path, kind, pattern in cases:  # consolidate, in this process
        with pytest.raises(ERRORS[kind], match=pattern):
            consolidate_checkpoint(path, tmp_path / "out.ckpt")
        assert not marker.exists(), name
    capsys.readouterr()
    for name, path, kind, _ in cases:  # the command line: one line on stderr, exit status 2
        assert cli_main(["consolidate", path, str(tmp_path / "out.ckpt")]) == 2, name
        stderr = capsys.readouterr().err
        assert "Traceback" not in stderr and stderr.startswith("consolidate: ") and stderr.count("\n") == 1, stderr
        if kind == "unsafe":  # what was refused, and this command line's way to trust the file
            assert "GLOBAL posix.system" in stderr and "weights_only" not in stderr, stderr
            assert stderr.endswith("If you trust the file, add --unsafe-pickle to the command line.\n"), stderr
        assert not marker.exists(), name
        if name in ("payload-metadata", "payload-full", "size-1GB"):  # and the entry point itself, once per kind
            command = [sys.executable, "-m", "lightning_zero", "consolidate", path, str(tmp_path / "out.ckpt")]
            result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
            assert (result.returncode, result.stderr) == (2, stderr), (name, result.stderr[-2000:])
            assert not marker.exists(), name
    measured = spawn(_refuse_everywhere, world_size=2, timeout=600, cases=cases, marker=str(marker))
    for rank_measures in measured:
        for what, (seconds, grown_mib) in rank_measures.items():
            assert seconds < 30, (what, seconds)  # refused at load, before any training step
            assert grown_mib < 100, (what, grown_mib)  # the 1 GB / 4 TB claims allocated nothing
    assert not marker.exists()
    assert not (tmp_path / "out.ckpt").exists()


def _resume_from(rank: int, world_size: int, paths: list[str]) -> list[dict[str, torch.Tensor]]:
    """The parameters after resuming from each of ``paths`` and training two more steps."""
    results = []
    for path in paths:
        torch.manual_seed(3)
        model = _model()
        quiet_trainer(strategy="zero3", devices=world_size, max_steps=4).fit(model, ckpt_path=path)
        results.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return results


def test_the_default_checkpoint_is_a_valid_zip_and_a_recompressed_copy_loads_exactly(
    saved: Path, tmp_path: Path
) -> None:
    """The parallel writer stores every record's CRC-32 (zipfile and unzip accept the file); a copy whose records a
    zip tool deflated is decompressed, never mapped raw: consolidate and a resumed fit read what torch.load reads."""
    full = saved / "full.ckpt"
    with zipfile.ZipFile(full) as archive:
        assert archive.testzip() is None
    if shutil.which("unzip"):
        assert subprocess.run(["unzip", "-tq", str(full)], capture_output=True).returncode == 0
    compressed = tmp_path / "deflated.ckpt"
    with zipfile.ZipFile(full) as source, zipfile.ZipFile(compressed, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info.filename))
    with zipfile.ZipFile(compressed) as archive:
        assert any(i.compress_type == zipfile.ZIP_DEFLATED for i in archive.infolist() if "/data/" in i.filename)
    expected = torch.load(full, weights_only=True)["state_dict"]
    read = consolidate_checkpoint(compressed)["state_dict"]
    assert expected.keys() == read.keys() and all(torch.equal(expected[k], read[k]) for k in expected)
    from_full, from_compressed = spawn(_resume_from, world_size=2, timeout=300, paths=[str(full), str(compressed)])[0]
    assert all(torch.equal(from_full[k], from_compressed[k]) for k in from_full)


def test_missing_checkpoint_on_the_command_line_is_one_clear_line(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "lightning_zero", "consolidate", str(tmp_path / "nope.ckpt"), "out.ckpt"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == f"consolidate: checkpoint '{tmp_path / 'nope.ckpt'}' does not exist"


# ---------------------------------------------------------------------- saves killed at every point
KILLS = [  # (format, kill point, epoch the resumed run starts at)
    ("full", "start", 1),
    ("full", "partial", 1),
    ("full", "before-commit", 1),
    ("full", "after-commit", 2),
    ("full", "end", 2),
    ("sharded", "partial", 1),
    ("sharded", "before-commit", 1),
    ("sharded", "after-commit", 2),
    ("full-then-sharded", "between-renames", 1),  # a format change where renameat2 is not available
]


class _KillDuringSecondSave(Callback):
    """Arms the kill at the start of epoch 1, so that the save at its end (the second one) dies at ``point``."""

    def __init__(self, point: str, change_format: bool) -> None:
        self.point, self.change_format = point, change_format

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == 1:
            trainer.strategy.finish_saves()  # a background save of epoch 0 must not meet the kill
            os.environ[KILL_AT] = f"{self.point}@last.ckpt"
            if self.change_format:
                import lightning_zero.engine.io.files as files

                trainer.strategy.checkpoint_format = "sharded"  # type: ignore[attr-defined]
                files.exchange = lambda a, b: False  # as on a file system without RENAME_EXCHANGE


def _train_and_die(
    rank: int, world_size: int, directory: str, checkpoint_format: str, point: str, asynchronous: bool
) -> None:
    torch.manual_seed(0)
    callbacks = [
        ModelCheckpoint(dirpath=directory, save_last=True),  # epoch=N-step=M.ckpt (top 1), then last.ckpt
        _KillDuringSecondSave(point, change_format=checkpoint_format == "full-then-sharded"),
    ]
    strategy = _strategy("sharded" if checkpoint_format == "sharded" else "full", asynchronous)
    trainer = quiet_trainer(
        strategy=strategy, devices=world_size, max_epochs=3, enable_checkpointing=True, callbacks=callbacks
    )
    trainer.fit(_model())


def _resume_each(rank: int, world_size: int, root: str) -> dict[str, int]:
    torch.manual_seed(0)
    ddp = _model()
    quiet_trainer(strategy=DDPStrategy(), devices=world_size, max_epochs=3).fit(ddp)
    resumed_at = {}
    for checkpoint_format, point, epoch in KILLS:
        directory = Path(root, f"{checkpoint_format}-{point}")
        torch.manual_seed(1)  # everything must come from the checkpoint
        model = _model()
        fmt = "sharded" if checkpoint_format == "sharded" else "full"
        callback = ModelCheckpoint(dirpath=directory, save_top_k=1, save_last=True)
        trainer = quiet_trainer(
            strategy=_strategy(fmt),
            devices=world_size,
            max_epochs=3,
            enable_checkpointing=True,
            callbacks=[callback],
            limit_val_batches=1,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if point == "between-renames":
                # Only here is last.ckpt missing; the checkpoint set aside is found through its path.
                assert not (directory / "last.ckpt").exists()
                trainer.fit(model, ckpt_path=str(directory / "last.ckpt"))
            else:
                trainer.fit(model, ckpt_path="last")  # Lightning's own resolution
        resumed_at[point + "/" + checkpoint_format] = len(ddp.losses) - len(model.losses)
        assert model.losses == ddp.losses[epoch * STEPS_PER_EPOCH :], (checkpoint_format, point)
        for key, value in ddp.state_dict().items():
            assert torch.equal(model.state_dict()[key], value), (checkpoint_format, point, key)
        hidden = sorted(p.name for p in directory.iterdir() if p.name.startswith("."))
        if point == "between-renames":  # the set-aside copy is never deleted by a save; it is warned about
            assert len(hidden) == 1 and hidden[0].startswith(".last.ckpt.old-"), hidden
            warned = any("set aside before it was interrupted" in str(w.message) for w in caught)
            assert warned == (rank == 0)  # rank 0 tidies up, and warns
        else:
            assert hidden == [], (checkpoint_format, point, hidden)  # the next save removed the partial one
        if fmt == "sharded":
            assert len(list((directory / "last.ckpt").glob("shards-*"))) == 1
        trainer.validate(model, ckpt_path="best", verbose=False)  # Lightning's "best" resolves and loads
    return resumed_at


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_save_killed_at_any_point_resumes_from_the_newest_complete_checkpoint(
    tmp_path: Path, asynchronous: bool
) -> None:
    """Asynchronous: the save is killed in its background thread while the training thread runs on (see [Note:
    asynchronous saves]); the resumed runs save synchronously."""
    for checkpoint_format, point, _ in KILLS:
        directory = tmp_path / f"{checkpoint_format}-{point}"
        spawn_killed(
            _train_and_die,
            directory=str(directory),
            checkpoint_format=checkpoint_format,
            point=point,
            asynchronous=asynchronous,
        )
        assert (directory / "last.ckpt").exists() == (point != "between-renames"), (checkpoint_format, point)
    resumed_at = spawn(_resume_each, world_size=2, timeout=600, root=str(tmp_path))[0]
    assert resumed_at == {f"{p}/{f}": e * STEPS_PER_EPOCH for f, p, e in KILLS}


def _resume_from_a_linked_last(rank: int, world_size: int, root: str) -> None:
    for checkpoint_format in ("full", "sharded"):
        directory = Path(root, checkpoint_format)
        for epochs, ckpt_path in ((1, None), (2, "last")):
            torch.manual_seed(epochs)
            model = _model()
            callback = ModelCheckpoint(dirpath=directory, save_last="link")  # last.ckpt: a symlink
            trainer = quiet_trainer(
                strategy=_strategy(checkpoint_format),
                devices=world_size,
                max_epochs=epochs,
                enable_checkpointing=True,
                callbacks=[callback],
            )
            trainer.fit(model, ckpt_path=ckpt_path)
        assert (directory / "last.ckpt").is_symlink()
        assert len(model.losses) == STEPS_PER_EPOCH  # resumed through the link, one epoch left


def test_last_checkpoint_as_a_symlink_resumes(tmp_path: Path) -> None:
    spawn(_resume_from_a_linked_last, world_size=2, timeout=300, root=str(tmp_path))


# ---------------------------------------------------------------------- saves that fail
class _SaveLast(Callback):
    """``last.ckpt`` at the end of every epoch: each save after the first replaces a complete checkpoint."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.directory / "last.ckpt")


class _FailSecondSaveOnRankOne(Callback):
    """Before the save at the end of epoch 1, rank 1 may write no file beyond 1 byte (``RLIMIT_FSIZE``), so its
    writes fail with ``EFBIG`` as they would on a broken or full disk; restored right after."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == 1 and trainer.global_rank == 1:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            self.limits = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1, self.limits[1]))

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if hasattr(self, "limits"):
            resource.setrlimit(resource.RLIMIT_FSIZE, self.limits)


def _fail_on_one_rank(rank: int, world_size: int, root: str) -> None:
    for checkpoint_format in ("full", "sharded"):
        directory = Path(root, checkpoint_format)
        torch.manual_seed(0)
        trainer = quiet_trainer(
            strategy=_strategy(checkpoint_format),
            devices=world_size,
            max_epochs=3,
            callbacks=[_FailSecondSaveOnRankOne(), _SaveLast(directory)],
        )
        with pytest.raises(CheckpointSaveError, match=r"failed on rank\(s\) \[.*1\].*File too large"):
            trainer.fit(_model())
        trainer.strategy.barrier()
        assert sorted(p.name for p in directory.iterdir()) == ["last.ckpt"]  # nothing left behind
        if checkpoint_format == "sharded":
            assert len(list((directory / "last.ckpt").glob("shards-*"))) == 1
        assert consolidate_checkpoint(directory / "last.ckpt")["epoch"] == 0  # the previous one, intact


def test_a_save_that_fails_on_one_rank_fails_everywhere_and_leaves_nothing_behind(tmp_path: Path) -> None:
    spawn(_fail_on_one_rank, world_size=2, timeout=300, root=str(tmp_path))


class _DeleteDuringSave:
    """Stands in for the save protocol's ``crash_point`` (``engine/checkpoint/saving.py``): at ``point`` of this
    process's save number ``nth`` rank 0 deletes ``doomed``, as a user's ``rm -rf`` or another job's clean-up would;
    at ``partial``, which every rank reaches, once every rank is there (marker files in ``markers``: no rank still
    reads what it wrote). Rank 0 alone reaches ``before-commit``, after every rank's writes."""

    def __init__(self, markers: Path, rank: int, world_size: int, point: str, nth: int, doomed: Path) -> None:
        self.markers, self.rank, self.world_size = markers, rank, world_size
        self.point, self.nth, self.doomed = point, nth, doomed
        self.saves = 0

    def __call__(self, name: str, path: Path | None = None) -> None:
        self.saves += name == "start"
        if name != self.point or self.saves != self.nth:
            return
        (self.markers / f"{self.rank}").touch()
        if self.rank == 0:
            deadline = time.monotonic() + 60
            while self.point == "partial" and not all((self.markers / f"{r}").exists() for r in range(self.world_size)):
                assert time.monotonic() < deadline, "a rank never reached the point of the deletion"
                time.sleep(0.01)
            shutil.rmtree(self.doomed)


@contextmanager
def _deleting(deletion: Callable[..., None]) -> Iterator[None]:
    from lightning_zero.engine.checkpoint import saving

    saving.crash_point = deletion  # type: ignore[assignment]
    try:
        yield
    finally:
        saving.crash_point = files.crash_point


# format, async_save, point, which save, what is deleted ("directory": the folder the checkpoints are saved into)
DELETIONS = [
    ("sharded", False, "before-commit", 2, "last.ckpt"),  # replaced in place: meta.pt's write recreated it
    ("sharded", True, "before-commit", 2, "last.ckpt"),  # raised at the end of fit
    ("sharded", False, "partial", 1, "directory"),  # a new checkpoint's temporary directory goes with it
    ("sharded", True, "partial", 1, "directory"),  # raised by the next save
    ("full", False, "before-commit", 2, "directory"),
    ("full", True, "before-commit", 1, "directory"),
]


def _delete_mid_save(rank: int, world_size: int, root: str) -> None:
    from lightning_zero.fabric import ZeRO3Strategy as ZeRO3FabricStrategy

    for checkpoint_format, asynchronous, point, nth, doomed in DELETIONS:
        case = Path(root, f"{checkpoint_format}-{'async' if asynchronous else 'sync'}-{point}")
        directory = case / "checkpoints"
        (case / "markers").mkdir(parents=True, exist_ok=True)
        target = directory if doomed == "directory" else directory / "last.ckpt"
        torch.manual_seed(0)
        trainer = quiet_trainer(
            strategy=_strategy(checkpoint_format, asynchronous),
            devices=world_size,
            max_epochs=2,
            callbacks=[_SaveLast(directory)],
        )
        with _deleting(_DeleteDuringSave(case / "markers", rank, world_size, point, nth, target)):
            with pytest.raises(CheckpointSaveError, match=rf"failed on rank\(s\) \[0\].*'{directory}.*is missing"):
                trainer.fit(_model())
        trainer.strategy.barrier()
        # Nothing committed that names missing pieces; nothing recreated, nothing left behind.
        left = sorted(str(p.relative_to(directory)) for p in directory.rglob("*")) if directory.exists() else []
        assert left == [], (checkpoint_format, asynchronous, point, left)

    # Fabric: the failure of a background save is raised by the next save, on every rank.
    directory = Path(root, "fabric")
    (directory / "markers").mkdir(parents=True, exist_ok=True)
    strategy = ZeRO3FabricStrategy(checkpoint_format="sharded", async_save=True)
    fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    module = torch.nn.Linear(4, 4)
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters()))
    state = {"model": model, "optimizer": optimizer}
    last = directory / "last.ckpt"
    with _deleting(_DeleteDuringSave(directory / "markers", rank, world_size, "before-commit", 2, last)):
        fabric.save(last, state)
        fabric.save(last, state)  # in place; deleted before its commit
        with pytest.raises(CheckpointSaveError, match=rf"failed on rank\(s\) \[0\].*'{last}.*is missing"):
            fabric.save(directory / "next.ckpt", state)
    fabric.barrier()
    assert sorted(p.name for p in directory.iterdir()) == ["markers"]
    fabric.strategy.teardown()


def test_a_checkpoint_deleted_during_its_save_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    """The directory a save writes into, deleted before the save commits (sync and ``async_save``, both formats,
    both doors): the save raises on every rank, naming what is missing, and commits nothing (sizes are checked too:
    ``test_a_commit_checks_every_piece_it_names``)."""
    spawn(_delete_mid_save, world_size=2, timeout=300, root=str(tmp_path))


class _DamageBeforeCommit:
    """Stands in for ``crash_point``: just before the commit, the file of the save matching ``pattern`` in ``root``
    is cut short by a byte or deleted; ``expected``: how the failure must name it."""

    def __init__(self, root: Path, pattern: str, cut: bool) -> None:
        self.root, self.pattern, self.cut = root, pattern, cut
        self.expected = ""

    def __call__(self, point: str, path: Path | None = None) -> None:
        if point != "before-commit":
            return
        (found,) = self.root.glob(self.pattern)
        size = found.stat().st_size
        if self.cut:
            os.truncate(found, size - 1)
            self.expected = f"'{found}' holds {size - 1} bytes, but this save wrote {size}"
        else:
            found.unlink()
            self.expected = f"'{found}' is missing: it was deleted or moved while the checkpoint was being saved"


def test_a_commit_checks_every_piece_it_names(tmp_path: Path) -> None:
    """One process, both formats: a file the save wrote, cut short or deleted before the commit, fails the save with
    the file named, and nothing is committed."""
    from lightning_zero.engine.checkpoint import saving
    from lightning_zero.engine.io.torch_file import FlatPiece

    ranks = saving.Ranks(0, 1, lambda obj: obj)
    weight = torch.arange(12.0)
    cases = [
        ("a.ckpt", ".a.ckpt.tmp-*/shards-*/__0_0.distcp", True),
        ("a.ckpt", ".a.ckpt.tmp-*/shards-*/.metadata", False),
        ("b.ckpt", ".b.ckpt.tmp-*", True),
    ]
    for name, pattern, cut in cases:
        damage = _DamageBeforeCommit(tmp_path, pattern, cut)
        with _deleting(damage), warnings.catch_warnings(), pytest.raises(CheckpointSaveError) as error:
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)  # DCP on one process
            if name == "a.ckpt":
                saving.save_sharded_directory(ranks, {"model/w": weight}, {"epoch": 0}, {}, tmp_path / name)
            else:
                piece = FlatPiece("model/w", weight.shape, weight.dtype, weight, 0)
                saving.save_full(ranks, {"state_dict": {"w": piece}}, tmp_path / name)
        assert damage.expected and damage.expected in str(error.value), (damage.expected, str(error.value))
        assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing committed, nothing left behind"


class _FillTheDisk(Callback):
    """Before the save at the end of epoch 1, leave less free space than one more checkpoint needs."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == 1 and trainer.is_global_zero:
            size = _disk_usage(self.directory / "last.ckpt")
            free = shutil.disk_usage(self.directory).free
            (self.directory.parent / "filler").write_bytes(b"\0" * max(0, free - size // 2))
        trainer.strategy.barrier()


def _disk_usage(path: Path) -> int:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_blocks * 512 for p in files)


def _fill_the_disk(rank: int, world_size: int, root: str) -> dict[str, str]:
    messages = {}
    for checkpoint_format in ("full", "sharded"):
        directory = Path(root, checkpoint_format)
        torch.manual_seed(0)
        trainer = quiet_trainer(
            strategy=_strategy(checkpoint_format),
            devices=world_size,
            max_epochs=3,
            callbacks=[_FillTheDisk(directory), _SaveLast(directory)],
        )
        with pytest.raises(CheckpointSaveError, match="No space left on device") as error:
            trainer.fit(_model())
        messages[checkpoint_format] = str(error.value)
        trainer.strategy.barrier()
        assert "A save needs free space for the whole new checkpoint" in str(error.value)
        assert sorted(p.name for p in directory.iterdir()) == ["last.ckpt"]  # the space was given back
        assert consolidate_checkpoint(directory / "last.ckpt")["epoch"] == 0
        trainer.strategy.barrier()
        if rank == 0:
            (Path(root) / "filler").unlink()
        trainer.strategy.barrier()
        # With room again, training resumes from the intact checkpoint and saves.
        torch.manual_seed(1)
        model = _model()
        quiet_trainer(
            strategy=_strategy(checkpoint_format), devices=world_size, max_epochs=3, callbacks=[_SaveLast(directory)]
        ).fit(model, ckpt_path=str(directory / "last.ckpt"))
        assert len(model.losses) == 2 * STEPS_PER_EPOCH
    return messages


def test_a_full_disk_fails_cleanly_and_gives_the_space_back(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        spawn(_fill_the_disk, world_size=2, timeout=300, root=str(disk))
    finally:
        subprocess.run(["umount", str(disk)], check=False)


# ---------------------------------------------------------------------- two runs saving into one directory
_HOLDER = """
import fcntl, os, sys, time
held = [os.open(path, os.O_RDONLY) for path in sys.argv[1:]]
for fd in held:
    fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""
OTHER_RUN = "0ther0job0run"  # another job's run id, in the tokens of its saves (not hex: never a files.RUN)
DEAD_RUN = "deadjob0run0"  # a job killed an hour ago
HOUR = 3600.0


@contextmanager
def _held_by_another_process(paths: list[Path]) -> Iterator[subprocess.Popen]:
    """A live process (another job's rank 0, mid-save) holding an exclusive flock on each of ``paths``."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, *map(str, paths)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def _leftover(path: Path, content: bytes, directory: bool = False, age: float = 0.0) -> Path:
    """A file, or a directory holding one file, with ``content``, last modified ``age`` seconds ago."""
    if directory:
        path.mkdir(parents=True)
        (path / "__0_0.distcp").write_bytes(content)
        os.utime(path / "__0_0.distcp", (time.time() - age, time.time() - age))
    else:
        path.write_bytes(content)
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def _content(path: Path) -> bytes:
    return (path / "__0_0.distcp").read_bytes() if path.is_dir() else path.read_bytes()


def _is_locked(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_cleanup_deletes_only_what_saves_that_are_over_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule of [Note: crash-safe saves] on one process: what a live process holds is kept; what nobody holds is
    deleted if this run wrote it, or on a local file system, or (on a network file system) after 10 minutes."""
    path = tmp_path / "last.ckpt"
    path.write_bytes(b"the committed checkpoint")
    assert files.on_local_file_system(tmp_path) and not files.on_local_file_system(Path("/proc"))
    assert new_token().startswith(files.RUN) and new_token().isalnum() and new_token() != new_token()

    def name(run: str) -> Path:
        return temporary_path(path, run + os.urandom(10).hex())

    hour = HOUR
    for local in (True, False):  # False: a network file system, where a writer elsewhere may hold an unseen lock
        monkeypatch.setattr(files, "on_local_file_system", lambda directory, local=local: local)
        live = [
            _leftover(name(OTHER_RUN), b"live"),
            _leftover(name(OTHER_RUN), b"live, a directory", directory=True),
            _leftover(name(OTHER_RUN), b"live, unmodified for an hour", age=hour),
        ]
        own = [_leftover(name(files.RUN), b"killed"), _leftover(name(files.RUN), b"killed", directory=True)]
        dead_old = [_leftover(name(DEAD_RUN), b"killed", age=hour), _leftover(name(DEAD_RUN), b"killed", True, hour)]
        dead_new = [_leftover(name(DEAD_RUN), b"killed"), _leftover(name(DEAD_RUN), b"killed", directory=True)]
        deleting = _leftover(files.hidden_sibling(path, files.DELETING, new_token()), b"half", directory=True)
        mine = name(files.RUN)
        lock = hold(mine)  # this process's own save in progress: another descriptor, so flock tells them apart
        with _held_by_another_process(live):
            files.remove_leftovers(path)
            assert [_content(p) for p in live] == [b"live", b"live, a directory", b"live, unmodified for an hour"]
            assert all(_is_locked(p) for p in live)  # still held by their writer: the cleanup let go
            assert mine.exists() and _is_locked(mine)
            assert not any(p.exists() for p in own + dead_old + [deleting]), local
            assert all(p.exists() for p in dead_new) == (not local), local  # 10 minutes, where locks may hide
            assert path.read_bytes() == b"the committed checkpoint"
        release(lock)
        files.remove_leftovers(path)  # nobody holds any now: the rest goes, or waits for its 10 minutes
        left = sorted(p.name for p in tmp_path.iterdir() if p != path)
        assert left == ([] if local else sorted(p.name for p in live[:2] + dead_new)), local
        for leftover in tmp_path.glob(".last.ckpt.*"):
            files.remove(leftover)

    # A cleanup holds the lock until it is done, so that no save takes the name up meanwhile.
    leftover = _leftover(name(DEAD_RUN), b"killed", age=hour)
    with files.claimed(leftover) as over:
        assert over and _is_locked(leftover)
    with files.claimed(tmp_path / ".last.ckpt.tmp-gone") as over:
        assert not over

    # A sharded checkpoint's clean-up deletes no shards once another run has committed over this save's meta.pt.
    from lightning_zero.engine.checkpoint.saving import _remove_replaced_shards

    checkpoint = tmp_path / "sharded.ckpt"
    replaced = _leftover(checkpoint / f"shards-{new_token()}", b"replaced", directory=True)
    mine, theirs = f"shards-{new_token()}", f"shards-{OTHER_RUN}f6"
    for shards in (mine, theirs):
        (checkpoint / shards).mkdir()
    ours = files.atomic_torch_save({"save_id": mine}, checkpoint / "meta.pt")
    newer = files.atomic_torch_save({"save_id": theirs}, checkpoint / "meta.pt")  # the other run's commit
    _remove_replaced_shards(checkpoint, mine, ours)
    assert sorted(p.name for p in checkpoint.iterdir()) == sorted(["meta.pt", replaced.name, mine, theirs])
    _remove_replaced_shards(checkpoint, theirs, newer)  # the other run's clean-up
    assert sorted(p.name for p in checkpoint.iterdir()) == ["meta.pt", theirs]


def _save_beside_another_job(rank: int, world_size: int, root: str) -> dict[str, list[str]]:
    """This job: in each format, a fit that saves ``last.ckpt`` at the end of every epoch (``ModelCheckpoint``), into
    the directory where another job's saves of that name are in progress. Before each fit, rank 0 leaves what
    interrupted saves of this run would have left; it returns their paths."""
    own: dict[str, list[str]] = {}
    for checkpoint_format in ("full", "sharded"):
        directory = Path(root, checkpoint_format)
        last = directory / "last.ckpt"
        planted = []
        if rank == 0:
            sharded = checkpoint_format == "sharded"
            planted.append(_leftover(temporary_path(last, new_token()), b"this run's, interrupted", directory=sharded))
            if sharded:  # an interrupted save of this run in place, into the checkpoint another run left
                planted.append(_leftover(last / f"shards-{new_token()}", b"this run's, interrupted", directory=True))
        own[checkpoint_format] = [str(p) for p in planted]
        torch.manual_seed(0)
        trainer = quiet_trainer(
            strategy=_strategy(checkpoint_format),
            devices=world_size,
            max_epochs=3,
            enable_checkpointing=True,
            # The same name whatever is there already (without it, Lightning would pick last-v1.ckpt beside the other
            # job's last.ckpt; jobs that start together collide either way).
            callbacks=[ModelCheckpoint(dirpath=directory, save_last=True, enable_version_counter=False)],
        )
        trainer.fit(_model())
    return own


def test_two_jobs_saving_one_name_into_one_directory_leave_each_other_alone(tmp_path: Path) -> None:
    """A sweep's two jobs share ``ModelCheckpoint(dirpath=...)`` and both save ``last.ckpt``. While the other job's
    saves are in progress (its temporary file, its temporary directory, its new shards and ``meta.pt`` inside the
    checkpoint, each held with ``flock`` by a live process), this job saves ``last.ckpt`` three times in each format:
    the other job's files stay, whole; this run's own interrupted saves and a dead job's hour-old ones go."""
    others: dict[str, list[Path]] = {}
    dead: list[Path] = []
    for checkpoint_format in ("full", "sharded"):
        last = tmp_path / checkpoint_format / "last.ckpt"
        last.parent.mkdir()
        sharded = checkpoint_format == "sharded"
        others[checkpoint_format] = [
            _leftover(temporary_path(last, f"{OTHER_RUN}a1"), f"other job, {checkpoint_format}".encode(), sharded)
        ]
        dead.append(_leftover(temporary_path(last, f"{DEAD_RUN}b2"), b"dead job", directory=sharded, age=HOUR))
        if sharded:  # a checkpoint of that name by another run, so this job's saves commit in place
            last.mkdir()
            _leftover(last / "meta.pt", b"another run's meta.pt", age=HOUR)
            dead.append(_leftover(last / f"shards-{DEAD_RUN}c3", b"another run's shards", directory=True, age=HOUR))
            others[checkpoint_format] += [
                _leftover(last / f"shards-{OTHER_RUN}d4", b"other job, new shards", directory=True),
                _leftover(temporary_path(last / "meta.pt", f"{OTHER_RUN}e5"), b"other job, meta.pt"),
            ]
    held = others["full"] + others["sharded"]
    contents = [_content(p) for p in held]
    with _held_by_another_process(held) as holder:
        own = spawn(_save_beside_another_job, world_size=2, timeout=300, root=str(tmp_path))[0]
        assert holder.poll() is None
        assert [_content(p) for p in held] == contents  # every one whole, and still held by its writer
        assert all(_is_locked(p) for p in held)
    for checkpoint_format in ("full", "sharded"):
        directory = tmp_path / checkpoint_format
        hidden = sorted(p.name for p in directory.iterdir() if p.name.startswith("."))
        assert hidden == [others[checkpoint_format][0].name], (checkpoint_format, hidden)
        assert own[checkpoint_format] and not any(Path(p).exists() for p in own[checkpoint_format])
        assert consolidate_checkpoint(directory / "last.ckpt")["epoch"] == 2  # this job's third save, complete
    last = tmp_path / "sharded" / "last.ckpt"
    shards = sorted(p.name for p in last.glob("shards-*"))
    assert len(shards) == 2 and f"shards-{OTHER_RUN}d4" in shards, shards  # this job's, and the other's in progress
    assert sorted(p.name for p in last.glob(".*")) == [others["sharded"][2].name]
    assert not any(p.exists() for p in dead)
