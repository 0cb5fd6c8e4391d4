"""A sharded model written as a Hugging Face checkpoint by every rank at once, never whole on any rank, in place
of the checkpoint the folder held.

[Note: writing a Hugging Face checkpoint]
``from_pretrained`` reads sharded safetensors: files that each hold whole tensors, listed by
``model.safetensors.index.json``. So the model's tensors are dealt to the ranks (largest first, each
to the rank with the fewest bytes so far: the same deal on every rank), and each rank writes one file
``model-0000r-of-0000N.safetensors`` with the tensors dealt to it. The units are gathered one at a
time, as a forward gathers them, and a rank keeps only the tensors it writes: it holds about ``1/N``
of the model besides one unit, and the ranks write in parallel. Rank 0 also writes the index, the
model's ``config.json`` and ``generation_config.json``, and the persistent buffers. A weight tied to
another (``lm_head.weight`` to the input embeddings) is stored once, under the name that is not in
the model's ``_tied_weights_keys``, as ``save_pretrained`` does, so that ``from_pretrained`` ties it
back. Every rank must call it (the gathers are collectives).

[Note: save_pretrained into a folder]
The files are written where no loader looks, then put in place of what the folder held, by one rank, after
every rank has written (``replace_checkpoint``): rank 0 creates the folder and a hidden staging folder in it
(``.save_pretrained.tmp-<token>``, held as the save protocol holds its temporary files: see [Note: crash-safe
saves] in ``engine/io/files.py``) before any rank writes, and nothing else; every rank writes its files into
the staging folder and ``fsync``s them; the ranks learn whether every rank succeeded (one gather). If one
failed, every rank raises the same ``CheckpointSaveError`` and rank 0 deletes the staging folder (and the
folder, if it made it and it is empty): the folder is as it was. Otherwise rank 0 checks that every file is
there at the size its writer wrote, then renames the files into the folder and removes the weight files of
the earlier checkpoint that the new one does not replace, in the order of [Note: replacing a Hugging Face
checkpoint] in ``engine/io/weight_folder.py``, so that a crash at any point leaves the folder read as the
earlier checkpoint or the new one; what rank 0 saw is broadcast, and a failure there is raised on every
rank, naming what ``from_pretrained`` reads at that point. Files that are not weights of those layouts (a
README, a tokenizer) are never touched.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from lightning_zero.engine.core.unit import ShardedUnit
from lightning_zero.engine.errors import CheckpointSaveError
from lightning_zero.engine.io.files import (
    TMP,
    check_complete,
    claimed,
    hidden_sibling,
    hold,
    new_token,
    release,
    remove,
)
from lightning_zero.engine.io.ranks import Ranks, gather_from_every_rank
from lightning_zero.engine.io.weight_folder import SAFETENSORS_INDEX, Step, read_by_loader, replacement_steps

STAGING = "save_pretrained"  # the staging folder is ``.save_pretrained.tmp-<token>`` inside the target


def write_hf_checkpoint(
    root: nn.Module, units: list[ShardedUnit], module: nn.Module, path: str | Path, ranks: Ranks
) -> None:
    """Write ``module`` (``root`` or a submodule of it, e.g. the transformers model a ``LightningModule`` holds) to
    the folder ``path``, in place of the checkpoint it holds (see the notes above). A collective."""
    check_part_of(root, module)
    names = stored_names(module)
    buffers = {
        name: buf.detach().to("cpu", copy=True).contiguous()
        for name, buf in module.state_dict(keep_vars=True).items()
        if not isinstance(buf, nn.Parameter) and isinstance(buf, torch.Tensor)
    }
    plan = WeightPlan(module, names, ranks.world_size)
    write_weights(
        units,
        plan,
        buffers,
        [getattr(module, "config", None), getattr(module, "generation_config", None)],
        Path(path),
        ranks,
    )


def stored_names(module: nn.Module, rename: Callable[[str], str | None] = lambda name: name) -> dict[int, str]:
    """``id(param)`` -> the name ``module``'s parameter is stored under: ``rename(name)`` of its name, ``None``
    leaving it out; a weight tied to another once, under the name not in ``_tied_weights_keys`` (see [Note:
    writing a Hugging Face checkpoint])."""
    tied = set(getattr(module, "_tied_weights_keys", None) or [])
    names: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        stored = rename(name)
        if stored is not None and (id(param) not in names or names[id(param)] in tied):
            names[id(param)] = stored
    return names


class WeightPlan:
    """Which parameters of ``module`` are written (``names``: ``id(param)`` -> the name stored) and which rank
    writes each (the deal of [Note: writing a Hugging Face checkpoint])."""

    def __init__(self, module: nn.Module, names: dict[int, str], world_size: int) -> None:
        self.params = [p for p in module.parameters() if id(p) in names]
        self.names = names
        self.entries = [(names[id(p)], p.numel() * p.element_size()) for p in self.params]
        self.owner = _deal(self.entries, world_size)
        self.files = [f"model-{r + 1:05d}-of-{world_size:05d}.safetensors" for r in range(world_size)]


def write_weights(
    units: list[ShardedUnit],
    plan: WeightPlan,
    buffers: dict[str, torch.Tensor],
    configs: list[Any],
    path: Path,
    ranks: Ranks,
    values: dict[str, torch.Tensor] | None = None,
) -> None:
    """Every rank writes the parameters ``plan`` deals to it, gathered one unit at a time (a parameter in no unit
    of ``units``, of a model that is not sharded, as it is), or the tensor ``values`` holds under its name; rank
    0 also ``buffers``, the index and the ``configs`` (``save_pretrained``-able, ``None`` skipped). A collective."""
    from safetensors.torch import save_file

    rank = ranks.rank
    mine: dict[str, torch.Tensor] = {}
    given = values or {}
    members = {id(p) for p in plan.params}
    in_units = {id(p) for unit in units for p in unit.params}
    for unit in units:
        if not any(id(p) in members for p in unit.params):
            continue
        views = unit.full_views(unit.full_flat("save_pretrained()"))
        for param, view in zip(unit.params, views):
            name = plan.names.get(id(param))
            if name is not None and plan.owner[name] == rank and name not in given:
                mine[name] = view.detach().to("cpu", copy=True).contiguous()
        del views
    for param in plan.params:
        name = plan.names[id(param)]
        if id(param) not in in_units and plan.owner[name] == rank and name not in given:
            mine[name] = param.detach().to("cpu", copy=True).contiguous()
    mine.update({name: value for name, value in given.items() if plan.owner[name] == rank})
    if rank == 0:
        mine.update(buffers)
    files = plan.files

    def write(staging: Path) -> list[str]:
        save_file(mine, str(staging / files[rank]), metadata={"format": "pt"})
        if rank != 0:
            return [files[rank]]
        weight_map = {name: files[r] for name, r in plan.owner.items()}
        weight_map.update({name: files[0] for name in buffers})
        total = sum(size for _, size in plan.entries) + sum(b.numel() * b.element_size() for b in buffers.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (staging / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        for config in configs:
            if config is not None and hasattr(config, "save_pretrained"):
                config.save_pretrained(staging)
        # Written by the other ranks, perhaps still being written: their files, and the hidden temporary file
        # safetensors (0.8) writes each one into before renaming it.
        others = set(files[1:])
        return sorted(c.name for c in staging.iterdir() if c.name not in others and not c.name.startswith("."))

    replace_checkpoint(ranks, path, write)


def save_with_transformers(module: nn.Module, path: str | Path, ranks: Ranks) -> None:
    """Rank 0's ``module.save_pretrained`` (transformers' own, for a module that is not sharded) written into the
    staging folder, then put in place of the checkpoint in ``path`` as the sharded save is (see [Note:
    save_pretrained into a folder]). A collective."""

    def write(staging: Path) -> list[str]:
        if not ranks.is_zero:
            return []
        module.save_pretrained(staging)
        return sorted(child.name for child in staging.iterdir() if child.is_file())

    replace_checkpoint(ranks, Path(path), write)


class FolderLayout(NamedTuple):
    """What a save puts in a folder: ``steps(folder, new)`` orders the renames and removals that put the staged
    files ``new`` in place; ``read(folder)`` names the file ``loader`` reads first there (or ``None``)."""

    steps: Callable[[Path, dict[str, Path]], list[Step]]
    read: Callable[[Path], str | None]
    loader: str


# A Hugging Face model's weights (see [Note: replacing a Hugging Face checkpoint]).
MODEL_FOLDER = FolderLayout(replacement_steps, read_by_loader, "from_pretrained")


def replace_checkpoint(
    ranks: Ranks, path: Path, write: Callable[[Path], list[str]], layout: FolderLayout = MODEL_FOLDER
) -> None:
    """Every rank's ``write(staging)`` (which returns the names of the files it wrote into the folder ``staging``,
    relative to it) put in place of the checkpoint of ``layout`` in the folder ``path`` (see [Note:
    save_pretrained into a folder]). A collective; every rank raises the same ``CheckpointSaveError`` if it fails
    anywhere.

    Usage::

        def write(staging: Path) -> list[str]:
            save_file(tensors, str(staging / "model.safetensors"))
            return ["model.safetensors"]

        replace_checkpoint(ranks, Path("finetuned"), write)
    """
    lock: int | None = None
    made, failure = False, None
    token = new_token()
    if ranks.is_zero:
        lock, made, failure = _make_staging(path, hidden_sibling(path / STAGING, TMP, token))
    token, failure = ranks.broadcast((token, failure))
    staging = hidden_sibling(path / STAGING, TMP, token)
    try:
        if failure is not None:
            raise CheckpointSaveError(_write_failed(path, {0: failure}))
        written: dict[str, int] = {}
        error = None
        try:
            for name in write(staging):
                written[name] = _fsync(staging / name)
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
        reports = gather_from_every_rank(ranks, (written, error))
        failed = {r: message for r, (_, message) in enumerate(reports) if message is not None}
        if failed:
            raise CheckpointSaveError(_write_failed(path, failed))
        outcome = None
        if ranks.is_zero:
            sizes = {name: size for files, _ in reports for name, size in files.items()}
            outcome = _commit(path, staging, sizes, layout)
        outcome = ranks.broadcast(outcome)
        if outcome is not None:
            raise CheckpointSaveError(outcome)
    except BaseException:
        if ranks.is_zero:
            remove(staging)  # what is not in place yet
            if made:
                _remove_if_empty(path)
        raise
    finally:
        release(lock)


def _make_staging(path: Path, staging: Path) -> tuple[int | None, bool, str | None]:
    """Rank 0 creates ``path`` (if needed) and holds the empty ``staging`` folder in it: the lock, whether it made
    ``path``, and what failed (before anything is written)."""
    if path.exists() and not path.is_dir():
        return None, False, f"{str(path)!r} is a file: save_pretrained writes a folder; pass the path of a folder"
    made = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        return hold(staging, directory=True), made, None
    except OSError as err:
        if made:
            _remove_if_empty(path)
        return None, False, f"{type(err).__name__}: {err}"


def _fsync(file: Path) -> int:
    """Make ``file`` durable; returns its size."""
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _commit(path: Path, staging: Path, sizes: dict[str, int], layout: FolderLayout) -> str | None:
    """Rank 0 puts the staged files in place (see [Note: replacing a Hugging Face checkpoint]); what failed."""
    new = {name: staging / name for name in sizes}
    steps: list[Step] = []
    done = 0
    try:
        check_complete({path: None, staging: None, **{new[name]: size for name, size in sizes.items()}})
        steps = layout.steps(path, new)
        for step in steps:
            step.apply()
            done += 1
    except Exception as err:  # reported on every rank, never raised on rank 0 alone (the others would wait)
        renamed = {str(step.target.relative_to(path)) for step in steps[:done] if step.source is not None}
        read = layout.read(path)
        if read is None:
            now = "finds no weights in it: save again"
        else:
            now = f"reads {read!r} " + ("(this save's)" if read in renamed else "(of the checkpoint that was there)")
        return (
            f"save_pretrained({str(path)!r}) failed on rank 0 while putting the new files in place "
            f"({type(err).__name__}: {err}); the files not yet in place were removed, and {layout.loader} now {now}"
        )
    remove(staging)
    for leftover in path.glob(f".{STAGING}{TMP}*"):  # of saves killed before their commit
        with claimed(leftover) as over:
            if over:
                remove(leftover)
    return None


def _write_failed(path: Path, failed: dict[int, str]) -> str:
    lines = "; ".join(f"rank {rank}: {message}" for rank, message in sorted(failed.items()))
    return (
        f"save_pretrained({str(path)!r}) failed on rank(s) {sorted(failed)} ({lines}). Nothing in the folder was "
        "changed: what this save had written was removed."
    )


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()
    except OSError:  # not empty, or gone
        pass


def check_part_of(root: nn.Module, module: nn.Module) -> None:
    if any(candidate is module for candidate in root.modules()):
        return
    raise ValueError(
        f"the {type(module).__name__} to save is not part of the sharded model: pass the module the strategy set up, "
        "or one of its submodules (e.g. self.model)"
    )


def _deal(entries: list[tuple[str, int]], world_size: int) -> dict[str, int]:
    """Each tensor to a rank, largest first to the rank with the fewest bytes so far (ties: the lowest rank)."""
    loads = [0] * world_size
    owner: dict[str, int] = {}
    for name, size in sorted(entries, key=lambda entry: (-entry[1], entry[0])):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owner[name] = rank
        loads[rank] += size
    return owner
