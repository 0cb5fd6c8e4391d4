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

Example::

    files = WeightFiles.open("checkpoints/llama")     # a directory, or one file
    files.shape("model.embed_tokens.weight")          # (32000, 4096)
    files.read("model.embed_tokens.weight", 0, 4096)  # the first row, flattened
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
_SINGLE_FILES = ("model.safetensors", "pytorch_model.bin", "lit_model.pth")


class WeightFiles:
    """The tensors of a checkpoint on disk, by name, read by element range (see the note above)."""

    def __init__(self, where: dict[str, Path]) -> None:
        self._where = where  # tensor name -> the file that holds it
        self._open: dict[Path, Any] = {}

    @staticmethod
    def open(path: str | Path) -> WeightFiles:
        """The checkpoint at ``path``: a directory as ``save_pretrained`` writes it (sharded or not), or one
        ``.safetensors`` / ``torch.save`` file."""
        path = Path(path)
        if path.is_file():
            return WeightFiles({key: path for key in _keys_of(path)})
        if not path.is_dir():
            raise FileNotFoundError(
                f"no checkpoint at {str(path)!r}: pass a directory written by save_pretrained, a hub id, or one "
                ".safetensors/.bin/.pth file"
            )
        for index in (SAFETENSORS_INDEX, BIN_INDEX):
            if (path / index).is_file():
                weight_map = json.loads((path / index).read_text())["weight_map"]
                return WeightFiles({key: path / name for key, name in weight_map.items()})
        for name in _SINGLE_FILES:
            if (path / name).is_file():
                return WeightFiles({key: path / name for key in _keys_of(path / name)})
        raise FileNotFoundError(
            f"{str(path)!r} holds no weights: expected {SAFETENSORS_INDEX}, {BIN_INDEX} or one of "
            f"{', '.join(_SINGLE_FILES)}"
        )

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def shape(self, key: str) -> tuple[int, ...]:
        handle = self._handle(key)
        if isinstance(handle, dict):
            return tuple(handle[key].shape)
        return handle.shape(key)

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
        numel = 1
        for n in handle.shape(key):
            numel *= n
        return handle.read(key, 0, numel).reshape(handle.shape(key))

    def close(self) -> None:
        for handle in self._open.values():
            if isinstance(handle, _SafetensorsFile):
                handle.close()
        self._open.clear()

    def _handle(self, key: str) -> Any:
        path = self._where[key]
        handle = self._open.get(path)
        if handle is None:
            handle = self._open[path] = _open_file(path)
        return handle


class _SafetensorsFile:
    """One ``.safetensors`` file read with ``pread`` at the byte ranges asked for, the kernel told not to read ahead
    (``POSIX_FADV_RANDOM``): a rank reads its slices and nothing of its neighbours'. The format is an 8-byte
    little-endian header length, a JSON header (``dtype``, ``shape``, ``data_offsets`` per tensor), then the data."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        (length,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
        header = json.loads(os.pread(self.fd, length, 8))
        header.pop("__metadata__", None)
        self.base = 8 + length
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {
            key: (_SAFETENSORS_DTYPES[v["dtype"]], tuple(v["shape"]), v["data_offsets"][0]) for key, v in header.items()
        }

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][1]

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        dtype, _, offset = self.entries[key]
        size = dtype.itemsize
        buffer = bytearray(max(stop - start, 0) * size)
        view, done = memoryview(buffer), 0
        while done < len(buffer):
            count = os.preadv(self.fd, [view[done : done + (1 << 30)]], self.base + offset + start * size + done)
            if count == 0:
                raise OSError(f"{str(self.path)!r} ends before tensor {key!r} does: the file is truncated")
            done += count
        if not buffer:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype)

    def close(self) -> None:
        os.close(self.fd)


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _open_file(path: Path) -> Any:
    if path.suffix == ".safetensors":
        return _SafetensorsFile(path)
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(
            f"{str(path)!r} is not a state dict (a mapping of names to tensors); for a Lightning checkpoint, load "
            "its 'state_dict' entry, or convert it with lightning_zero.consolidate_checkpoint first"
        )
    return state


def _keys_of(path: Path) -> list[str]:
    handle = _open_file(path)
    keys = list(handle.keys())
    if isinstance(handle, _SafetensorsFile):
        handle.close()
    return keys
