"""Checkpoint files on disk: written so that a crash at any moment leaves a complete checkpoint under
its name, removed so that a half-deleted one is never found under its name.

[Note: crash-safe saves]
A checkpoint is committed by one rename, and everything else a save writes lies under a hidden name
(``.NAME.tmp-<token>``) that Lightning's ``ckpt_path="last"`` search (``last*.ckpt``), ``"best"`` and
``ModelCheckpoint``'s top-k bookkeeping never match, because it starts with a dot:

- A new file, or a new directory, is written under the hidden name, flushed, then renamed to
  ``NAME``; ``os.replace`` of a file is atomic on POSIX, and so is renaming a directory onto a name
  that does not exist.
- A sharded checkpoint that replaces one of the same name is committed *inside* the existing
  directory (see [Note: sharded layout] in ``engine/checkpoint/sharded.py``): its shards go into a new
  ``shards-<token>`` subdirectory and the save is committed by replacing the ``meta.pt`` file that
  names it, so ``NAME`` exists and is complete at every moment, on any POSIX file system.
- What cannot be committed either way (a file replaced by a directory or the other way round, a
  symlink) is swapped with ``renameat2(RENAME_EXCHANGE)`` where the kernel and file system offer it
  (Linux on ext4, xfs, btrfs, tmpfs), and otherwise with two renames (old aside to ``.NAME.old-*``,
  new in place): only there, and only between those two renames, is ``NAME`` missing, and
  ``find_checkpoint`` then finds the old one aside.

Leftovers of interrupted saves (``.NAME.tmp-*``) and deletions (``.NAME.del-*``) are deleted by a
save of ``NAME`` once the new checkpoint is committed, never before: by the next one, under the rule
below. A ``.NAME.old-*`` left by a crash between two renames may be the newest complete checkpoint of
that run, so no save deletes it.

Two runs may save into one directory, even under one name (``last.ckpt`` of a sweep), so what looks like
a leftover may be another run's save in progress. A save's ``<token>`` (``new_token``) begins with the
id of the run that chose it (``RUN``: 12 hex digits, chosen when this module is imported, so shared by
the processes forked after that), and the process that creates a temporary file or directory (rank 0)
holds an exclusive ``flock`` on it (on the file's descriptor, or on one of the directory itself), taken
before any rank writes into it and released after the commit or the removal (``hold``). A cleanup
deletes a ``.NAME.tmp-*``, or a ``shards-*`` that ``meta.pt`` does not name, only when (``claimed``):

- a non-blocking ``flock(LOCK_EX | LOCK_NB)`` on it succeeds: no live save holds it (the kernel
  releases the locks of a killed process), and the cleanup holds it until the deletion, so that no
  save takes the name up meanwhile; and
- it is this run's, or it lies on a file system of this machine's own disks or memory (ext4, xfs,
  btrfs, zfs, f2fs, tmpfs, ramfs, overlayfs), where every process that can open it shares this kernel
  and so its locks, or nothing in it has been modified for ``STALE_AFTER`` (10 minutes): on a network
  file system, a writer on another machine may hold a lock this machine does not see (Lustre mounted
  with ``localflock``, NFS with ``local_lock``).

Otherwise it is left, silently, for a later save (on a network file system, the first one 10 minutes
after its writer stopped). Where the file system has no ``flock`` at all, saves write without the lock
and only the 10 minutes decide. A ``.NAME.del-*`` is deleted whatever holds it:
it is a checkpoint being deleted already, and two deletions of one tree only race to the same end.

[Note: complete commits]
Between a save's writes and its commit, anything may delete what it wrote: a user's ``rm -rf`` of the
checkpoint folder, another job's clean-up. A later write that recreated the missing directory (a
``makedirs``) would then commit a checkpoint that names pieces that are gone, and the run would report
success. So no write of the protocol after rank 0 made the directory the ranks write into creates a
directory (``atomic_torch_save(make_parents=False)`` for ``meta.pt``; DCP's writer makes its folder before
it writes a byte, so a deletion before then only moves the whole save into a recreated folder), and rank 0
checks, just before the commit, that every file the commit names is there at the size its writer recorded
(``check_complete``): otherwise the save fails on every rank, naming what is missing, and commits nothing.
A deletion in the instant between that check and the commit's rename is not caught, as one just after the
commit is not: only the kernel could tell, and what someone deletes is gone either way.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import signal
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ASIDE = ".old-"
TMP = ".tmp-"
DELETING = ".del-"
KILL_AT = "LIGHTNING_ZERO_KILL_AT"
RUN = uuid.uuid4().hex[:12]  # this process's run id: the start of every token it chooses
STALE_AFTER = 600.0  # seconds unmodified after which another run's unlocked leftover counts as dead
# statfs(2) f_type of the file systems of this machine's own disks or memory (linux/magic.h).
LOCAL_FILE_SYSTEMS = {
    0xEF53: "ext2/3/4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0x2FC12FC1: "zfs",
    0xF2F52010: "f2fs",
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0x794C7630: "overlayfs",
}
_NO_FLOCK = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL)


def crash_point(name: str, path: Path | None = None) -> None:
    """A named point of a save where the crash tests kill the process: with ``LIGHTNING_ZERO_KILL_AT=name``
    (or ``name@FILE`` to match only saves to a path named ``FILE``) the process SIGKILLs itself here.
    Unset, it does nothing. See the crash tests in ``tests/test_checkpoint_safety.py``."""
    wanted = os.environ.get(KILL_AT)
    if not wanted:
        return
    target = path.name if path is not None else ""
    if target.startswith(".") and TMP in target:  # the temporary file of a save to NAME
        target = target[1:].rsplit(TMP, 1)[0]
    if wanted in (name, f"{name}@{target}"):
        os.kill(os.getpid(), signal.SIGKILL)


def hidden_sibling(path: Path, kind: str, token: str) -> Path:
    """``.NAME<kind><token>`` beside ``path``: never matched by Lightning's checkpoint searches."""
    return path.parent / f".{path.name}{kind}{token}"


def temporary_path(path: Path, token: str) -> Path:
    """A hidden sibling of ``path`` for writing before the rename."""
    return hidden_sibling(path, TMP, token)


def new_token() -> str:
    """A save's identity: this run's id followed by random hex digits (alphanumeric, so a valid save id)."""
    return RUN + uuid.uuid4().hex[:20]


def written_by_this_run(path: Path) -> bool:
    """Whether ``path`` (``.NAME.tmp-<token>``, ``shards-<token>``) is named by a token this run chose."""
    return path.name.rsplit("-", 1)[-1].startswith(RUN)


def hold(path: Path, directory: bool = False) -> int:
    """Create ``path`` (an empty file, or a directory) and hold an exclusive ``flock`` on it, which tells every
    cleanup that a live save writes it (see [Note: crash-safe saves]); returns the descriptor to ``release``.

    Usage::

        lock = hold(tmp)
        try:
            ...  # write tmp, commit it
        finally:
            release(lock)
    """
    for _ in range(8):
        if directory:
            path.mkdir()
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            _lock(fd, wait=True)
            if _same_file(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            remove(path)
            raise
        os.close(fd)  # another run's cleanup locked it between the creation and the lock, and deleted it
    raise FileExistsError(errno.EEXIST, "another run keeps deleting this save's temporary file", str(path))


def release(lock: int | None) -> None:
    """Release what ``hold`` took (nothing for ``None``)."""
    if lock is not None:
        os.close(lock)


@contextmanager
def claimed(leftover: Path) -> Iterator[bool]:
    """Whether ``leftover`` (a hidden temporary file or directory, a ``shards-*``) was left by a save that is over,
    so that it may be deleted (the rule of [Note: crash-safe saves]); its lock is held until the block ends, so
    that no save takes it up meanwhile."""
    try:
        fd = os.open(leftover, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # gone, a link, or not this process's to open
        fd = None
    if fd is None:
        yield False
        return
    try:
        locked = _lock(fd, wait=False)
        if locked is False or not _same_file(fd, leftover):
            yield False
            return
        trusted = locked and (written_by_this_run(leftover) or on_local_file_system(leftover.parent))
        yield trusted or time.time() - _last_modified(leftover) > STALE_AFTER
    finally:
        os.close(fd)


def _lock(fd: int, wait: bool) -> bool | None:
    """Take an exclusive ``flock`` on ``fd``: ``True``; ``False`` where another holds it (only without ``wait``);
    ``None`` where the file system has no ``flock``."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in _NO_FLOCK:
            return None
        raise
    return True


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file ``fd`` is open on (a cleanup may have deleted it meanwhile)."""
    try:
        named = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)


def _last_modified(path: Path) -> float:
    """The newest modification time of ``path`` and, for a directory, of everything inside it."""
    try:
        newest = path.lstat().st_mtime
        if path.is_dir() and not path.is_symlink():
            for entry in path.rglob("*"):
                newest = max(newest, entry.lstat().st_mtime)
    except OSError:  # changing under us: in use
        return time.time()
    return newest


def on_local_file_system(directory: Path) -> bool:
    """Whether ``directory`` lies on a file system of this machine's own disks or memory (``statfs`` type in
    ``LOCAL_FILE_SYSTEMS``), where every ``flock`` on a file is seen by every process that can open it."""
    if not sys.platform.startswith("linux"):
        return False
    statfs = getattr(ctypes.CDLL(None, use_errno=True), "statfs", None)
    buffer = ctypes.create_string_buffer(512)  # struct statfs, f_type first (120 bytes on 64-bit Linux)
    if statfs is None or statfs(os.fsencode(directory), buffer) != 0:
        return False
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF in LOCAL_FILE_SYSTEMS


def file_identity(path: Path) -> tuple[int, int] | None:
    """``(device, inode)`` of ``path``, which tells one write of it from the next; ``None`` if it does not exist."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return None
    return found.st_dev, found.st_ino


def fsync_directory(directory: Path) -> None:
    """Make renames inside ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_torch_save(obj: Any, path: Path, make_parents: bool = True) -> tuple[int, int]:
    """``torch.save`` to ``path``, all or nothing; the temporary file is held while it is written (see ``hold``)
    and removed if anything fails. Returns the new file's ``file_identity``. ``make_parents=False``: the directory
    must exist already (a checkpoint's own, which must not be recreated empty: see [Note: complete commits])."""
    if make_parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(path, new_token())
    lock = hold(tmp)
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
            written = os.fstat(f.fileno())
        commit(tmp, path)
    except BaseException:
        remove(tmp)
        raise
    finally:
        release(lock)
    return written.st_dev, written.st_ino


def check_complete(written: dict[Path, int | None]) -> None:
    """Before a commit: every file or directory a save wrote (``written``, in order, a directory before what it
    holds) is still there, each file the size it was written with (``None``: any); the first that is not raises
    ``FileNotFoundError`` or ``OSError`` naming it (see [Note: complete commits])."""
    for path, size in written.items():
        try:
            found = os.lstat(path)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{str(path)!r} is missing: it was deleted or moved while the checkpoint was being saved (by another "
                "process, a clean-up job or a user), so the checkpoint would be incomplete"
            ) from None
        if size is not None and found.st_size != size:
            raise OSError(
                f"{str(path)!r} holds {found.st_size} bytes, but this save wrote {size}: it was changed while the "
                "checkpoint was being saved (by another process, a clean-up job or a user), so the checkpoint would "
                "be incomplete"
            )


def commit(new: Path, path: Path) -> None:
    """Put ``new`` (a file or directory beside ``path``) at ``path``, replacing what is there, such that
    ``path`` is complete at every moment where the file system allows it (see [Note: crash-safe saves])."""
    if not path.exists() and not path.is_symlink():
        os.rename(new, path)
    elif new.is_file() and (path.is_symlink() or not path.is_dir()):
        os.replace(new, path)  # a file over a file or a symlink: atomic
    elif exchange(new, path):
        remove(new)  # now the old checkpoint
    else:
        aside = hidden_sibling(path, ASIDE, new.name.rsplit(TMP, 1)[-1])
        os.replace(path, aside)
        crash_point("between-renames", path)
        os.replace(new, path)
        remove(aside)
    fsync_directory(path.parent)


def exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where unsupported."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def remove(path: Path) -> None:
    """Delete a file, symlink or directory tree (nothing if it does not exist)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint such that a crash never leaves a half-deleted one under its name: renamed to a
    hidden name first (one atomic rename), then deleted."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_symlink() or path.is_file():
        path.unlink()
        return
    doomed = hidden_sibling(path, DELETING, uuid.uuid4().hex)
    os.rename(path, doomed)
    remove(doomed)


def find_checkpoint(path: Path) -> Path:
    """``path``, or the previous checkpoint left aside by a save interrupted between two renames."""
    if path.exists():
        return path
    aside = sorted(path.parent.glob(f".{path.name}{ASIDE}*"), key=lambda p: p.stat().st_mtime)
    if aside:
        warnings.warn(
            f"{str(path)!r} does not exist, but a save to it was interrupted: loading the previous checkpoint "
            f"from {str(aside[-1])!r}",
            stacklevel=2,
        )
        return aside[-1]
    raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")


def remove_leftovers(path: Path) -> None:
    """Delete what interrupted saves and deletions of ``path`` left beside it, once ``path`` itself is
    complete: partial writes (``.tmp-*``) of saves that are over, never another run's live one (see
    [Note: crash-safe saves]), and half-deleted checkpoints (``.del-*``). A checkpoint set aside by a save
    killed between two renames (``.old-*``) may be the newest complete one of an earlier run, so it is
    kept, with a warning."""
    if not path.exists():
        return
    for leftover in path.parent.glob(f".{path.name}{TMP}*"):
        with claimed(leftover) as over:
            if over:
                remove(leftover)
    for leftover in path.parent.glob(f".{path.name}{DELETING}*"):
        remove(leftover)
    for aside in path.parent.glob(f".{path.name}{ASIDE}*"):
        warnings.warn(
            f"{str(aside)!r} is a complete checkpoint that a save to {str(path)!r} set aside before it was "
            "interrupted; it is kept. Resume from it with ckpt_path=..., or delete it when you no longer need it",
            stacklevel=2,
        )
