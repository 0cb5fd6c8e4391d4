"""A peft ``PeftModel`` of a sharded model saved as peft and transformers load it: its adapter as peft's own
``save_pretrained`` writes it, or (``merged=True``) the model with the adapter merged in, as a plain transformers
checkpoint.

[Note: saving a peft model]
A ``PeftModel``'s parameters are named for peft's module tree (``base_model.model.<...>.q_proj.base_layer.weight``,
``<...>.q_proj.lora_A.default.weight``): written as a transformers checkpoint they load nowhere, so it is saved
the two ways peft users save it.

- The adapter (the default): ``adapter_model.safetensors`` and ``adapter_config.json`` (and peft's model card,
  ``README.md``), which ``PeftModel.from_pretrained(base, path)`` and ``AutoPeftModelForCausalLM`` load. peft
  writes them itself, on rank 0: its ``save_pretrained(path, state_dict=...)`` takes a full state dict and keeps
  the adapter's entries. Which entries those are is peft's choice (LoRA's matrices, biases, ``modules_to_save``,
  embeddings it decides to keep), so it is asked first with a state dict of meta tensors: the entries it returns
  are gathered (every rank takes part, rank 0 keeps them) and given to it again with their values. The adapter is
  small; where peft returns anything but entries of that state dict, the whole state dict is gathered for it.
  Non-default adapters go to subfolders, as peft puts them.
- Merged (``merged=True``, LoRA on ``Linear`` and ``Embedding`` layers): the files ``merge_and_unload()`` then
  ``save_pretrained`` would write, without changing the model: each adapted layer's units are gathered (every
  rank), the rank that writes its weight adds peft's own ``get_delta_weight`` of each active adapter to it, as
  peft's ``merge`` adds it; everything else is written as the sharded export writes any model (see [Note:
  writing a Hugging Face checkpoint] in ``export.py``), under the base model's names. Other adapters (DoRA
  and other variants, other tuners, ``modules_to_save``) are refused, saying how to merge them with peft.

The files are put in place as [Note: save_pretrained into a folder] describes. For an adapter, the earlier
``adapter_config.json`` of the same folder is removed first, then the weights and the new config are renamed in
(peft's order), then an earlier ``adapter_model.bin`` that the new save does not write: a crash leaves the earlier
adapter, the new one, or a folder that peft refuses (no ``adapter_config.json``), never the new weights under the
earlier config. Every other file is kept; an existing ``README.md`` is updated by peft, as its own save updates it.
"""

from __future__ import annotations

import shutil
import sys
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_zero.engine.core.unit import ShardedUnit
from lightning_zero.engine.errors import CheckpointSaveError
from lightning_zero.engine.hf.export import (
    FolderLayout,
    WeightPlan,
    check_part_of,
    replace_checkpoint,
    stored_names,
    write_weights,
)
from lightning_zero.engine.io.ranks import Ranks, gather_from_every_rank
from lightning_zero.engine.io.weight_folder import Step

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")  # peft's loader's order
HOW_TO_MERGE = (
    "save the adapter (strategy.save_pretrained(model, path)) and merge it with peft in one process: "
    "PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path).merge_and_unload()"
    ".save_pretrained(merged_path)"
)


def is_peft_model(module: nn.Module) -> bool:
    """Whether ``module`` is a peft ``PeftModel`` (never imports peft: a model of it has imported it)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def holds_adapter_layers(module: nn.Module) -> bool:
    """Whether ``module`` (not a ``PeftModel``) holds peft's adapter layers: the model inside a ``PeftModel``."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    return tuners is not None and any(isinstance(m, tuners.BaseTunerLayer) for m in module.modules())


def write_adapter(root: nn.Module, units: list[ShardedUnit], module: nn.Module, path: Path, ranks: Ranks) -> None:
    """The adapter of the ``PeftModel`` ``module`` (part of ``root``) written by peft into the folder ``path`` (see
    [Note: saving a peft model]); ``units``: the sharded model's (none when it is not sharded). A collective."""
    check_part_of(root, module)
    state = module.state_dict(keep_vars=True)  # reads no parameter data
    needed = _adapter_keys(module, state)
    keys_of: dict[int, list[str]] = {}
    for key in needed:
        keys_of.setdefault(id(state[key]), []).append(key)
    values: dict[str, Any] = {}
    for unit in units:
        if not any(id(p) in keys_of for p in unit.params):
            continue
        views = unit.full_views(unit.full_flat("save_pretrained()"))
        if ranks.is_zero:
            for param, view in zip(unit.params, views):
                value = view.detach().to("cpu", copy=True).contiguous()
                values.update(dict.fromkeys(keys_of.get(id(param), []), value))
        del views
    if ranks.is_zero:
        for key in needed:
            if key not in values:  # a buffer, or a parameter of a model that is not sharded
                entry = state[key]
                values[key] = entry.detach().to("cpu", copy=True) if isinstance(entry, torch.Tensor) else entry

    def write(staging: Path) -> list[str]:
        if not ranks.is_zero:
            return []
        if (path / "README.md").is_file():  # peft updates the model card it finds, as in its own save
            shutil.copyfile(path / "README.md", staging / "README.md")
        module.save_pretrained(str(staging), state_dict=values)
        return sorted(str(f.relative_to(staging)) for f in staging.rglob("*") if f.is_file())

    replace_checkpoint(ranks, path, write, ADAPTER_FOLDER)


def _adapter_keys(module: nn.Module, state: dict[str, Any]) -> list[str]:
    """The entries of ``state`` that peft's ``save_pretrained`` keeps for ``module``'s adapters (all of them where
    it builds anything else from them), in ``state``'s order."""
    from peft.utils import get_peft_model_state_dict

    placeholders = {
        key: torch.empty(value.shape, dtype=value.dtype, device="meta") if isinstance(value, torch.Tensor) else value
        for key, value in state.items()
    }
    key_of = {id(value): key for key, value in placeholders.items()}
    picked: set[str] = set()
    try:
        with warnings.catch_warnings():  # peft warns in its own call, which follows
            warnings.simplefilter("ignore")
            for adapter in module.peft_config:
                for value in get_peft_model_state_dict(module, state_dict=placeholders, adapter_name=adapter).values():
                    if id(value) not in key_of:
                        return list(state)  # a tensor peft derived: it gets every value
                    picked.add(key_of[id(value)])
    except Exception:  # peft could not work on meta tensors: it gets every value
        return list(state)
    return [key for key in state if key in picked]


def _adapter_steps(folder: Path, new: dict[str, Path]) -> list[Step]:
    """The renames and removals, in order, that put a staged adapter ``new`` (path relative to ``folder`` -> the
    staged file) in place (see [Note: saving a peft model])."""
    weights = sorted(name for name in new if Path(name).name in ADAPTER_WEIGHTS)
    configs = sorted(name for name in new if Path(name).name == ADAPTER_CONFIG)
    others = sorted(name for name in new if name not in weights and name not in configs)
    steps = [Step(None, folder / name) for name in configs if (folder / name).is_file()]
    steps += [Step(new[name], folder / name) for name in [*weights, *configs, *others]]
    for name in weights:
        for earlier in ADAPTER_WEIGHTS:
            stale = str(Path(name).with_name(earlier))
            if stale not in new and (folder / stale).is_file():
                steps.append(Step(None, folder / stale))
    return steps


def _adapter_read(folder: Path) -> str | None:
    """The weights file ``PeftModel.from_pretrained(base, folder)`` reads, or ``None`` where it refuses the folder."""
    if not (folder / ADAPTER_CONFIG).is_file():
        return None
    return next((name for name in ADAPTER_WEIGHTS if (folder / name).is_file()), None)


ADAPTER_FOLDER = FolderLayout(_adapter_steps, _adapter_read, "PeftModel.from_pretrained")


def check_mergeable(module: nn.Module) -> None:
    """Raise ``CheckpointSaveError`` (on every rank alike) where ``merged=True`` cannot merge ``module``'s adapters
    as peft's ``merge_and_unload`` would, saying how to merge them with peft."""
    from peft.tuners import lora
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    problem = None
    for name, config in module.peft_config.items():
        kind = str(getattr(config.peft_type, "value", config.peft_type))
        if kind != "LORA":
            problem = f"the adapter {name!r} is {kind}, not LoRA"
        elif getattr(config, "use_dora", False):
            problem = f"the adapter {name!r} uses DoRA"
    for where, layer in module.named_modules():
        if problem is not None:
            break
        if isinstance(layer, AuxiliaryTrainingWrapper):
            problem = f"{where} is a {type(layer).__name__} (modules_to_save or trainable tokens)"
        elif isinstance(layer, BaseTunerLayer):
            if type(layer) not in (lora.Linear, lora.Embedding):
                problem = (
                    f"{where} is a {type(layer).__module__}.{type(layer).__name__}, not LoRA's Linear or Embedding"
                )
            elif isinstance(layer.get_base_layer(), BaseTunerLayer) or getattr(layer, "lora_variant", {}):
                problem = f"{where} stacks adapters or uses a LoRA variant"
    if problem is not None:
        raise CheckpointSaveError(
            f"save_pretrained(..., merged=True) merges LoRA adapters of Linear and Embedding layers, and {problem}: "
            f"{HOW_TO_MERGE}"
        )


def write_merged(
    root: nn.Module,
    units: list[ShardedUnit],
    module: nn.Module,
    path: Path,
    ranks: Ranks,
    gathered: Callable[[nn.Module], AbstractContextManager],
) -> None:
    """The ``PeftModel`` ``module`` with its active LoRA adapters merged into its base model, written into the
    folder ``path`` as a plain transformers checkpoint (see [Note: saving a peft model]); ``gathered(layer)``
    shows ``layer``'s full parameters (a collective). Call ``check_mergeable`` first. A collective."""
    from peft.tuners import lora
    from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge

    check_part_of(root, module)
    base = module.get_base_model()
    layers = [(name, layer) for name, layer in base.named_modules() if isinstance(layer, BaseTunerLayer)]
    adapted = [name + "." for name, _ in layers]

    def merged_name(name: str) -> str | None:  # the layer's base layer in its place; the adapters' tensors dropped
        prefix = next((p for p in adapted if name.startswith(p)), None)
        if prefix is None:
            return name
        rest = name[len(prefix) :]
        return prefix + rest.removeprefix("base_layer.") if rest.startswith("base_layer.") else None

    names = stored_names(base, merged_name)
    plan = WeightPlan(base, names, ranks.world_size)
    values: dict[str, torch.Tensor] = {}
    error = None
    for where, layer in layers:
        with gathered(layer):
            if error is not None:
                continue  # the collectives go on, the same on every rank
            try:
                values.update(_merged_tensors(layer, names, plan, ranks.rank, lora, check_adapters_to_merge))
            except Exception as err:
                error = f"merging {where}: {type(err).__name__}: {err}"
    failed = {r: e for r, e in enumerate(gather_from_every_rank(ranks, error)) if e is not None}
    if failed:
        lines = "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
        raise CheckpointSaveError(f"save_pretrained({str(path)!r}, merged=True) failed ({lines}); nothing was written")
    buffers = {}
    for name, entry in base.state_dict(keep_vars=True).items():
        stored = merged_name(name)
        if stored is not None and isinstance(entry, torch.Tensor) and not isinstance(entry, nn.Parameter):
            buffers[stored] = entry.detach().to("cpu", copy=True).contiguous()
    configs = [getattr(base, "config", None), getattr(base, "generation_config", None)]
    write_weights(units, plan, buffers, configs, path, ranks, values)


def _merged_tensors(
    layer: nn.Module, names: dict[int, str], plan: WeightPlan, rank: int, lora: Any, to_merge: Callable
) -> dict[str, torch.Tensor]:
    """The base layer's weight (and bias) of the LoRA ``layer`` with its active adapters merged, as peft's
    ``merge`` adds them, for the tensors this ``rank`` writes (``layer``'s parameters are shown in full)."""
    base_layer = layer.get_base_layer()
    weight_name = names[id(base_layer.weight)]
    bias = getattr(base_layer, "bias", None)
    bias_name = names.get(id(bias)) if bias is not None else None
    mine = {n for n in (weight_name, bias_name) if n is not None and plan.owner[n] == rank}
    if not mine:
        return {}
    with warnings.catch_warnings():  # merge_and_unload's own warnings (adapters merged already) come from peft
        warnings.simplefilter("ignore")
        adapters = to_merge(layer, None)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        weight = base_layer.weight.detach().clone()
        merged_bias = bias.detach().clone() if bias is not None else None
        for adapter in adapters:
            if isinstance(layer, lora.Embedding):
                if adapter in layer.lora_embedding_A:
                    weight += layer.get_delta_weight(adapter).to(weight.dtype)
                continue
            if adapter not in layer.lora_A:
                continue
            weight += layer.get_delta_weight(adapter)
            if layer.lora_bias[adapter]:
                if merged_bias is None:
                    raise RuntimeError("Impossible to merge LoRA with `lora_bias=True`: the base layer has no bias")
                merged_bias += layer.lora_B[adapter].bias * layer.scaling[adapter]
    if weight_name in mine:
        out[weight_name] = weight.to("cpu", copy=True).contiguous()
    if bias_name in mine and merged_bias is not None:
        out[bias_name] = merged_bias.to("cpu", copy=True).contiguous()
    return out
