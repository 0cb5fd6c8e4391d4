"""One ordinary ``torch.save`` file, written by every rank in parallel: no rank gathers anything.

[Note: parallel full file]
``torch.save`` writes a zip archive: a pickle (``data.pkl``) that describes the object, tensors
included, and one uncompressed record per tensor storage holding its bytes. The bytes of a record
can be written by anyone who knows where the record starts. So a full checkpoint, the very file
``DDPStrategy`` writes, is produced without gathering:

1. Every rank describes its part: each parameter and per-element optimizer state is a ``FlatPiece``,
   the elements ``[offset, offset + local.numel())`` of the flattened full tensor that this rank's
   shard holds (see [Note: flat layout] in ``engine/core/layout.py``).
2. Rank 0 replaces each piece by a ``FakeTensor`` of the full shape and dtype (no memory) and saves
   the whole checkpoint under ``torch.serialization.skip_data``: the archive gets its pickle and
   its records' headers, with space left (a sparse hole) where the fake tensors' bytes go. A pickler
   that records which storage got which record tells rank 0 where each piece's tensor starts
   (``PyTorchFileReader.get_record_offset``); rank 0 writes the bytes of the real tensors (buffers,
   ``step`` counters, Lightning's own) and broadcasts the offsets.
3. Every rank writes its pieces at ``record offset + offset * element size`` with ``pwrite``, in
   parallel, ``fsync``s, and returns the CRC-32 of each piece; rank 0 joins them into each record's
   checksum and stores it (see [Note: record checksums] in ``engine/io/checksums.py``), so the file
   is a valid zip archive that ``zipfile`` and ``unzip -t`` accept, and a load can check its bytes.

``torch.load`` reads the result like any checkpoint.
"""

from __future__ import annotations

import copy
import os
import pickle
import types
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_zero.engine.io.checksums import PieceChecksum
from lightning_zero.engine.io.files import crash_point

_WRITE_CHUNK = 1 << 30  # bytes per pwrite call (Linux writes at most ~2 GiB at once)


@dataclass(frozen=True, eq=False)
class FlatPiece:
    """This rank's part of a tensor that is saved whole: elements ``[offset, offset + local.numel())`` of
    the flattened tensor of ``shape`` and ``dtype``. ``key`` names the tensor the same way on every rank."""

    key: str
    shape: torch.Size
    dtype: torch.dtype
    local: torch.Tensor
    offset: int

    def __reduce__(self) -> Any:
        raise TypeError(
            f"{self.key!r} is one rank's piece of a sharded tensor; it is written by lightning_zero's checkpoint "
            "writer and cannot be pickled on its own (use strategy.full_state_dict() for full tensors)"
        )


def pieces_in(obj: Any) -> Iterator[FlatPiece]:
    """Every ``FlatPiece`` in nested dicts, lists and tuples, once each."""
    seen: set[int] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, FlatPiece):
            if id(item) not in seen:
                seen.add(id(item))
                yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def _with_fakes(obj: Any, fakes: dict[int, torch.Tensor], mode: FakeTensorMode) -> Any:
    """``obj`` with each ``FlatPiece`` replaced by a fake tensor of its full shape (the same fake for the
    same piece, so tied weights stay one storage); containers without pieces are returned as they are."""
    if isinstance(obj, FlatPiece):
        if id(obj) not in fakes:
            with mode:
                fakes[id(obj)] = torch.empty(obj.shape, dtype=obj.dtype, device="cpu")
        return fakes[id(obj)]
    if isinstance(obj, dict):
        changed = {k: v2 for k, v in obj.items() if (v2 := _with_fakes(v, fakes, mode)) is not v}
        if not changed:
            return obj
        result = copy.copy(obj)  # keeps the dict's class (OrderedDict, ...)
        result.update(changed)
        return result
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        items = [_with_fakes(v, fakes, mode) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return type(obj)(items)
    return obj


class _RecordingPickler(pickle._Pickler):  # type: ignore[name-defined]
    """The pure-Python pickler, noting which storage object each persistent id (storage record) was made
    for. ``torch.save`` subclasses it (``pickle_module.Pickler``) and supplies ``persistent_id``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.storage_of_record: dict[str, Any] = {}
        self._saving: Any = None

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if save_persistent_id:
            self._saving = obj
        super().save(obj, save_persistent_id)

    def save_pers(self, pid: Any) -> None:
        self.storage_of_record.setdefault(str(pid[2]), self._saving)
        super().save_pers(pid)


def _recording_pickle_module(picklers: list[_RecordingPickler]) -> types.SimpleNamespace:
    """A ``pickle_module`` for ``torch.save`` whose pickler is appended to ``picklers``."""

    class Recording(_RecordingPickler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            picklers.append(self)

    return types.SimpleNamespace(Pickler=Recording, __name__="pickle")


def _untyped(storage: Any) -> torch.UntypedStorage:
    return storage._untyped_storage if isinstance(storage, torch.storage.TypedStorage) else storage


class Skeleton(NamedTuple):
    """Where rank 0's skeleton put things: each piece's record (its zip name and byte offset in the file), by
    ``FlatPiece.key``, and the checksums of the records rank 0 wrote whole (the real tensors), by zip name."""

    offsets: dict[str, int]
    record_names: dict[str, str]
    record_sizes: dict[str, int]
    checksums: dict[str, int]


def write_skeleton(checkpoint: dict[str, Any], path: Path) -> Skeleton:
    """Rank 0: write ``checkpoint`` to ``path`` with every ``FlatPiece`` as a hole of its full size, and the
    bytes of every real tensor; return where each piece goes (see ``Skeleton``)."""
    mode = FakeTensorMode()
    fakes: dict[int, torch.Tensor] = {}
    skeleton = _with_fakes(checkpoint, fakes, mode)
    key_of_storage = {}
    for piece in pieces_in(checkpoint):
        key_of_storage[fakes[id(piece)].untyped_storage()._cdata] = piece.key
    picklers: list[_RecordingPickler] = []
    with open(path, "wb") as stream:
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(skeleton, stream, pickle_module=_recording_pickle_module(picklers))
        stream.flush()
    (recorder,) = picklers
    layout = Skeleton({}, {}, {}, {})
    with open(path, "rb") as stream:
        reader = torch._C.PyTorchFileReader(stream)
        record_offsets = {record: reader.get_record_offset(f"data/{record}") for record in recorder.storage_of_record}
    prefix = _archive_name(path)
    fd = os.open(path, os.O_WRONLY)
    try:
        for record, storage in recorder.storage_of_record.items():
            untyped = _untyped(storage)
            piece_key = key_of_storage.get(untyped._cdata)
            name = f"{prefix}/data/{record}"
            if piece_key is not None:
                layout.offsets[piece_key] = record_offsets[record]
                layout.record_names[piece_key] = name
                layout.record_sizes[piece_key] = untyped.nbytes()
            else:  # a real tensor: its bytes now
                data = torch.empty(0, dtype=torch.uint8, device=untyped.device).set_(untyped).cpu()
                layout.checksums[name] = _pwrite_all(fd, data, record_offsets[record])
        os.fsync(fd)
    finally:
        os.close(fd)
    missing = set(key_of_storage.values()) - set(layout.offsets)
    if missing:
        raise RuntimeError(f"internal error: no record was written for {sorted(missing)[:3]}")
    return layout


def write_pieces(path: Path, pieces: list[FlatPiece], offsets: dict[str, int]) -> list[PieceChecksum]:
    """Every rank: write this rank's pieces into ``path`` at the offsets rank 0 found; the checksum of each."""
    written = []
    fd = os.open(path, os.O_WRONLY)
    try:
        for piece in pieces:
            if piece.key not in offsets:
                raise RuntimeError(f"{piece.key!r} is not in the checkpoint rank 0 wrote: the ranks' states differ")
            if piece.local.numel() == 0:
                continue
            if piece.local.dtype != piece.dtype:
                raise RuntimeError(f"{piece.key!r}: piece of dtype {piece.local.dtype}, tensor of {piece.dtype}")
            data = piece.local.detach().reshape(-1).cpu()
            start = piece.offset * data.element_size()
            crc = _pwrite_all(fd, data, offsets[piece.key] + start)
            written.append(PieceChecksum(piece.key, start, data.numel() * data.element_size(), crc))
            crash_point("partial", path)
        os.fsync(fd)
    finally:
        os.close(fd)
    return written


def _archive_name(path: Path) -> str:
    """The folder name every record of the archive at ``path`` starts with (``torch.save`` picks it)."""
    with zipfile.ZipFile(path) as archive:
        return archive.infolist()[0].filename.split("/", 1)[0]


def _pwrite_all(fd: int, tensor: torch.Tensor, position: int) -> int:
    """Write ``tensor``'s bytes at ``position``; their CRC-32 (see [Note: record checksums])."""
    view = memoryview(tensor.contiguous().view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done : done + _WRITE_CHUNK], position + done)
    return zlib.crc32(view)
