"""Big-model init: parameters created on the ``meta`` device become real one unit at a time.

[Note: meta init]
A module built on the ``meta`` device has shapes but no memory. ``materialize_units`` walks the
modules in registration order, the order in which an ordinary construction initializes them. For
each module with meta parameters it allocates the full flat buffer of the unit(s) those parameters
belong to (the parameters become views of it; see [Note: unit memory] in ``unit.py``), gives the
module real buffers, and calls the module's own ``reset_parameters()``. As soon as every module of
a unit has been initialized, the unit's buffer is handed to ``on_ready``, which shards it and frees
it. Memory therefore peaks at the shards plus the units being initialized, never the full model.

Values equal those of an unsharded construction with the same seed, because every module is reset
in registration order and draws from the random stream as its constructor did. A parameter tied
across modules (``lm_head.weight = wte.weight``) keeps its first owner's value, as a tie made after
construction does; later owners still run ``reset_parameters`` (on a scratch tensor), so the random
stream stays aligned.

Code that writes into meta parameters *after* their module was built (``model.apply(init_fn)``,
``load_state_dict`` of pretrained weights) writes nothing, and ``reset_parameters`` cannot know
about it. ``MetaWriteCounter`` therefore counts, while the model is built, the in-place writes each
meta tensor receives; ``check_meta_writes`` counts again what the modules' ``reset_parameters``
write (a dry run, still on meta) and refuses the model, naming the parameters, if building it
wrote more. Nothing the user wrote is dropped silently.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_zero.engine.grouping import UnitPlan
from lightning_zero.engine.layout import ShardLayout


class MetaWriteCounter(TorchDispatchMode):
    """Counts the in-place writes (``normal_``, ``copy_``, ...) each ``meta`` tensor storage receives.

    Example::

        with torch.device("meta"), MetaWriteCounter() as counter:
            model = build()
        check_meta_writes(model, counter.writes)
    """

    def __init__(self) -> None:
        super().__init__()
        self.writes: Counter[int] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for index, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            if isinstance(value, torch.Tensor) and value.is_meta:
                self.writes[_storage_key(value)] += 1
        return func(*args, **kwargs)


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata  # one StorageImpl per tensor and all its views


def check_meta_writes(module: nn.Module, written_when_built: Counter[int]) -> None:
    """Raise ``ValueError`` if building ``module`` wrote into a meta parameter or buffer more than its module's
    ``reset_parameters()`` does, or if ``reset_parameters()`` leaves one unset (see [Note: meta init])."""
    check_materializable(module)
    with MetaWriteCounter() as counter, torch.no_grad():
        for mod in module.modules():
            params, buffers = _meta_names(mod)
            if params or buffers:
                mod.reset_parameters()
    overwritten, unset = [], []
    for mod_name, mod in module.named_modules():
        params, buffers = _meta_names(mod)
        for name in params + buffers:
            tensor = mod._parameters[name] if name in mod._parameters else mod._buffers[name]
            key = _storage_key(tensor)
            full_name = f"{mod_name}.{name}" if mod_name else name
            if counter.writes[key] == 0:
                unset.append(full_name)
            elif written_when_built[key] > counter.writes[key]:
                overwritten.append(full_name)
    if overwritten:
        raise ValueError(
            f"configure_model wrote into {len(overwritten)} parameter(s)/buffer(s) after creating them on the meta "
            f"device (meta_init, the stage-3 default): {', '.join(overwritten[:8])}. Meta tensors hold no data, so "
            "such writes (an init function applied after construction, load_state_dict of pretrained weights) "
            "would be lost. Put the initialization in each module's reset_parameters(), load weights after setup "
            "(e.g. self.load_state_dict(...) in on_fit_start, which streams them into the shards), or pass "
            "meta_init=False."
        )
    if unset:
        raise ValueError(
            f"{len(unset)} parameter(s)/buffer(s) created on the meta device (meta_init, the stage-3 default) are not "
            f"set by their module's reset_parameters(): {', '.join(unset[:8])}. Initialize them there, create "
            "these modules in __init__ instead of configure_model, or pass meta_init=False."
        )


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` lives on the ``meta`` device."""
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def check_materializable(module: nn.Module) -> None:
    """Raise ``ValueError`` naming every module with meta tensors but no ``reset_parameters()`` to create them."""
    missing = [
        name or type(module).__name__
        for name, mod in module.named_modules()
        if any(_meta_names(mod)) and not callable(getattr(mod, "reset_parameters", None))
    ]
    if missing:
        raise ValueError(
            f"{len(missing)} module(s) were created on the meta device (configure_model under stage 3) but define no "
            f"reset_parameters() to initialize them: {', '.join(missing[:8])}. Give each a reset_parameters() that "
            "fills its parameters and buffers, create these modules in __init__ instead of configure_model, or pass "
            "meta_init=False to the strategy (the full model is then built on every rank before sharding)."
        )


def _meta_names(module: nn.Module) -> tuple[list[str], list[str]]:
    params = [n for n, p in module._parameters.items() if p is not None and p.is_meta]
    buffers = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
    return params, buffers


def materialize_units(
    module: nn.Module,
    plans: list[UnitPlan],
    device: torch.device,
    world_size: int,
    on_ready: Callable[[int, torch.Tensor | None], None],
) -> None:
    """Initialize ``module``'s meta parameters unit by unit (see [Note: meta init]).

    ``on_ready(i, full)`` is called once per plan, in an order that is the same on every rank, with
    the plan's full flat buffer (laid out as ``ShardLayout`` says; ``plans[i].params`` are views of it)
    or ``None`` for a plan that had no meta parameters.
    """
    check_materializable(module)
    plan_of = {id(p): i for i, plan in enumerate(plans) for p in plan.params}
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in module.modules():
        for name, param in mod._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((mod, name))
    # Which modules must run reset_parameters, and for which plans (decided before anything changes).
    work: list[tuple[nn.Module, list[str], list[str], set[int]]] = []
    remaining = [0] * len(plans)
    for mod in module.modules():
        params, buffers = _meta_names(mod)
        if not params and not buffers:
            continue
        touched = {plan_of[id(mod._parameters[n])] for n in params}
        work.append((mod, params, buffers, touched))
        for i in touched:
            remaining[i] += 1
    for i, count in enumerate(remaining):
        if count == 0:
            on_ready(i, None)

    flats: dict[int, torch.Tensor] = {}
    initialized: set[int] = set()
    for mod, params, buffers, touched in work:
        for i in sorted(touched):
            if i not in flats:
                flats[i] = _allocate(plans[i], device, world_size, holders)
        for name in buffers:
            mod._buffers[name] = torch.empty_like(mod._buffers[name], device=device)
        scratch = {}
        for name in params:
            param = mod._parameters[name]
            if id(param) in initialized:  # tied, and its first owner already set it
                scratch[name] = param
                mod._parameters[name] = nn.Parameter(torch.empty_like(param), requires_grad=param.requires_grad)
        with torch.no_grad():
            mod.reset_parameters()
        for name, param in scratch.items():
            mod._parameters[name] = param
        initialized.update(id(mod._parameters[n]) for n in params)
        for i in sorted(touched):
            remaining[i] -= 1
            if remaining[i] == 0:
                on_ready(i, flats.pop(i))


def _allocate(
    plan: UnitPlan, device: torch.device, world_size: int, holders: dict[int, list[tuple[nn.Module, str]]]
) -> torch.Tensor:
    """The plan's full flat buffer; its parameters (meta or not) are replaced by views of it everywhere."""
    layout = ShardLayout.from_shapes([p.shape for p in plan.params], world_size)
    full = torch.zeros(layout.padded_numel, dtype=plan.params[0].dtype, device=device)
    for j, (param, offset, numel) in enumerate(zip(plan.params, layout.offsets, layout.numels)):
        view = full[offset : offset + numel].view(param.shape)
        if not param.is_meta:
            with torch.no_grad():
                view.copy_(param.detach())
        # A fresh parameter pointed at the view with .data: created from the view itself it would share the
        # buffer's version counter, and every later all-gather would invalidate tensors saved for backward.
        real = nn.Parameter(torch.empty(0, dtype=full.dtype, device=device), requires_grad=param.requires_grad)
        real.data = view
        for mod, name in holders[id(param)]:
            mod._parameters[name] = real
        plan.params[j] = real
    return full
