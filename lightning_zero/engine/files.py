"""Writing checkpoint files so that an interrupted save never destroys the previous checkpoint.

A file is written under a temporary name in the same directory, flushed to disk, then renamed
over the target (``os.replace`` is atomic on POSIX). A directory (a sharded checkpoint) is
written under a temporary name too; replacing an existing one takes two renames (the old one
aside, the new one in place) and the old one is deleted only after the new one is in place, so
at every moment either the old or the new checkpoint is complete on disk. If a crash falls
between the two renames, ``find_checkpoint`` finds the old one under its aside name.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

ASIDE = ".old-"
TMP = ".tmp-"


def temporary_path(path: Path, token: str) -> Path:
    """A hidden sibling of ``path`` for writing before the rename."""
    return path.parent / f".{path.name}{TMP}{token}"


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path``, all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(path, str(os.getpid()))
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    if path.is_dir():  # a sharded checkpoint of the same name is replaced by a full one
        replace_directory(tmp, path)
        return
    os.replace(tmp, path)


def replace_directory(new: Path, path: Path) -> None:
    """Put ``new`` (a directory or file) at ``path``, replacing what is there without a moment where
    neither exists."""
    if not path.exists():
        os.replace(new, path)
        return
    aside = path.parent / f".{path.name}{ASIDE}{new.name.rsplit(TMP, 1)[-1]}"
    os.replace(path, aside)
    os.replace(new, path)
    remove(aside)
    remove_leftovers(path)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def find_checkpoint(path: Path) -> Path:
    """``path``, or the previous checkpoint left aside by a save that was interrupted mid-swap."""
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
    """Delete what interrupted saves to ``path`` left behind; only once ``path`` itself is complete."""
    if not path.exists():
        return
    for pattern in (f".{path.name}{TMP}*", f".{path.name}{ASIDE}*"):
        for leftover in path.parent.glob(pattern):
            remove(leftover)
