"""Reading checkpoint files that may be damaged or hostile: nothing runs, nothing outside is read, nothing
is allocated that the files do not hold.

[Note: checkpoint trust]
A checkpoint is data from outside the process (a download, a shared disk, an older run), so every read
is checked before it happens, and every refusal is a ``CorruptCheckpointError`` (or
``UnsafeCheckpointError`` for pickled objects the caller may choose to trust) raised before anything is
loaded:

- **No code runs.** DCP's ``.metadata`` is a pickle; ``_MetadataUnpickler`` rebuilds exactly the record
  classes DCP writes (an explicit list of ``(module, name)`` pairs, no dotted names, no module-wide
  acceptance) and nothing else. ``meta.pt`` and full ``.ckpt`` files go through ``torch.load(...,
  weights_only=True)``. Entries stored as pickled bytes and storage transforms (which could name a
  decompressor) are refused: our writers never produce them.
- **Nothing outside is read.** Every file is a regular file (not a symlink, not a device) directly in
  the checkpoint's directory; reads open it with ``O_NOFOLLOW`` and check ``fstat`` again.
- **Nothing is allocated that is not stored.** Each piece's byte range lies inside its file, ranges
  do not overlap, each piece's stored length holds its elements, and the pieces of a tensor cover it
  exactly once; so whatever a loader allocates from the metadata is at most the bytes on disk.
- **Pieces of one save only.** Every rank's file carries the save's identity (see [Note: sharded
  layout] in ``engine/checkpoint/sharded.py``), compared with the one ``meta.pt`` names.
- A full file is a zip archive (what ``torch.save`` writes) whose records all lie inside the file,
  checked with ``zipfile`` before ``torch.load``, which itself refuses storages larger than their
  records; it is mapped (``mmap=True``), so a rank reads only the pages it uses.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import pickle
import re
import stat
import struct
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path, PosixPath, PurePosixPath
from typing import IO, Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
import torch.serialization
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from lightning_zero.engine.errors import CorruptCheckpointError, UnsafeCheckpointError
from lightning_zero.engine.io import checksums


def _torch_refusal(error: BaseException) -> str:
    """The line of torch's weights-only refusal that names what it refused (the rest of its text is generic, and
    suggests ``weights_only=False``)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "unsupported" in line.lower()]
    return (named or lines[-1:] or ["no detail given"])[0]


_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+) was not an allowed global")


def _trust_advice(error: BaseException) -> str:
    """How to load a refused file anyway, if it is trusted, in a way every entry point honours: Lightning's Trainer
    does not pass ``weights_only`` on to a strategy that restores after setup (this one), but a ``safe_globals``
    block around the call reaches every rank's ``torch.load``."""
    named = _REFUSED_GLOBAL.search(str(error))
    allow = named.group(1) if named else "the classes it names"
    return (
        f"If you trust the file, allow {allow} around the call that loads it: "
        f"`with torch.serialization.safe_globals([{allow if named else '...'}]): trainer.fit(..., ckpt_path=...)` "
        "(the Trainer does not pass weights_only=False on to this strategy; fabric.load and consolidate_checkpoint "
        "also take weights_only=False)"
    )


_METADATA_CLASSES: dict[tuple[str, str], Any] = {
    **{
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # returns a torch.layout only
    ("torch", "Size"): torch.Size,
    ("pathlib", "PosixPath"): PosixPath,
    ("pathlib", "PurePosixPath"): PurePosixPath,
    ("collections", "OrderedDict"): OrderedDict,
    **{("torch", str(d).removeprefix("torch.")): d for d in vars(torch).values() if isinstance(d, torch.dtype)},
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: rebuild only the records it is made of (see [Note: checkpoint trust])."""

    def find_class(self, module: str, name: str) -> Any:
        found = _METADATA_CLASSES.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(
                f"the checkpoint's metadata asks for {module}.{name}, which checkpoint metadata never needs; "
                "refusing to run it (the file may be tampered with)"
            )
        return found


def regular_file(directory: Path, name: str, what: str = "checkpoint file") -> Path:
    """``directory / name``, checked to be a regular file directly inside ``directory`` (not a symlink)."""
    if not name or Path(name).name != name or name in (".", ".."):
        raise CorruptCheckpointError(
            f"the checkpoint in {str(directory)!r} points to {name!r}, outside its directory: refusing to read it"
        )
    file = directory / name
    try:
        info = file.lstat()
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{str(file)!r} is missing: the checkpoint is incomplete") from None
    if stat.S_ISLNK(info.st_mode):
        raise CorruptCheckpointError(
            f"{str(file)!r} is a symbolic link; a {what} must be a regular file inside the checkpoint, "
            "so it was not read (a link could point anywhere)"
        )
    if not stat.S_ISREG(info.st_mode):
        raise CorruptCheckpointError(f"{str(file)!r} is not a regular file, so it was not read")
    return file


@contextmanager
def open_regular(path: Path) -> Generator[IO[bytes], None, None]:
    """Open for reading without following a symlink, and only if it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise CorruptCheckpointError(f"{str(path)!r} cannot be read as a checkpoint file: {err}") from err
    with os.fdopen(fd, "rb") as stream:
        if not stat.S_ISREG(os.fstat(stream.fileno()).st_mode):
            raise CorruptCheckpointError(f"{str(path)!r} is not a regular file, so it was not read")
        yield stream


class _RegularFilesOnly(FileSystem):
    """DCP's file access, reading regular files only and never through a symlink."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "rb":
            raise ValueError("checkpoint files are only read here")
        with open_regular(Path(path)) as stream:
            yield stream  # type: ignore[misc]


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with every check of [Note: checkpoint trust] made before anything is loaded.

    ``save_id``, when given, is the identity every rank's file must carry (``None``: a format-1
    checkpoint, which has none)."""

    def __init__(self, path: Path, save_id: str | None = None) -> None:
        super().__init__(path)
        self.fs = _RegularFilesOnly()
        self.save_id = save_id
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = self._read_checked_metadata()
        self._metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return self._metadata

    def _read_checked_metadata(self) -> Metadata:
        directory = Path(self.path)
        file = regular_file(directory, ".metadata", "checkpoint index")
        with open_regular(file) as stream:
            data = stream.read()  # unpickled from memory: a length in the pickle cannot reach past the file
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except Exception as err:  # whatever a damaged pickle raises, nothing was loaded
            raise CorruptCheckpointError(f"{str(file)!r} is damaged or not checkpoint metadata: {err}") from err
        if not isinstance(metadata, Metadata):
            raise CorruptCheckpointError(f"{str(file)!r} is not checkpoint metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        sizes = check_storage(directory, metadata)
        if self.save_id is not None:
            check_save_id(directory, metadata, self.save_id, sizes)
        return metadata


def check_storage(directory: Path, metadata: Metadata) -> dict[str, int]:
    """Every check of [Note: checkpoint trust] on the files ``metadata`` points to; their sizes by name."""
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not isinstance(metadata.state_dict_metadata, dict):
        raise CorruptCheckpointError(f"the metadata in {str(directory)!r} is damaged (no storage table)")
    ranges: dict[str, list[tuple[int, int]]] = {}
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, dcp_filesystem._StorageInfo):
            raise CorruptCheckpointError(f"the metadata in {str(directory)!r} is damaged (storage table)")
        if info.transform_descriptors:
            raise CorruptCheckpointError(
                f"checkpoint entry {index.fqn!r} asks for storage transforms {info.transform_descriptors}, "
                "which lightning_zero never writes: refusing to read it"
            )
        offset, length = int(info.offset), int(info.length)
        if offset < 0 or length < 0:
            raise CorruptCheckpointError(f"checkpoint entry {index.fqn!r} has a negative offset or length")
        ranges.setdefault(str(info.relative_path), []).append((offset, offset + length))
    sizes = {}
    for name, spans in ranges.items():
        file = regular_file(directory, name)
        sizes[name] = file.lstat().st_size
        spans.sort()
        if spans[-1][1] > sizes[name]:
            raise CorruptCheckpointError(
                f"{str(file)!r} is truncated ({sizes[name]} bytes, {spans[-1][1]} needed): the checkpoint is incomplete"
            )
        if any(start < end for (_, end), (start, _) in itertools.pairwise(spans)):
            raise CorruptCheckpointError(f"the metadata in {str(directory)!r} lets two entries share bytes of {name}")
    for fqn, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            raise CorruptCheckpointError(
                f"checkpoint entry {fqn!r} should be a tensor but is stored as pickled bytes: refusing to read it"
            )
        _check_chunks(directory, fqn, meta, storage)
    return sizes


def _check_chunks(directory: Path, fqn: str, meta: TensorStorageMetadata, storage: dict) -> None:
    """The chunks of one tensor lie inside it, cover it exactly once, and each is backed by enough bytes."""
    dtype = meta.properties.dtype
    size = list(meta.size)
    if not isinstance(dtype, torch.dtype) or any(not isinstance(s, int) or s < 0 for s in size):
        raise CorruptCheckpointError(f"checkpoint entry {fqn!r} has an invalid dtype or size in {str(directory)!r}")
    element = torch.empty(0, dtype=dtype).element_size()
    covered = 0
    spans = []
    for chunk in meta.chunks:
        offsets, sizes = list(chunk.offsets), list(chunk.sizes)
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise CorruptCheckpointError(f"checkpoint entry {fqn!r} has a piece of another rank than the tensor")
        if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, size)):
            raise CorruptCheckpointError(f"checkpoint entry {fqn!r} has a piece outside the tensor's size {size}")
        info = storage.get(MetadataIndex(fqn, chunk.offsets))
        numel = math.prod(sizes)
        if info is None:
            raise CorruptCheckpointError(f"checkpoint entry {fqn!r} has a piece without stored data")
        if int(info.length) < numel * element:
            raise CorruptCheckpointError(
                f"checkpoint entry {fqn!r} claims {numel * element} bytes for a piece but only {int(info.length)} "
                f"are stored in {str(directory)!r}: refusing to allocate it (the metadata is damaged or forged)"
            )
        covered += numel
        spans.append((offsets[0] if offsets else 0, numel))
    whole = math.prod(size)
    exact = covered == whole and (len(size) == 1 or len(meta.chunks) == 1)
    if exact and len(size) == 1:
        spans.sort()
        exact = all(a + n == b for (a, n), (b, _) in itertools.pairwise(spans))
    if not exact:
        raise CorruptCheckpointError(
            f"checkpoint entry {fqn!r} of size {size} is not covered exactly once by its stored pieces "
            f"({covered} of {whole} elements) in {str(directory)!r}: the checkpoint is damaged"
        )


SAVE_ID_PREFIX = "lightning_zero/save/"


def check_save_id(directory: Path, metadata: Metadata, save_id: str, sizes: dict[str, int]) -> None:
    """Every file the metadata points to holds the identity of the save ``meta.pt`` names."""
    storage = metadata.storage_data
    files_with_id: set[str] = set()
    for key in metadata.state_dict_metadata:
        if not key.startswith(SAVE_ID_PREFIX):
            continue
        info = storage[MetadataIndex(key, torch.Size([0]))]
        with open_regular(directory / info.relative_path) as stream:
            stream.seek(int(info.offset))
            blob = stream.read(int(info.length))
        try:
            stored = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as err:  # any damage in this small record means the file is not trustworthy
            raise CorruptCheckpointError(f"{info.relative_path!r} in {str(directory)!r} is damaged: {err}") from err
        if not isinstance(stored, torch.Tensor) or bytes(stored.tolist()) != save_id.encode():
            raise CorruptCheckpointError(
                f"{str(directory / info.relative_path)!r} belongs to another save than the checkpoint's meta.pt "
                "(it was copied from another checkpoint or run): refusing to mix them"
            )
        files_with_id.add(str(info.relative_path))
    unmarked = sorted(set(sizes) - files_with_id)
    if unmarked:
        raise CorruptCheckpointError(
            f"{str(directory / unmarked[0])!r} carries no identity of the save that wrote this checkpoint "
            "(it was copied from another checkpoint or run): refusing to mix them"
        )


_LEGACY_MAGIC = pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=2)[:-1]  # torch's pre-1.6 format


def load_torch_file(path: Path, weights_only: bool | None, verify: bool = True) -> Any:
    """``torch.load`` of a full checkpoint file, memory-mapped, with damaged and foreign files refused. ``verify``:
    check every record's checksum first (``False`` where the ranks have shared that check, see ``check_records``)."""
    with open_regular(path) as stream:
        head = stream.read(len(_LEGACY_MAGIC))
        size = os.fstat(stream.fileno()).st_size
    if size == 0:
        raise CorruptCheckpointError(f"{str(path)!r} is empty: truncated or corrupted, it was not loaded")
    is_zip = head.startswith(b"PK\x03\x04")
    mmap = is_zip
    if is_zip:
        compressed = any(record.compressed for record in _check_zip(path, size))
        mmap = not compressed  # torch.load decompresses a record it reads, but would map it raw
        if verify:
            problem = check_records(path)
            if problem is not None:
                raise CorruptCheckpointError(problem)
    elif head != _LEGACY_MAGIC:
        raise CorruptCheckpointError(
            f"{str(path)!r} is not a checkpoint or is corrupted: it is neither a zip archive written by torch.save "
            "nor torch's legacy format"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only is not False, mmap=mmap)
    except pickle.UnpicklingError as err:
        if "Weights only load failed" not in str(err):
            raise CorruptCheckpointError(f"{str(path)!r} is not a checkpoint or is corrupted: {err}") from err
        raise UnsafeCheckpointError(
            f"{str(path)!r} holds objects that only arbitrary pickle code can rebuild, so it was not loaded "
            f"(torch: {_torch_refusal(err)})",
            advice=_trust_advice(err),
        ) from err
    except (RuntimeError, EOFError, OSError, KeyError, ValueError, AttributeError, IndexError) as err:
        raise CorruptCheckpointError(f"{str(path)!r} is truncated or corrupted and was not loaded: {err}") from err


def check_records(path: Path, rank: int = 0, world_size: int = 1) -> str | None:
    """This rank's share of the check of a full checkpoint file's record checksums (all of them with the defaults):
    what is wrong, or ``None`` (see [Note: record checksums] in ``engine/io/checksums.py``). A file that is not a
    zip archive has no checksums to check. The ranks must then agree on the verdict."""
    with open_regular(path) as stream:
        if stream.read(4) != b"PK\x03\x04":
            return None
        try:
            with zipfile.ZipFile(stream) as archive:
                found = checksums.records(archive, stream)
                if checksums.unchecked_tensor_records(found):
                    if rank == 0:
                        warnings.warn(
                            f"{str(path)!r} was written by an older lightning_zero, which stored no checksums of "
                            "its tensors: their bytes cannot be checked (save it again to add them)",
                            stacklevel=3,
                        )
                    unchecked = {r.name for r in checksums.tensor_records(found)}
                    found = [r for r in found if r.name not in unchecked]
                bad = checksums.bad_records(archive, stream, checksums.share_records(found, rank, world_size))
        except (zipfile.BadZipFile, OSError, ValueError, struct.error) as err:
            return f"{str(path)!r} is truncated or corrupted and was not loaded: {err}"
    if not bad:
        return None
    return (
        f"{str(path)!r} is corrupted: the bytes of record {bad[0]!r}"
        + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
        + " do not match the checksum stored with them (a damaged disk, a partial copy or an edited file); "
        "it was not loaded. Load an intact copy or an earlier checkpoint."
    )


def _check_zip(path: Path, size: int) -> list[checksums.Record]:
    try:
        with open_regular(path) as stream, zipfile.ZipFile(stream) as archive:
            infos = archive.infolist()
            found = checksums.records(archive, stream)
    except (zipfile.BadZipFile, OSError, ValueError, struct.error) as err:
        raise CorruptCheckpointError(f"{str(path)!r} is truncated or corrupted and was not loaded: {err}") from err
    roots = {info.filename.split("/", 1)[0] for info in infos}
    if len(roots) != 1 or not any(info.filename.endswith("/data.pkl") for info in infos):
        raise CorruptCheckpointError(
            f"{str(path)!r} is a zip archive but not one torch.save wrote, so it is not a checkpoint"
        )
    for record in found:
        if record.data_start + record.stored_size > size:
            raise CorruptCheckpointError(
                f"{str(path)!r} is truncated: record {record.name!r} ends past the end of the file"
            )
    return found
