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
  directory (see [Note: sharded layout] in ``engine/checkpoint.py``): its shards go into a new
  ``shards-<token>`` subdirectory and the save is committed by replacing the ``meta.pt`` file that
  names it, so ``NAME`` exists and is complete at every moment, on any POSIX file system.
- What cannot be committed either way (a file replaced by a directory or the other way round, a
  symlink) is swapped with ``renameat2(RENAME_EXCHANGE)`` where the kernel and file system offer it
  (Linux on ext4, xfs, btrfs, tmpfs), and otherwise with two renames (old aside to ``.NAME.old-*``,
  new in place): only there, and only between those two renames, is ``NAME`` missing, and
  ``find_checkpoint`` then finds the old one aside.

Leftovers of interrupted saves (``.NAME.tmp-*``) and deletions (``.NAME.del-*``) are deleted by the
next save of ``NAME`` once the new checkpoint is committed, never before. A ``.NAME.old-*`` left by a
crash between two renames may be the newest complete checkpoint of that run, so no save deletes it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import signal
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

ASIDE = ".old-"
TMP = ".tmp-"
DELETING = ".del-"
KILL_AT = "LIGHTNING_ZERO_KILL_AT"


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


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path``, all or nothing; the temporary file is removed if anything fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(path, uuid.uuid4().hex)
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        commit(tmp, path)
    except BaseException:
        remove(tmp)
        raise


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
    complete: partial writes (``.tmp-*``) and half-deleted checkpoints (``.del-*``). A checkpoint set
    aside by a save killed between two renames (``.old-*``) may be the newest complete one of an earlier
    run, so it is kept, with a warning."""
    if not path.exists():
        return
    for pattern in (f".{path.name}{TMP}*", f".{path.name}{DELETING}*"):
        for leftover in path.parent.glob(pattern):
            remove(leftover)
    for aside in path.parent.glob(f".{path.name}{ASIDE}*"):
        warnings.warn(
            f"{str(aside)!r} is a complete checkpoint that a save to {str(path)!r} set aside before it was "
            "interrupted; it is kept. Resume from it with ckpt_path=..., or delete it when you no longer need it",
            stacklevel=2,
        )
