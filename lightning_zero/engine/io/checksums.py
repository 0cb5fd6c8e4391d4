"""CRC-32 checksums of checkpoint files: made by the ranks that write the bytes, stored with the checkpoint, and
checked on every byte a load relies on before anything is loaded.

[Note: record checksums]
A zip archive stores a CRC-32 of each record twice: in the record's data descriptor, right after its
bytes (``torch.save`` sets flag bit 3, so the local header's own field stays zero), and in the
record's central-directory entry. ``zipfile``, ``unzip -t`` and every zip tool compare them with the
bytes; ``torch.load`` does not. The parallel writer (see [Note: parallel full file] in
``engine/io/torch_file.py``) writes each tensor record in pieces from several ranks, so no rank sees a
whole record:

- every rank computes the CRC-32 of each piece it writes (``zlib.crc32``, about 4 GB/s on one core);
- rank 0 joins the pieces' checksums of each record in offset order with ``crc32_combine`` (zlib's
  algorithm: appending ``n`` bytes to a CRC is a linear map over GF(2), applied here as the product of
  the precomputed maps for the set bits of ``n``, so a join costs about a thousand integer operations,
  whatever the piece's size), then writes each record's checksum into both fields before the commit.

A load checks every record it relies on before ``torch.load`` maps it: the ranks share the records
(``share_records``: balanced by size, the same split on every rank), each reads its records' bytes
once and compares, and the ranks agree on the verdict, so a flipped byte anywhere is a
``CorruptCheckpointError`` on every rank at the cost of reading the file once, spread over the ranks.
A record stored compressed (a file re-zipped by another tool) is checked through ``zipfile``, which
decompresses it; such a file is then loaded without memory-mapping, as ``torch.load`` can decompress
but cannot map it.

Archives that the parallel writer made before it stored checksums have a zero in the fields of every
tensor record: they still load, with a warning that their tensor bytes cannot be checked.

[Note: shard checksums]
A sharded checkpoint's pieces are DCP's stored entries (a byte range of a ``__<rank>_<n>.distcp``
file each). After ``dcp.save`` every rank reads back the entries of its own files (just written, so
from the page cache) and sends their CRC-32s to rank 0, which stores them in ``meta.pt``
(``lightning_zero.checksums``, keyed ``<file>@<offset>``). A load shares the entries between the ranks
as for a full file and checks them before DCP reads anything, so a damaged piece leaves every rank's
shards as they were. A sharded checkpoint without such a table loads with a warning.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, NamedTuple, TypeVar

from lightning_zero.engine.errors import RecordChecksumError

_CRC_POLYNOMIAL = 0xEDB88320  # reflected CRC-32 (zip, zlib)
_READ_CHUNK = 16 << 20
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # signature ... name length, extra length: 30 bytes
_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
_CENTRAL_SIGNATURE = b"PK\x01\x02"


class PieceChecksum(NamedTuple):
    """The CRC-32 of ``length`` bytes that start ``start`` bytes into the record of tensor ``key``."""

    key: str
    start: int
    length: int
    crc: int


# ---------------------------------------------------------------------------------------------- crc32_combine
def _times(matrix: list[int], vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _square(matrix: list[int]) -> list[int]:
    return [_times(matrix, matrix[n]) for n in range(32)]


def _zero_byte_operators() -> list[list[int]]:
    """``operators[k]`` advances a CRC-32 over ``2**k`` zero bytes."""
    one_bit = [_CRC_POLYNOMIAL] + [1 << n for n in range(31)]
    operator = one_bit
    for _ in range(3):  # 8 bits: one byte
        operator = _square(operator)
    operators = [operator]
    for _ in range(63):
        operators.append(_square(operators[-1]))
    return operators


_OPERATORS: list[list[int]] = []


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc1 = crc32(a)``, ``crc2 = crc32(b)`` and ``length2 = len(b)``.

    Example::

        crc32_combine(zlib.crc32(b"ab"), zlib.crc32(b"cd"), 2) == zlib.crc32(b"abcd")  # True
    """
    if length2 <= 0:
        return crc1
    if not _OPERATORS:
        _OPERATORS.extend(_zero_byte_operators())
    bit = 0
    while length2:
        if length2 & 1:
            crc1 = _times(_OPERATORS[bit], crc1)
        length2 >>= 1
        bit += 1
    return crc1 ^ crc2


def record_checksum(key: str, pieces: Iterable[PieceChecksum], length: int) -> int:
    """The CRC-32 of the record of ``key`` (``length`` bytes) from the checksums of pieces that must cover it
    exactly once; ``RecordChecksumError`` names the tensor otherwise."""
    crc, position, written = 0, 0, 0
    for piece in sorted((p for p in pieces if p.length), key=lambda p: p.start):
        written += piece.length
        if piece.start == position:
            crc = crc32_combine(crc, piece.crc, piece.length)
            position += piece.length
        else:
            position = -1  # a gap or an overlap: no checksum, the error below
    if position != length:
        raise RecordChecksumError(
            f"the ranks wrote {written} of the {length} bytes of {key!r}"
            + ": the ranks' optimizer or model states differ, so the file would be incomplete"
        )
    return crc


def join_checksums(
    pieces: Iterable[PieceChecksum], record_names: dict[str, str], record_sizes: dict[str, int]
) -> dict[str, int]:
    """Rank 0: each record's checksum (by zip name) from every rank's pieces (``record_names`` and ``record_sizes``
    by tensor key, as the skeleton laid them out)."""
    by_key: dict[str, list[PieceChecksum]] = {key: [] for key in record_names}
    for piece in pieces:
        by_key[piece.key].append(piece)
    return {record_names[key]: record_checksum(key, found, record_sizes[key]) for key, found in by_key.items()}


# ---------------------------------------------------------------------------------------------- the archive
class Record(NamedTuple):
    """One record of an archive: where its stored bytes lie, and the checksum its central directory holds."""

    name: str
    data_start: int
    stored_size: int
    compressed: bool
    crc: int
    info: zipfile.ZipInfo


def records(archive: zipfile.ZipFile, stream: IO[bytes]) -> list[Record]:
    """Every record of ``archive`` (read from ``stream``, the same file) with its data's position."""
    result = []
    for info in archive.infolist():
        stream.seek(info.header_offset)
        header = stream.read(_LOCAL_HEADER.size)
        if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
            raise zipfile.BadZipFile(f"record {info.filename!r} has no local header where the directory says")
        name_length, extra_length = _LOCAL_HEADER.unpack(header)[-2:]
        start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
        compressed = info.compress_type != zipfile.ZIP_STORED
        result.append(Record(info.filename, start, info.compress_size, compressed, info.CRC, info))
    return result


def tensor_records(all_records: list[Record]) -> list[Record]:
    """The records holding tensor bytes (``<archive>/data/<n>``)."""
    return [r for r in all_records if r.name.split("/", 1)[-1].startswith("data/")]


def write_checksums(path: Path, checksums: dict[str, int]) -> None:
    """Rank 0: store ``checksums`` (by record name) in each record's data descriptor and central-directory entry,
    and ``fsync`` (see [Note: record checksums])."""
    with open(path, "r+b") as stream:
        with zipfile.ZipFile(stream) as archive:
            by_name = {r.name: r for r in records(archive, stream)}
            directory_start = archive.start_dir
        for name, crc in checksums.items():
            record = by_name[name]
            packed = struct.pack("<L", crc)
            if record.info.flag_bits & 0x08:  # a data descriptor follows the data
                end = record.data_start + record.stored_size
                stream.seek(end)
                field = end + 4 if stream.read(4) == _DESCRIPTOR_SIGNATURE else end
            else:
                field = record.info.header_offset + 14
            stream.seek(field)
            stream.write(packed)
        position = directory_start
        for _ in by_name:
            stream.seek(position)
            entry = stream.read(46)
            if entry[:4] != _CENTRAL_SIGNATURE:
                raise zipfile.BadZipFile(f"{str(path)!r}: the central directory is not where the archive says")
            name_length, extra_length, comment_length = struct.unpack("<3H", entry[28:34])
            name = stream.read(name_length).decode("utf-8")
            if name in checksums:
                stream.seek(position + 16)
                stream.write(struct.pack("<L", checksums[name]))
            position += 46 + name_length + extra_length + comment_length
        stream.flush()
        os.fsync(stream.fileno())


T = TypeVar("T")


def share_by_size(
    items: Iterable[T], size: Callable[[T], int], name: Callable[[T], str], rank: int, world: int
) -> list[T]:
    """The items ``rank`` checks: the largest first, each to the rank with the fewest bytes so far (the same split on
    every rank, computed from sizes and names alone)."""
    load = [0] * world
    mine = []
    for item in sorted(items, key=lambda i: (-size(i), name(i))):
        owner = min(range(world), key=lambda q: (load[q], q))
        load[owner] += size(item)
        if owner == rank:
            mine.append(item)
    return mine


def share_records(all_records: list[Record], rank: int, world_size: int) -> list[Record]:
    """The records of an archive that ``rank`` checks (see ``share_by_size``)."""
    return share_by_size(all_records, lambda r: r.stored_size, lambda r: r.name, rank, world_size)


def range_checksum(stream: IO[bytes], start: int, length: int) -> int | None:
    """The CRC-32 of ``length`` bytes of ``stream`` from ``start``; ``None`` if the file ends first."""
    crc, remaining = 0, length
    stream.seek(start)
    while remaining:
        chunk = stream.read(min(_READ_CHUNK, remaining))
        if not chunk:
            return None
        crc = zlib.crc32(chunk, crc)
        remaining -= len(chunk)
    return crc


class StoredEntry(NamedTuple):
    """One piece of a sharded checkpoint: ``length`` bytes at ``offset`` of ``file``, holding part of ``fqn``."""

    fqn: str
    file: str
    offset: int
    length: int

    @property
    def key(self) -> str:
        return f"{self.file}@{self.offset}"


def entry_checksums(directory: Path, entries: Iterable[StoredEntry]) -> dict[str, int]:
    """The CRC-32 of each entry's bytes in ``directory`` (see [Note: shard checksums]), by ``StoredEntry.key``."""
    found: dict[str, int] = {}
    by_file: dict[str, list[StoredEntry]] = {}
    for entry in entries:
        by_file.setdefault(entry.file, []).append(entry)
    for file, listed in by_file.items():
        with open(directory / file, "rb") as stream:
            for entry in sorted(listed, key=lambda e: e.offset):
                crc = range_checksum(stream, entry.offset, entry.length)
                if crc is None:
                    raise OSError(f"{str(directory / file)!r} ends before its entry for {entry.fqn!r}")
                found[entry.key] = crc
    return found


def unchecked_tensor_records(all_records: list[Record]) -> bool:
    """Whether every non-empty tensor record has a zero checksum: an archive of the parallel writer from before
    it stored checksums (see [Note: record checksums])."""
    tensors = [r for r in tensor_records(all_records) if r.stored_size]
    return bool(tensors) and all(r.crc == 0 for r in tensors)


def bad_records(archive: zipfile.ZipFile, stream: IO[bytes], checked: list[Record]) -> list[str]:
    """The names of the ``checked`` records whose bytes do not match their checksum."""
    bad = []
    for record in checked:
        if record.compressed:
            try:
                with archive.open(record.info) as member:  # decompresses, and compares the CRC at the end
                    while member.read(_READ_CHUNK):
                        pass
            except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError):
                bad.append(record.name)
            continue
        if range_checksum(stream, record.data_start, record.stored_size) != record.crc:
            bad.append(record.name)
    return bad
