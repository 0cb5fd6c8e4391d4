"""A sharded model written as a Hugging Face checkpoint by every rank at once, never whole on any rank.

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
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from lightning_zero.engine.core.unit import ShardedUnit

INDEX_NAME = "model.safetensors.index.json"


def write_hf_checkpoint(
    root: nn.Module, units: list[ShardedUnit], module: nn.Module, path: str | Path, rank: int, world_size: int
) -> list[Path]:
    """Write ``module`` (``root`` or a submodule of it, e.g. the transformers model a ``LightningModule`` holds) to
    the directory ``path`` (see the note above); returns the files this rank wrote. A collective."""
    from safetensors.torch import save_file

    path = Path(path)
    _check_part_of(root, module)
    tied = set(getattr(module, "_tied_weights_keys", None) or [])
    names: dict[int, str] = {}  # id(param) -> the name it is stored under
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) not in names or names[id(param)] in tied:
            names[id(param)] = name
    entries = [(names[id(p)], p.numel() * p.element_size()) for p in module.parameters() if id(p) in names]
    owner = _deal(entries, world_size)
    files = [f"model-{r + 1:05d}-of-{world_size:05d}.safetensors" for r in range(world_size)]
    mine: dict[str, torch.Tensor] = {}
    members = {id(p) for p in module.parameters()}
    for unit in units:
        if not any(id(p) in members for p in unit.params):
            continue
        views = unit.full_views(unit.full_flat("save_pretrained()"))
        for param, view in zip(unit.params, views):
            name = names.get(id(param))
            if name is not None and owner[name] == rank:
                mine[name] = view.detach().to("cpu", copy=True).contiguous()
        del views
    buffers = {
        name: buf.detach().to("cpu", copy=True).contiguous()
        for name, buf in module.state_dict(keep_vars=True).items()
        if not isinstance(buf, nn.Parameter) and isinstance(buf, torch.Tensor)
    }
    if rank == 0:
        mine.update(buffers)
    path.mkdir(parents=True, exist_ok=True)
    target = path / files[rank]
    save_file(mine, str(target), metadata={"format": "pt"})
    written = [target]
    if rank == 0:
        weight_map = {name: files[r] for name, r in owner.items()}
        weight_map.update({name: files[0] for name in buffers})
        total = sum(size for _, size in entries) + sum(b.numel() * b.element_size() for b in buffers.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (path / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        written.append(path / INDEX_NAME)
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(path)
        generation = getattr(module, "generation_config", None)
        if generation is not None and hasattr(generation, "save_pretrained"):
            generation.save_pretrained(path)
    return written


def _check_part_of(root: nn.Module, module: nn.Module) -> None:
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
