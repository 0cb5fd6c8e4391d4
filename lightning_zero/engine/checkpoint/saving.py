"""Saving a checkpoint on every rank: the order of writes, the one commit, and what a failure leaves.

[Note: save protocol]
A save is a sequence of phases, each ending in a collective where the ranks learn whether any of
them failed; so a failure on one rank (a full disk, a write error) makes every rank raise the same
``CheckpointSaveError`` at the same point, instead of leaving the others waiting, and the rank that
created the temporary files deletes them: a failed save leaves nothing behind and the previous
checkpoint untouched. Only rank 0 commits, after every rank's data is durable (``fsync``) and once it
has checked that every file the commit names is still there at the size its writer recorded (see
[Note: complete commits] in ``engine/io/files.py``): a checkpoint deleted during its save fails the save
on every rank.

- ``"full"``: rank 0 writes the file's skeleton under a hidden temporary name and broadcasts where
  each piece goes; every rank writes its pieces; rank 0 checks that the pieces cover every tensor,
  then renames the file into place (see [Note: parallel full file] in ``engine/io/torch_file.py``).
- ``"sharded"``: every rank writes its DCP file into ``shards-<token>`` (inside the existing
  checkpoint, or inside a hidden temporary directory for a new one); rank 0 writes ``meta.pt``, which
  commits (see [Note: sharded layout] in ``engine/checkpoint/sharded.py``), and deletes the previous shards.

Rank 0 creates the temporary file, or the directory the ranks write into, and holds its ``flock``
until the commit or the removal (``hold`` in ``engine/io/files.py``), before any rank writes into it; its
clean-up after the commit deletes only what saves that are over left (see [Note: crash-safe saves]), and
nothing more once another run has committed a newer ``meta.pt`` over this save's: that run cleans up.

Both front doors save through this module: the Trainer's ``save_checkpoint`` and Fabric's ``fabric.save`` (via
``driver/checkpointing.py``), so both get the same crash safety and the same failure reports. What the callers
pass is a ``Ranks``: this rank, the world size, and a broadcast from rank 0 (agreed first, so a rank that is
elsewhere is named instead of left waiting).

``crash_point`` marks the moments the crash tests kill a save at: ``start``, ``partial`` (some data
written), ``before-commit``, ``after-commit`` (before the previous data is deleted), ``end``.
"""

from __future__ import annotations

import errno
import itertools
import math
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from lightning_zero.engine.checkpoint.sharded import (
    CHECKSUMS_KEY,
    META_FILE,
    SHARDS_PREFIX,
    WrittenShards,
    gather_to_zero,
    gather_written,
    save_sharded,
)
from lightning_zero.engine.errors import CheckpointSaveError
from lightning_zero.engine.io.checksums import PieceChecksum, join_checksums, write_checksums
from lightning_zero.engine.io.files import (
    atomic_torch_save,
    check_complete,
    claimed,
    commit,
    crash_point,
    file_identity,
    hold,
    new_token,
    release,
    remove,
    remove_leftovers,
    temporary_path,
)
from lightning_zero.engine.io.ranks import Ranks, gather_from_every_rank
from lightning_zero.engine.io.torch_file import FlatPiece, Skeleton, pieces_in, write_pieces, write_skeleton

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


Report = dict[int, tuple[str, bool]]  # failing rank -> (what went wrong, whether it is a full disk)


def _describe(error: BaseException | None, rank: int) -> Report:
    """What failed where; DCP's ``CheckpointException`` already names every failing rank."""
    if error is None:
        return {}
    if isinstance(error, CheckpointException):
        return {r: _describe(failure, r)[r] for r, (failure, _) in error.failures.items()}
    no_space = isinstance(error, OSError) and error.errno in _NO_SPACE
    return {rank: (f"{type(error).__name__}: {error}", no_space)}


def _raise_if_failed(path: Path, reports: list[Report], needed: int) -> None:
    failed: Report = {}
    for report in reports:
        failed.update(report)
    if not failed:
        return
    lines = "; ".join(f"rank {rank}: {message}" for rank, (message, _) in sorted(failed.items()))
    text = (
        f"saving the checkpoint {str(path)!r} failed on rank(s) {sorted(failed)} ({lines}). The partial save "
        f"was removed; the previous checkpoint of that name, if any, is unchanged."
    )
    if any(no_space for _, no_space in failed.values()):
        text += (
            f" A save needs free space for the whole new checkpoint (about {_size(needed)} here) while "
            "the previous one stays on disk until the new one is complete: free space, or save elsewhere."
        )
    raise CheckpointSaveError(text)


def _size(count: float) -> str:
    if count < 1024:
        return f"{count:.0f} bytes"
    for unit in ("KiB", "MiB"):
        count /= 1024
        if count < 1024:
            return f"{count:.1f} {unit}"
    return f"{count / 1024:.1f} GiB"


def needed_bytes(checkpoint: Any, path: Path) -> int:
    """About how many bytes ``checkpoint`` takes on disk: its tensors counted whole, or what the checkpoint it
    replaces takes, whichever is more."""
    on_disk = 0
    if path.is_file():
        on_disk = path.stat().st_size
    elif path.is_dir():
        on_disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    total, seen, stack = 0, set(), [checkpoint]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, FlatPiece):
            total += math.prod(item.shape) * item.local.element_size()
        elif isinstance(item, torch.Tensor):  # a DTensor piece counts as its whole tensor
            total += item.numel() * item.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return max(total, on_disk)


def save_full(ranks: Ranks, checkpoint: dict[str, Any], path: Path) -> None:
    """Write ``checkpoint`` (with ``FlatPiece``s) as one ordinary file at ``path``, all ranks in parallel."""
    rank0 = ranks.is_zero
    token, needed = ranks.broadcast((new_token(), needed_bytes(checkpoint, path) if rank0 else 0))
    tmp = temporary_path(path, token)
    pieces = list(pieces_in(checkpoint))
    crash_point("start", path)
    skeleton: Skeleton | None = None
    size = 0
    error: BaseException | None = None
    lock: int | None = None
    if rank0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = hold(tmp)  # the others write into it only once they have the offsets
            skeleton = write_skeleton(checkpoint, tmp)
            size = tmp.stat().st_size  # the pieces fill the holes the skeleton left: the size stays
        except (Exception, CheckpointException) as err:
            error = err
    offsets, report = ranks.broadcast((skeleton and skeleton.offsets, _describe(error, ranks.rank)))
    try:
        _raise_if_failed(path, [report], needed)
        checksums: list[PieceChecksum] = []
        try:
            checksums = write_pieces(tmp, pieces, offsets)
        except (Exception, CheckpointException) as err:
            error = err
        _raise_if_failed(path, gather_from_every_rank(ranks, _describe(error, ranks.rank)), needed)
        every_rank = gather_to_zero(checksums, ranks.group)
        if rank0:
            assert skeleton is not None
            try:
                records = join_checksums(
                    itertools.chain.from_iterable(every_rank), skeleton.record_names, skeleton.record_sizes
                )
                write_checksums(tmp, {**skeleton.checksums, **records})
                crash_point("before-commit", path)
                check_complete({tmp: size})  # see [Note: complete commits] in engine/io/files.py
                commit(tmp, path)
                crash_point("after-commit", path)
            except (Exception, CheckpointException) as err:
                error = err
        _raise_if_failed(path, [ranks.broadcast(_describe(error, ranks.rank))], needed)
    except BaseException:
        if rank0:
            remove(tmp)
        raise
    finally:
        release(lock)
    if rank0:
        _tidy(lambda: remove_leftovers(path))
    crash_point("end", path)


def _tidy(cleanup: Any) -> None:
    """Delete what the committed save replaced; a failure here loses nothing, so it only warns."""
    try:
        cleanup()
    except OSError as err:
        warnings.warn(f"the checkpoint was saved, but deleting the data it replaced failed: {err}", stacklevel=3)


def _commits_in_place(path: Path) -> bool:
    """Whether ``path`` is a sharded checkpoint (format 2) that a new save can be committed inside."""
    if path.is_symlink() or not path.is_dir() or not (path / META_FILE).is_file():
        return False
    return any(child.name.startswith(SHARDS_PREFIX) for child in path.iterdir())


def save_sharded_directory(
    ranks: Ranks, shards: dict[str, Any], meta: dict[str, Any], zero_meta: dict[str, Any], path: Path
) -> None:
    """Write a sharded directory at ``path``: ``shards`` (DTensor pieces, or whole tensors after a run) by every rank
    into its DCP file, ``meta`` (the entries that are not shards) with ``zero_meta`` as its ``lightning_zero``
    section by rank 0 into ``meta.pt``, the commit."""
    rank0 = ranks.is_zero
    lock: int | None = None
    plan = None
    if rank0:  # the directory the ranks write into exists, held, before they learn its name
        token, in_place = new_token(), _commits_in_place(path)
        root, directory = _directories(path, token, in_place)
        lock, made = _hold_directory(directory if in_place else root, ranks.rank)
        plan = (token, in_place, needed_bytes([shards, meta], path), made)
    token, in_place, needed, made = ranks.broadcast(plan)
    root, directory = _directories(path, token, in_place)
    crash_point("start", path)
    committed = False
    ours: tuple[int, int] | None = None  # the meta.pt this save commits
    error: BaseException | None = None
    try:
        _raise_if_failed(path, [made], needed)
        mine = WrittenShards({}, {})
        try:
            mine = save_sharded(shards, directory, token, ranks.rank, ranks.group)
            crash_point("partial", path)
        except (Exception, CheckpointException) as err:
            error = err
        _raise_if_failed(path, gather_from_every_rank(ranks, _describe(error, ranks.rank)), needed)
        written = gather_written(mine, ranks.group)
        if rank0:
            try:
                # What the commit names, in order: see [Note: complete commits] in engine/io/files.py.
                pieces: dict[Path, int | None] = {root: None, directory: None}
                pieces.update((directory / file, size) for file, size in sorted(written.sizes.items()))
                checksums = written.checksums
                record = {**meta, "lightning_zero": {**zero_meta, "save_id": token, CHECKSUMS_KEY: checksums}}
                if not in_place:
                    check_complete(pieces)
                    ours = atomic_torch_save(record, root / META_FILE, make_parents=False)
                    pieces[root / META_FILE] = None
                crash_point("before-commit", path)
                check_complete(pieces)
                if in_place:
                    ours = atomic_torch_save(record, root / META_FILE, make_parents=False)  # replacing it commits
                else:
                    commit(root, path)
                committed = True
                crash_point("after-commit", path)
            except (Exception, CheckpointException) as err:
                error = err
        _raise_if_failed(path, [ranks.broadcast(_describe(error, ranks.rank))], needed)
    except BaseException:
        if rank0 and not committed:
            remove(directory if in_place else root)
        raise
    finally:
        release(lock)
    if rank0:
        _tidy(lambda: _remove_replaced_shards(path, directory.name, ours))
    crash_point("end", path)


def _directories(path: Path, token: str, in_place: bool) -> tuple[Path, Path]:
    """Where a sharded save with ``token`` writes: the directory that becomes ``path``, and the shards in it."""
    root = path if in_place else temporary_path(path, token)
    return root, root / f"{SHARDS_PREFIX}{token}"


def _hold_directory(directory: Path, rank: int) -> tuple[int | None, Report]:
    """Rank 0 creates and holds ``directory`` (``hold``): the lock, or what failed."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        return hold(directory, directory=True), {}
    except OSError as err:
        return None, _describe(err, rank)


def _remove_replaced_shards(path: Path, current: str, ours: tuple[int, int] | None) -> None:
    """Delete the shards this save's commit replaced and those of saves that are over, never a live save's; and
    none once another run has committed over ``ours``, the ``meta.pt`` this save wrote: that run's clean-up
    knows which shards its ``meta.pt`` names."""
    with open(path / META_FILE, "rb"):  # while open, no newer meta.pt can be given its inode number
        for child in path.iterdir():
            if child.name.startswith(SHARDS_PREFIX) and child.name != current:
                # Checked while holding the child: a live save releases its shards only after its commit.
                with claimed(child) as over:
                    if over and file_identity(path / META_FILE) == ours:
                        remove(child)
    remove_leftovers(path / META_FILE)
    remove_leftovers(path)
