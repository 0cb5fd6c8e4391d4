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
added or removed, as transformers maps them), with the same shape, in a dtype torch can hold, and a
floating-point one for a floating-point parameter or buffer: an integer or boolean tensor cast into a
float weight would train on numbers that were never weights (transformers refuses it too). Tensors of
the files that nothing loads are not looked at beyond their header. A load refers to the parameter
and buffer *objects* (the meta tensors), not to their names, because code after the load may move
them in the module tree: peft's ``get_peft_model`` puts a LoRA layer's original weight under
``...q_proj.base_layer.weight``. Their names are resolved when setup begins (``resolve_weight_loads``,
before the replay gives the module its real tensors), and a loaded tensor that is no longer part of
the model is an error, never a silent skip.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_zero.engine.core.unit import ShardedUnit
from lightning_zero.engine.errors import MetaInitError
from lightning_zero.engine.hf.weight_files import WeightFiles


@dataclass
class WeightLoad:
    """Where the values of some meta parameters and buffers are: tensor objects (kept alive) -> names in ``files``."""

    files: WeightFiles
    params: dict[int, tuple[torch.Tensor, str]]  # id(parameter) -> (the parameter, its tensor in ``files``)
    buffers: dict[int, tuple[torch.Tensor, str]] = field(default_factory=dict)
    source: str = ""


@dataclass
class ResolvedLoads:
    """The loads of a model being set up, by the names its units know (``resolve_weight_loads``)."""

    params: dict[str, tuple[WeightFiles, str]]  # a qualified parameter name (every alias) -> where its values are
    buffers: list[tuple[nn.Module, str, WeightFiles, str]]  # (module, buffer name, files, tensor)
    files: list[WeightFiles]


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
    tensors: dict[int, torch.Tensor] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
        tensors[id(param)] = param
    params: dict[int, tuple[torch.Tensor, str]] = {}
    missing, wrong = [], []
    for ident, names in aliases.items():
        key = next((k for n in names for k in candidates(n) if k in files), None)
        shape = tuple(tensors[ident].shape)
        if key is None:
            missing.append(names[0])
        elif files.shape(key) != shape:
            wrong.append(f"{names[0]} (the file's {key!r} has shape {files.shape(key)}, the model's {shape})")
        elif (problem := _dtype_problem(files, key, tensors[ident].dtype)) is not None:
            wrong.append(f"{names[0]} ({problem})")
        else:
            params[ident] = (tensors[ident], key)
    buffers: dict[int, tuple[torch.Tensor, str]] = {}
    for mod_name, mod in module.named_modules():
        for name, buf in mod._buffers.items():
            if buf is None or name in mod._non_persistent_buffers_set:
                continue
            full = f"{mod_name}.{name}" if mod_name else name
            key = next((k for k in candidates(full) if k in files), None)
            if key is None:
                continue
            if (problem := _dtype_problem(files, key, buf.dtype)) is not None:
                wrong.append(f"buffer {full} ({problem})")
            else:
                buffers[id(buf)] = (buf, key)
    where = f" of {source}" if source else ""
    if wrong:
        raise MetaInitError(
            f"{len(wrong)} tensor(s) of the model do not match the weights{where}: {'; '.join(wrong[:4])}"
        )
    if missing:
        raise MetaInitError(
            f"{len(missing)} parameter(s) are not in the weights{where}: {', '.join(missing[:8])}. Loading a model "
            "sharded from its files needs every parameter there; build new layers (a new head) next to the loaded "
            "model in configure_model instead of inside it, where they are initialized as usual."
        )
    return WeightLoad(files, params, buffers, source)


def _dtype_problem(files: WeightFiles, key: str, target: torch.dtype) -> str | None:
    """Why tensor ``key`` of ``files`` cannot fill a tensor of dtype ``target``, or ``None``: its dtype must be one
    torch has, and an integer, boolean or complex one only fills a tensor that is not floating-point (as in
    transformers, which casts only floating-point weights)."""
    stored = files.dtype(key)
    name = files.dtype_name(key)
    if stored is None:
        return f"the file's {key!r} is stored as {name}, which torch {torch.__version__} has no dtype for"
    if target.is_floating_point and not stored.is_floating_point:
        return (
            f"the file's {key!r} is {name} ({stored}), the model's is {target}: an integer, boolean or complex "
            "tensor is not cast into a floating-point one; these files do not hold this model's weights, or the "
            "tensor was saved in the wrong dtype"
        )
    return None


def resolve_weight_loads(root: nn.Module, loads: list[WeightLoad]) -> ResolvedLoads:
    """The names, in ``root`` as it is now, of every tensor ``loads`` fill (call before the replay replaces the meta
    tensors); raise if one is no longer part of ``root``."""
    names: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    owners: dict[int, tuple[nn.Module, str]] = {}
    for mod in root.modules():
        for name, buf in mod._buffers.items():
            if buf is not None:
                owners.setdefault(id(buf), (mod, name))
    params: dict[str, tuple[WeightFiles, str]] = {}
    buffers: list[tuple[nn.Module, str, WeightFiles, str]] = []
    for load in loads:
        lost = [key for ident, (_, key) in load.params.items() if ident not in names]
        lost += [key for ident, (_, key) in load.buffers.items() if ident not in owners]
        if lost:
            raise MetaInitError(
                f"{len(lost)} tensor(s) loaded from {load.source or 'weight files'} in configure_model are no longer "
                f"part of the model being set up (e.g. the one for {lost[0]!r}): they were replaced after the load. "
                "Assign the loaded model to an attribute of the LightningModule (self.model = ...), and replace its "
                "layers before loading, not after."
            )
        for ident, (_, key) in load.params.items():
            for name in names[ident]:
                params[name] = (load.files, key)
        for ident, (_, key) in load.buffers.items():
            mod, name = owners[ident]
            buffers.append((mod, name, load.files, key))
    return ResolvedLoads(params, buffers, [load.files for load in loads])


def load_weight_shards(units: list[ShardedUnit], loads: ResolvedLoads) -> None:
    """Fill every unit's master shard (this rank's) from the files of ``loads`` (see the note above). A collective
    under stages 1 and 2 (the full parameters are gathered again); the same order of reads on every rank."""
    by_name = loads.params
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
        for mod, name, files, key in loads.buffers:
            mod._buffers[name].copy_(files.read_whole(key))
    for files in loads.files:
        files.close()
