"""Weights on disk, read a slice at a time: each rank reads the bytes of its own shards, never the whole file.

[Note: reading weights by the slice]
A pretrained checkpoint is as large as the model; a rank of a sharded run needs only its shard of
each parameter (and the buffers, which every rank holds). ``WeightFiles`` opens what
``save_pretrained``, ``torch.save`` and LitGPT write and reads element ranges of the flattened
tensors:

- **safetensors** (``model.safetensors``, or shards listed in ``model.safetensors.index.json``): a
  tensor is stored contiguously, so the element range ``[start, stop)`` of its flattened form is one
  byte range of the file, read with ``pread`` and nothing around it: the kernel is told not to read
  ahead (``POSIX_FADV_RANDOM``), which a memory map would do into the neighbouring ranks' slices.
- **PyTorch files** (``pytorch_model.bin`` and its index, ``lit_model.pth``, any ``torch.save`` of a
  state dict): ``torch.load(mmap=True, weights_only=True)`` maps the file, and slicing a tensor
  touches only the pages of the slice.

Bytes read per rank are then about the model's size divided by the number of ranks (its shards),
plus the buffers. A file is opened once per ``WeightFiles`` and closed with it.

A directory holding several layouts is read as transformers' ``from_pretrained`` reads it: the first of
``model.safetensors``, ``model.safetensors.index.json``, ``pytorch_model.bin``,
``pytorch_model.bin.index.json`` that is there (then LitGPT's ``lit_model.pth``); the others are ignored, as
there. Every safetensors header is read and checked when the files are opened, before any tensor is used
(see [Note: safetensors header] in ``safetensors_header.py``).

Example::

    files = WeightFiles.open("checkpoints/llama")     # a directory, or one file
    files.shape("model.embed_tokens.weight")          # (32000, 4096)
    files.read("model.embed_tokens.weight", 0, 4096)  # the first row, flattened
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from lightning_zero.engine.errors import CorruptCheckpointError
from lightning_zero.engine.io.safetensors_header import SafetensorsHeader, read_header

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
# The weights of a directory, in the order transformers' from_pretrained looks for them (``_get_resolved_checkpoint_
# files`` in modeling_utils.py): the first one there is read. LitGPT's file last, which transformers does not read.
WEIGHT_FILES = ("model.safetensors", SAFETENSORS_INDEX, "pytorch_model.bin", BIN_INDEX, "lit_model.pth")


class WeightFiles:
    """The tensors of a checkpoint on disk, by name, read by element range (see the note above)."""

    def __init__(self, where: dict[str, Path], headers: dict[Path, SafetensorsHeader]) -> None:
        self._where = where  # tensor name -> the file that holds it
        self._headers = headers  # every safetensors file's checked header, read when the files were opened
        self._open: dict[Path, Any] = {}

    @staticmethod
    def open(path: str | Path, name: str | None = None) -> WeightFiles:
        """The checkpoint at ``path``: a directory as ``save_pretrained`` writes it (sharded or not), or one
        ``.safetensors`` / ``torch.save`` file. ``name``: the file or index of the directory to read, where the
        model's config names one (transformers' ``transformers_weights``); otherwise the first of
        ``WEIGHT_FILES`` there."""
        path = Path(path)
        if path.is_file():
            return _open_files(path, None)
        if not path.is_dir():
            raise FileNotFoundError(
                f"no checkpoint at {str(path)!r}: pass a directory written by save_pretrained, a hub id, or one "
                ".safetensors/.bin/.pth file"
            )
        if name is not None:
            if not (path / name).is_file():
                raise FileNotFoundError(f"{str(path)!r} has no {name!r}, the weights its config names")
            return _open_files(path / name, path)
        for candidate in WEIGHT_FILES:
            if (path / candidate).is_file():
                return _open_files(path / candidate, path)
        raise FileNotFoundError(f"{str(path)!r} holds no weights: expected one of {', '.join(WEIGHT_FILES)}")

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def shape(self, key: str) -> tuple[int, ...]:
        header = self._headers.get(self._where[key])
        if header is not None:
            return header.tensors[key].shape
        return tuple(self._handle(key)[key].shape)

    def dtype(self, key: str) -> torch.dtype | None:
        """The dtype tensor ``key`` is stored in; ``None`` where torch has none for it (see ``dtype_name``)."""
        header = self._headers.get(self._where[key])
        if header is not None:
            return header.tensors[key].torch_dtype
        return self._handle(key)[key].dtype

    def dtype_name(self, key: str) -> str:
        """The file's name for the dtype of tensor ``key`` (safetensors' ``"F8_E4M3"``, or torch's ``"float32"``)."""
        header = self._headers.get(self._where[key])
        if header is not None:
            return header.tensors[key].dtype
        return str(self._handle(key)[key].dtype).removeprefix("torch.")

    def weights_dtype(self) -> torch.dtype | None:
        """The dtype transformers' ``dtype="auto"`` takes from the weights, where the config records none: that of
        the first floating-point tensor of the first file (by file name, tensors in the order the file lists them:
        by name in safetensors), else of its first tensor."""
        first = min(self._where.values())
        keys = [key for key, where in self._where.items() if where == first]
        if first in self._headers:
            keys.sort()
        dtypes = [self.dtype(key) for key in keys]
        return next((d for d in dtypes if d is not None and d.is_floating_point), dtypes[0] if dtypes else None)

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``key`` flattened, in its stored dtype (a new tensor)."""
        handle = self._handle(key)
        if isinstance(handle, dict):
            return handle[key].reshape(-1)[start:stop].clone()
        return handle.read(key, start, stop)

    def read_whole(self, key: str) -> torch.Tensor:
        """Tensor ``key`` whole (for buffers, which every rank holds)."""
        handle = self._handle(key)
        if isinstance(handle, dict):
            return handle[key].clone()
        shape = self.shape(key)
        numel = 1
        for n in shape:
            numel *= n
        return handle.read(key, 0, numel).reshape(shape)

    def close(self) -> None:
        for handle in self._open.values():
            if isinstance(handle, _SafetensorsFile):
                handle.close()
        self._open.clear()

    def _handle(self, key: str) -> Any:
        path = self._where[key]
        handle = self._open.get(path)
        if handle is None:
            header = self._headers.get(path)
            handle = self._open[path] = _SafetensorsFile(header) if header is not None else _load_torch_file(path)
        return handle


class _SafetensorsFile:
    """One ``.safetensors`` file read with ``pread`` at the byte ranges asked for, the kernel told not to read ahead
    (``POSIX_FADV_RANDOM``): a rank reads its slices and nothing of its neighbours'. Its header was checked when
    the files were opened (``read_header``); the file must still be the one checked."""

    def __init__(self, header: SafetensorsHeader) -> None:
        self.header = header
        self.path = header.path
        self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        size = os.fstat(self.fd).st_size
        if size != header.file_size:
            os.close(self.fd)
            raise CorruptCheckpointError(
                f"{str(self.path)!r} changed since it was opened ({header.file_size} bytes then, {size} now): "
                "something replaced the weights during the run; nothing was read from it"
            )
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        entry = self.header.tensors[key]
        dtype = entry.torch_dtype
        if dtype is None:  # plan_weight_load refuses such a tensor first; a direct reader gets this
            raise TypeError(
                f"tensor {key!r} of {str(self.path)!r} is stored as {entry.dtype}, which torch {torch.__version__} "
                "has no dtype for, so it cannot be read"
            )
        if not 0 <= start <= stop <= entry.numel:
            raise IndexError(f"elements [{start}, {stop}) of tensor {key!r}, which has {entry.numel}")
        size = dtype.itemsize
        buffer = bytearray((stop - start) * size)
        view, done = memoryview(buffer), 0
        offset = self.header.data_start + entry.begin + start * size
        while done < len(buffer):
            count = os.preadv(self.fd, [view[done : done + (1 << 30)]], offset + done)
            if count == 0:
                raise CorruptCheckpointError(f"{str(self.path)!r} ends before tensor {key!r}: the file was truncated")
            done += count
        if not buffer:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype)

    def close(self) -> None:
        os.close(self.fd)


def _open_files(file: Path, directory: Path | None) -> WeightFiles:
    """``file`` (one weight file, or an index of shards in ``directory``), its safetensors headers read and checked."""
    if file.name.endswith(".index.json"):
        assert directory is not None
        where = {key: directory / name for key, name in _weight_map(file).items()}
    elif file.suffix == ".safetensors":
        header = _read_safetensors_header(file)
        return WeightFiles({key: file for key in header.tensors}, {file: header})
    else:
        return WeightFiles({key: file for key in _load_torch_file(file)}, {})
    headers = {}
    for shard in sorted(set(where.values())):
        if not shard.is_file():
            raise CorruptCheckpointError(
                f"{str(file)!r} names {shard.name!r}, which is missing: the checkpoint is incomplete"
            )
        if shard.suffix == ".safetensors":
            headers[shard] = _read_safetensors_header(shard)
    for key, shard in where.items():
        if shard in headers and key not in headers[shard].tensors:
            raise CorruptCheckpointError(
                f"{str(file)!r} puts tensor {key!r} in {shard.name!r}, which does not hold it: the index does not "
                "belong to these files"
            )
    return WeightFiles(where, headers)


def _weight_map(index: Path) -> dict[str, str]:
    """An index's ``weight_map`` (tensor name -> file name in the index's directory), checked to be one."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise CorruptCheckpointError(f"{str(index)!r} is not an index of weight files (no weight_map: {err})") from None
    names = weight_map.values() if isinstance(weight_map, dict) else ()
    if not names or not all(isinstance(n, str) and n and Path(n).name == n for n in names):
        raise CorruptCheckpointError(
            f"{str(index)!r} is not an index of weight files: its weight_map must map tensor names to file names "
            "in its directory"
        )
    return weight_map


def _read_safetensors_header(path: Path) -> SafetensorsHeader:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return read_header(fd, path)
    finally:
        os.close(fd)


def _load_torch_file(path: Path) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(
            f"{str(path)!r} is not a state dict (a mapping of names to tensors); for a Lightning checkpoint, load "
            "its 'state_dict' entry, or convert it with lightning_zero.consolidate_checkpoint first"
        )
    return state
