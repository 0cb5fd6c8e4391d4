"""The header of a ``.safetensors`` file, read and checked as the format requires before any tensor is read.

[Note: safetensors header]
A ``.safetensors`` file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON, and then the
*data region*, the rest of the file. The JSON maps each tensor's name to its ``dtype`` (one of the format's
names, ``"F32"``, ``"F8_E4M3"``, ...), its ``shape`` and its ``data_offsets`` ``[begin, end]``: bytes of the
data region. An optional ``__metadata__`` entry maps strings to strings.

The offsets come from outside the process. A reader that trusts them reads another tensor's bytes as this
one's, or (offsets past the end, or a header length that is too small) the JSON itself as weights, and a
model trains on them without a word. So ``read_header`` checks what the safetensors crate checks before it
hands out a single tensor, and refuses the file otherwise (a ``CorruptCheckpointError`` naming the file and
the tensor, raised where the file is opened, so on every rank alike and before any byte is used):

- the header length is at most the format's limit (100,000,000 bytes) and lies inside the file;
- the header is UTF-8 JSON: an object of entries, each with a known ``dtype``, a ``shape`` of integers >= 0
  and two integer ``data_offsets``, ``0 <= begin <= end <= `` the size of the data region; no name twice;
- each tensor's bytes are exactly its elements' (``end - begin == numel x bits / 8``, whole bytes);
- sorted by offset, every tensor starts where the one before it ends, the first at 0 and the last at the end
  of the file: no two tensors share a byte, and no byte lies between or after them.

Every dtype the format defines is known here, also those torch cannot hold (``F4``, ``F6_*``) or that this
torch lacks; ``TensorEntry.torch_dtype`` is then ``None``. Such a tensor is refused only when a model asks for
its values (see ``plan_weight_load``): a file may carry tensors the model never loads.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_zero.engine.errors import CorruptCheckpointError

MAX_HEADER_BYTES = 100_000_000  # the safetensors crate's limit (``MAX_HEADER_SIZE``)


def _torch(name: str) -> torch.dtype | None:
    """torch's dtype called ``name``, or ``None`` where this torch has none (float8 and unsigned types are newer)."""
    found = getattr(torch, name, None)
    return found if isinstance(found, torch.dtype) else None


# Every dtype of the format: its name -> (bits per element, torch's dtype for it or None).
SAFETENSORS_DTYPES: dict[str, tuple[int, torch.dtype | None]] = {
    "BOOL": (8, torch.bool),
    "U8": (8, torch.uint8),
    "I8": (8, torch.int8),
    "U16": (16, _torch("uint16")),
    "I16": (16, torch.int16),
    "U32": (32, _torch("uint32")),
    "I32": (32, torch.int32),
    "U64": (64, _torch("uint64")),
    "I64": (64, torch.int64),
    "F16": (16, torch.float16),
    "BF16": (16, torch.bfloat16),
    "F32": (32, torch.float32),
    "F64": (64, torch.float64),
    "C64": (64, torch.complex64),
    "F8_E4M3": (8, _torch("float8_e4m3fn")),
    "F8_E5M2": (8, _torch("float8_e5m2")),
    "F8_E4M3FNUZ": (8, _torch("float8_e4m3fnuz")),
    "F8_E5M2FNUZ": (8, _torch("float8_e5m2fnuz")),
    "F8_E8M0": (8, _torch("float8_e8m0fnu")),
    # Sub-byte elements, packed: torch has no dtype of one element each (its float4 type holds two).
    "F4": (4, None),
    "F6_E2M3": (6, None),
    "F6_E3M2": (6, None),
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checked header: its bytes are ``[begin, end)`` of the data region."""

    dtype: str  # the format's name for it
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def torch_dtype(self) -> torch.dtype | None:
        return SAFETENSORS_DTYPES[self.dtype][1]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    """A checked header (see the note above): the tensors by name, and where the data region starts."""

    path: Path
    data_start: int  # 8 + the header length: the file offset of the data region
    data_size: int
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]

    @property
    def file_size(self) -> int:
        return self.data_start + self.data_size


def _refuse(path: Path, problem: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{str(path)!r} is not a valid safetensors file: {problem}. Nothing was read from it; the file is damaged "
        "or was forged: download or save it again"
    )


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise ValueError(f"the header names {twice!r} twice")
    return dict(pairs)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_header(fd: int, path: Path) -> SafetensorsHeader:
    """The header of the safetensors file open at ``fd``, checked (see the note above), or a
    ``CorruptCheckpointError`` naming ``path`` and what is wrong."""
    size = os.fstat(fd).st_size
    if size < 8:
        raise _refuse(path, f"it has {size} bytes, fewer than the 8 of the header length it starts with")
    (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if length > MAX_HEADER_BYTES:
        raise _refuse(
            path, f"its header length says {length} bytes, more than the format's limit of {MAX_HEADER_BYTES}"
        )
    if 8 + length > size:
        raise _refuse(path, f"its header length says {length} bytes, past the end of the file ({size} bytes)")
    raw = os.pread(fd, length, 8)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as err:  # JSONDecodeError is a ValueError
        raise _refuse(path, f"its {length}-byte header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise _refuse(path, f"its header is a JSON {type(header).__name__}, not an object of tensors")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _refuse(path, "its __metadata__ is not an object of strings")
    data_size = size - 8 - length
    tensors = {name: _entry(path, name, value, data_size) for name, value in header.items()}
    _check_coverage(path, tensors, data_size)
    return SafetensorsHeader(path, 8 + length, data_size, tensors, metadata)


def _entry(path: Path, name: str, value: Any, data_size: int) -> TensorEntry:
    """One header entry, checked on its own: known dtype, integer shape and offsets, bytes matching the shape."""
    if not isinstance(value, dict) or not {"dtype", "shape", "data_offsets"} <= set(value):
        raise _refuse(path, f"the entry of tensor {name!r} is not an object with dtype, shape and data_offsets")
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if dtype not in SAFETENSORS_DTYPES:
        known = ", ".join(SAFETENSORS_DTYPES)
        raise _refuse(path, f"tensor {name!r} has dtype {dtype!r}, which the format does not define ({known})")
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        raise _refuse(path, f"tensor {name!r} has shape {shape!r}, not a list of integers >= 0")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(n) for n in offsets):
        raise _refuse(path, f"tensor {name!r} has data_offsets {offsets!r}, not two integers [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise _refuse(
            path,
            f"tensor {name!r} has data_offsets [{begin}, {end}], outside the data region of {data_size} bytes "
            "(0 <= begin <= end <= its size is required)",
        )
    bits = math.prod(shape) * SAFETENSORS_DTYPES[dtype][0]
    if bits % 8:
        raise _refuse(path, f"tensor {name!r} of dtype {dtype} and shape {shape} is {bits} bits, not whole bytes")
    if end - begin != bits // 8:
        raise _refuse(
            path,
            f"tensor {name!r} has data_offsets [{begin}, {end}] ({end - begin} bytes), but its dtype {dtype} and "
            f"shape {shape} need {bits // 8} bytes",
        )
    return TensorEntry(dtype, tuple(shape), begin, end)


def _check_coverage(path: Path, tensors: dict[str, TensorEntry], data_size: int) -> None:
    """Sorted by offset, each tensor starts where the last ended, from 0 to the end of the file: no byte is shared,
    none is left between or after them."""
    done, last = 0, None
    for name, entry in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin < done:
            raise _refuse(
                path,
                f"tensor {name!r} (bytes [{entry.begin}, {entry.end}]) overlaps tensor {last!r}, which ends at {done}",
            )
        if entry.begin > done:
            where = f"after tensor {last!r}" if last is not None else "at the start of the data region"
            raise _refuse(path, f"bytes [{done}, {entry.begin}] {where} belong to no tensor (before {name!r})")
        done, last = entry.end, name
    if done != data_size:
        raise _refuse(
            path, f"the last {data_size - done} bytes of the file (after byte {done} of the data) belong to no tensor"
        )
