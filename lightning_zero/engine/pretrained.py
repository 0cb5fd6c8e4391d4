"""Pretrained weights into a model built on meta: each rank reads its shards from the files, unit by unit.

[Note: pretrained weights under meta init]
``lightning_zero.from_pretrained`` and ``lightning_zero.load_weights``, called while a model is built
on the meta device (``configure_model`` under stage 3, ``fabric.init_module()``), do not load
anything: they build the skeleton with initialization skipped (as ``from_pretrained`` itself does)
and record a ``WeightLoad`` in the recording's trace, which says, for every parameter and
persistent buffer of the skeleton, which tensor of which file holds its values. At setup the engine
builds the units as usual (the replay allocates one unit at a time), then ``load_weight_shards``
fills each rank's master shard of each unit from the files, reading only that shard's element
ranges (see [Note: reading weights by the slice] in ``weight_files.py``), refreshes the compute
copies (and, under stages 1 and 2, all-gathers the full parameters in place), and reads the buffers
whole. So a rank never holds more than its shards plus the unit being built, and reads from disk
about its share of the file; the values are the file's, cast to the parameter's dtype as
``from_pretrained`` casts them.

The checks run when the load is recorded, on every rank alike: every parameter must be found in the
files (under its own name, any name it is tied under, or with the model's ``base_model_prefix``
added or removed, as transformers maps them), with the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_zero.engine.init_trace import MetaInitError
from lightning_zero.engine.unit import ShardedUnit
from lightning_zero.engine.weight_files import WeightFiles


@dataclass
class WeightLoad:
    """Where the values of one module's parameters and buffers are (names relative to ``module``)."""

    module: nn.Module
    files: WeightFiles
    keys: dict[str, str]  # every name of a parameter (tied ones included) -> its tensor in ``files``
    buffers: dict[str, str] = field(default_factory=dict)  # a persistent buffer's name -> its tensor


def plan_weight_load(module: nn.Module, files: WeightFiles, prefix: str = "", source: str = "") -> WeightLoad:
    """Map ``module``'s parameters and persistent buffers to the tensors of ``files`` (see the note above), or raise
    naming what is missing or of the wrong shape. ``prefix``: the ``base_model_prefix`` a transformers model may
    be saved with or without."""

    def candidates(name: str) -> list[str]:
        names = [name]
        if prefix and name.startswith(prefix + "."):
            names.append(name[len(prefix) + 1 :])
        elif prefix:
            names.append(f"{prefix}.{name}")
        return names

    aliases: dict[int, list[str]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
        shapes[id(param)] = tuple(param.shape)
    keys: dict[str, str] = {}
    missing, wrong = [], []
    for ident, names in aliases.items():
        key = next((k for n in names for k in candidates(n) if k in files), None)
        if key is None:
            missing.append(names[0])
            continue
        if files.shape(key) != shapes[ident]:
            wrong.append(f"{names[0]} (the file's {key!r} has shape {files.shape(key)}, the model's {shapes[ident]})")
            continue
        for name in names:
            keys[name] = key
    buffers: dict[str, str] = {}
    for mod_name, mod in module.named_modules():
        for name, buf in mod._buffers.items():
            if buf is None or name in mod._non_persistent_buffers_set:
                continue
            full = f"{mod_name}.{name}" if mod_name else name
            key = next((k for k in candidates(full) if k in files), None)
            if key is not None:
                buffers[full] = key
    where = f" of {source}" if source else ""
    if wrong:
        raise MetaInitError(f"{len(wrong)} parameter(s) do not match the weights{where}: {'; '.join(wrong[:4])}")
    if missing:
        raise MetaInitError(
            f"{len(missing)} parameter(s) are not in the weights{where}: {', '.join(missing[:8])}. Loading a model "
            "sharded from its files needs every parameter there; build new layers (a new head) next to the loaded "
            "model in configure_model instead of inside it, where they are initialized as usual."
        )
    return WeightLoad(module, files, keys, buffers)


def load_weight_shards(root: nn.Module, units: list[ShardedUnit], loads: list[WeightLoad]) -> None:
    """Fill every unit's master shard (this rank's) from the files of ``loads`` (see the note above). A collective
    under stages 1 and 2 (the full parameters are gathered again); the same order of reads on every rank."""
    names = {id(mod): name for name, mod in root.named_modules()}
    by_name: dict[str, tuple[WeightFiles, str]] = {}
    buffers: list[tuple[nn.Module, str, WeightFiles, str]] = []
    for load in loads:
        if id(load.module) not in names:
            raise MetaInitError(
                f"the {type(load.module).__name__} loaded from pretrained weights in configure_model is not part of "
                "the model being set up: assign it to an attribute of the LightningModule (self.model = ...)"
            )
        base = names[id(load.module)]
        prefix = f"{base}." if base else ""
        for name, key in load.keys.items():
            by_name[prefix + name] = (load.files, key)
        modules = dict(load.module.named_modules())
        for name, key in load.buffers.items():
            mod_name, _, buf_name = name.rpartition(".")
            buffers.append((modules[mod_name], buf_name, load.files, key))
    with torch.no_grad():
        for unit in units:
            if not any(name in by_name for name in unit.param_names):
                continue
            unit.wait_host_reads()
            for name, piece in zip(unit.param_names, unit.param_shards):
                source = by_name.get(name)
                if source is None or not piece.numel:
                    continue
                files, key = source
                values = files.read(key, piece.param_offset, piece.param_offset + piece.numel)
                unit.master[piece.shard_offset : piece.shard_offset + piece.numel].copy_(values)
            unit.after_master_loaded()
        for mod, name, files, key in buffers:
            mod._buffers[name].copy_(files.read_whole(key))
    for load in loads:
        load.files.close()
