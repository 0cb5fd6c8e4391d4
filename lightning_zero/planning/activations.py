"""Activation memory per unit: what autograd saves for backward in each unit's forward, measured on one forward
of an example input, and what ``activation_checkpointing_policy`` leaves of it.

[Note: activation memory per unit]
ZeRO shards the model states; the activations of a micro-batch are the same on every rank and under every stage
(DDP included), so they are one figure per rank that the estimator adds to each row's peak. They are measured,
not guessed from a formula: one forward of the model on an example input, on the model's own device (the meta
device for a model built there, where nothing is allocated), under ``saved_tensors_hooks`` that record every
tensor autograd keeps for backward, each storage once, attributed to the innermost unit (as the engine plans the
units) running when it was first saved. Parameters are model state and are not counted (under stage 3 the
gathered units are the estimator's ``gathered`` column). With a checkpointing policy, a selected module keeps
only its inputs until backward, where its forward runs again and holds its saved tensors until its own backward
is done, one selected module at a time; so:

    held without checkpointing   = sum of every unit's saved bytes
    held with checkpointing      = saved bytes outside the selected modules + their inputs
    peak with checkpointing      = held + the largest selected module's saved bytes (its recomputation)

The peak is an upper bound (the largest module's recomputation is counted as if every other input were still
held, which is exact when the largest is the last). What the figure does not include: the gradients of the
activations that backward creates and frees as it goes (about one unit's activations at a time), the
temporaries an op allocates and frees inside itself, and the loss's logits when the loss is computed outside the
measured call. ``python -m lightning_zero dry-run`` counts every tensor of a real step and reports the
estimator's figure beside it (see ``tests/test_activations.py`` for how close they are).

Example::

    profile = profile_activations(model, (tokens, targets), activation_checkpointing_policy={Block})
    profile.peak_bytes, profile.units[0]
    estimate_memory(model, devices=8, activations=profile)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_zero.engine.core.grouping import ROOT_NAME, module_class_policy, plan_units


@dataclass(frozen=True)
class UnitActivations:
    """One unit's share of a micro-batch's activations."""

    name: str  # the unit's name, as the engine names it; "<root>": the top module, outside every other unit
    saved_bytes: int  # what autograd saves for backward while this unit runs (each storage once)
    held_bytes: int  # what it holds until backward: saved_bytes, or, where it is checkpointed, its inputs
    checkpointed: bool  # whether the policy recomputes its forward (all of it, or a module inside it)


@dataclass(frozen=True)
class ActivationProfile:
    """Activation bytes of one micro-batch of the example input, per unit (see [Note: activation memory per
    unit])."""

    units: tuple[UnitActivations, ...]
    recompute_bytes: int  # the largest checkpointed module's saved bytes, held during its recomputation
    checkpointed_modules: int  # how many modules the policy selects

    @property
    def saved_bytes(self) -> int:
        """Held until backward without checkpointing."""
        return sum(u.saved_bytes for u in self.units)

    @property
    def held_bytes(self) -> int:
        """Held until backward with the policy (the same as ``saved_bytes`` without one)."""
        return sum(u.held_bytes for u in self.units)

    @property
    def peak_bytes(self) -> int:
        """What the estimator adds to a row's peak: held until backward, plus one recomputation."""
        return self.held_bytes + self.recompute_bytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "saved_bytes": self.saved_bytes,
            "held_bytes": self.held_bytes,
            "recompute_bytes": self.recompute_bytes,
            "peak_bytes": self.peak_bytes,
            "checkpointed_modules": self.checkpointed_modules,
            "units": [u.__dict__ for u in self.units],
        }


def profile_activations(
    model: nn.Module,
    example_input: Any,
    unit_modules: Sequence[type[nn.Module] | str] | None = None,
    activation_checkpointing_policy: Any = None,
) -> ActivationProfile:
    """Measure what one forward of ``model`` on ``example_input`` keeps for backward, per unit.

    Args:
        model: the model as the strategy would receive it (built on the meta device or on a real one; it is not
            changed: no hook stays behind, no parameter is touched). It must not checkpoint activations already
            (the policy here says which modules do).
        example_input: one micro-batch of one rank: a tensor, a tuple of positional arguments, a dict of keyword
            arguments (moved to the model's device), or a function ``fn(model)`` that runs the forward (and the
            loss) itself, such as ``lambda m: m.training_step(batch, 0)``.
        unit_modules: the strategies' ``unit_modules`` (default: the engine's default units).
        activation_checkpointing_policy: the strategies' ``activation_checkpointing_policy`` (a set of module
            classes or names, or a policy callable).

    Example::

        >>> import torch
        >>> from torch import nn
        >>> with torch.device("meta"):
        ...     model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
        >>> profile = profile_activations(model, torch.zeros(8, 256), unit_modules=[nn.Linear])
        >>> [(u.name, u.saved_bytes) for u in profile.units]
        [('<root>', 32768), ('0', 8192), ('2', 0)]
    """
    from lightning_zero.engine.schedule.recompute import _already_checkpointed, selected_modules

    already = _already_checkpointed(model)
    if already is not None:
        raise ValueError(
            f"the model checkpoints activations already ({already}): profile it without, and pass the modules as "
            "activation_checkpointing_policy"
        )
    policy = None if unit_modules is None else module_class_policy(list(unit_modules))
    plans = plan_units(model, policy)
    # The top module's activations (outside every unit) are "<root>"'s, whether or not it has parameters of its own.
    names = [ROOT_NAME] + [p.name for p in plans if p.name != ROOT_NAME]
    unit_of = {id(p.module): p.name for p in plans if p.name != ROOT_NAME}
    chosen = selected_modules(model, activation_checkpointing_policy)
    parameters = {_key(p) for p in model.parameters()} | {_key(b) for b in model.buffers()}

    saved = dict.fromkeys(names, 0)
    held_inputs = dict.fromkeys(names, 0)
    checkpointed = dict.fromkeys(names, False)
    region_saved: dict[int, int] = {}  # a selected module's saved bytes (counted in its unit's too)
    region_unit: dict[int, str] = {}
    seen: set[int] = set()
    unit_stack: list[str] = [ROOT_NAME]
    region_stack: list[int] = []
    handles: list[Any] = []

    def enter_unit(module: nn.Module, *_: Any) -> None:
        unit_stack.append(unit_of[id(module)])

    def leave_unit(*_: Any) -> None:
        unit_stack.pop()

    def enter_region(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # The unit a selected module belongs to: itself if it is a unit root, else the innermost unit running.
        unit = unit_of.get(id(module)) or unit_stack[-1]
        region_unit[id(module)] = unit
        checkpointed[unit] = True
        inputs = {}
        for tensor in tree_flatten((args, kwargs))[0]:
            if isinstance(tensor, torch.Tensor) and _key(tensor) not in parameters:
                inputs[_key(tensor)] = tensor.untyped_storage().nbytes()
        held_inputs[unit] += sum(inputs.values())
        region_stack.append(id(module))
        region_saved.setdefault(id(module), 0)

    def leave_region(*_: Any) -> None:
        region_stack.pop()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _key(tensor)
        if key not in parameters and key not in seen:
            seen.add(key)
            size = tensor.untyped_storage().nbytes()
            saved[unit_stack[-1]] += size
            if region_stack:
                region_saved[region_stack[0]] += size
        return tensor

    try:
        for plan in plans:
            if plan.name != ROOT_NAME:
                handles.append(plan.module.register_forward_pre_hook(enter_unit))
                handles.append(plan.module.register_forward_hook(leave_unit, always_call=True))
        for _, module in chosen:
            # Registered after the units' hooks: a region's pre-hook sees its unit already entered.
            handles.append(module.register_forward_pre_hook(enter_region, with_kwargs=True))
            handles.append(module.register_forward_hook(leave_region, always_call=True))
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
        with torch.enable_grad(), _FusedAttentionOnMeta(), hooks:
            out = _call(model, example_input)
        del out
    finally:
        for handle in handles:
            handle.remove()

    in_regions: dict[str, int] = dict.fromkeys(names, 0)
    for region, unit in region_unit.items():
        in_regions[unit] += region_saved[region]
    units = tuple(
        UnitActivations(
            name,
            saved[name],
            saved[name] - in_regions[name] + held_inputs[name] if checkpointed[name] else saved[name],
            checkpointed[name],
        )
        for name in names
    )
    return ActivationProfile(units, max(region_saved.values(), default=0), len(chosen))


def _key(tensor: torch.Tensor) -> int:
    """One number per storage (meta storages included, which have no data pointer)."""
    return tensor.untyped_storage()._cdata


class _FusedAttentionOnMeta(TorchFunctionMode):
    """On the meta device, ``scaled_dot_product_attention`` as the fused kernel it runs as on CUDA and CPU.

    Meta has no fused attention backend to pick, so SDPA would take its math fallback there, which saves the
    T x T attention matrix of every head for backward; the fused kernels (flash, memory-efficient) save their
    inputs, the output and one log-sum-exp per row instead. The op called here has a meta kernel and an autograd
    formula that saves what they save."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not kwargs.get("enable_gqa", False):
            q, k, v, *rest = args
            names = ("attn_mask", "dropout_p", "is_causal", "scale")
            given = dict(zip(names, rest)) | kwargs
            if q.is_meta and k.is_meta and v.is_meta and (given.get("attn_mask") is None or given["attn_mask"].is_meta):
                out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q,
                    k,
                    v,
                    given.get("dropout_p", 0.0),
                    given.get("is_causal", False),
                    attn_mask=given.get("attn_mask"),
                    scale=given.get("scale"),
                )
                return out
        return func(*args, **kwargs)


def _call(model: nn.Module, example_input: Any) -> Any:
    if callable(example_input) and not isinstance(example_input, torch.Tensor):
        return example_input(model)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))

    def to_device(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if value.is_meta and device.type != "meta":
            raise ValueError(
                f"example_input is on the meta device but the model is on {device}: give a real input, or build the "
                "model on the meta device (with torch.device('meta'): ...)"
            )
        return value.to(device)

    moved = tree_map(to_device, example_input)
    if isinstance(moved, dict):
        return model(**moved)
    if isinstance(moved, (tuple, list)):
        return model(*moved)
    return model(moved)
