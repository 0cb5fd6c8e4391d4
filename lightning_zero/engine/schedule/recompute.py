"""Activation checkpointing chosen by a policy: which submodules recompute their forward in backward.

[Note: activation checkpointing]
``activation_checkpointing_policy`` means what it means on Lightning's ``FSDPStrategy``: a set of module classes
(or class names, for YAML configs), or a policy callable, either torch's FSDP kind (``ModuleWrapPolicy``,
``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``, any ``fn(module, recurse,
nonwrapped_numel)``) or a plain ``fn(module) -> bool``. Every submodule it selects, outermost first (nothing
inside a selected module is selected again: it is recomputed with it), gets torch's composable non-reentrant
checkpoint (``torch.distributed._composable.checkpoint``): its forward keeps none of its activations, only its
inputs, and backward runs it again to rebuild them just before they are needed. Unlike Lightning's FSDP, which
wraps each selected module in a ``CheckpointWrapper``, the module tree and every name stay as they were: state
dicts, checkpoints of either format, unit names and Hugging Face exports are the same with or without it, and a
run can resume with the policy changed.

It is applied at setup, before the model is sharded, so its hooks run around the engine's: a unit's
forward pre-hook gathers inside the checkpointed region, and the recomputation (which calls the module with
its hooks) finds the unit gathered already. Under stage 3 the order in backward is: a unit's outputs receive
their gradient, its pre-backward hook gathers it (the one gather of backward, prefetched as the first step
recorded), autograd reaches the region's saved tensors, the forward runs again on the gathered parameters
(``UnitPhase.PRE_BACKWARD``: the unit stays gathered, and no forward prefetch is issued, since the forward
order's position is closed once backward starts), then the unit's backward, its reduction, and its release.
So with a policy at unit granularity or finer (the default units are the repeated blocks, the classes a user
names here) a unit is gathered twice per micro-batch, as without checkpointing, and each selected module runs
its forward twice. A policy coarser than the units (one region over several units) recomputes them all at the
region's first unpack, outside their backward: each is gathered a third time for that.

The RNG state is restored for the recomputation (dropout draws the same mask), so a run with the policy
matches DDP with the same modules checkpointed by hand bitwise, and one without checkpointing too where no
random op runs. Memory: a selected module's activations live only during its own backward; the dry run
(``python -m lightning_zero dry-run --activation-checkpointing Block``) measures the difference, and the
estimator counts what ``profile_activations`` measures with the same policy (see [Note: activation memory per
unit] in ``lightning_zero/planning/activations.py``).

[Note: key/value caches under recomputation]
A Hugging Face model (any module whose ``config`` has a boolean ``use_cache``, as transformers' configs do) fills a
key/value cache in its forward by default, in training too (``config.use_cache=True``): each decoder layer appends
its keys and values to the cache its model made for the call. A selected layer's recomputation in backward appends
them a second time and sees a cache twice as long, so torch's checkpoint stops with ``CheckpointError: ...
Recomputed values for the following tensors have different metadata`` (plain torch fails the same way).
transformers' own ``gradient_checkpointing_enable`` turns the cache off in training for this reason, with a
warning when the call asked for it. So does the policy: every such module that holds a selected module runs its
forward with ``config.use_cache`` off while it is in train mode with gradients enabled (when the recomputation
happens), an explicit ``use_cache=True`` keyword included (warned about once), and restores the config when the
forward returns. The config keeps its value outside those calls (``config.json`` written by ``save_pretrained`` is
unchanged), and evaluation, prediction and ``generate`` (under ``no_grad``, where nothing is recomputed) keep
their cache.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_zero.engine.core.grouping import module_class_policy


def check_policy(policy: Any) -> None:
    """Raise ``TypeError`` for what ``activation_checkpointing_policy`` cannot be, saying what it can."""
    if policy is None or _is_fsdp_policy(policy) or (callable(policy) and not isinstance(policy, type)):
        return
    if isinstance(policy, (set, frozenset, list, tuple)) and policy:
        for entry in policy:
            if not (isinstance(entry, str) or (isinstance(entry, type) and issubclass(entry, nn.Module))):
                raise TypeError(
                    f"activation_checkpointing_policy entries must be nn.Module subclasses or class names, got "
                    f"{entry!r}"
                )
        return
    raise TypeError(
        f"activation_checkpointing_policy must be a set of module classes (or class names), or a policy callable, "
        f"got {policy!r}; for example activation_checkpointing_policy={{Block}} or "
        "activation_checkpointing_policy={'Block'}"
    )


def selected_modules(module: nn.Module, policy: Any) -> list[tuple[str, nn.Module]]:
    """The submodules of ``module`` that ``policy`` selects (never ``module`` itself), outermost first and each
    once: a module inside a selected one is recomputed with it and not selected again."""
    if policy is None:
        return []
    choose = _chooser(module, policy)
    chosen: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(prefix: str, parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if id(child) in seen:  # a module reused under two names: once
                continue
            seen.add(id(child))
            path = f"{prefix}{name}"
            if choose(child):
                chosen.append((path, child))
            else:
                visit(f"{path}.", child)

    visit("", module)
    return chosen


def apply_activation_checkpointing(module: nn.Module, policy: Any) -> list[str]:
    """Give each submodule ``policy`` selects torch's composable non-reentrant checkpoint (see [Note: activation
    checkpointing]); returns their names. A model that checkpoints some of its modules already (by hand,
    ``gradient_checkpointing_enable()``, a ``CheckpointWrapper``) is left as it is, with a warning, as
    Lightning's ``FSDPStrategy`` does.

    Example::

        names = apply_activation_checkpointing(model, {Block})   # ['blocks.0', 'blocks.1', ...]
    """
    if policy is None:
        return []
    from torch.distributed._composable import checkpoint
    from torch.distributed._composable.contract import _get_registry

    chosen = selected_modules(module, policy)
    if chosen and all("checkpoint" in (_get_registry(child) or {}) for _, child in chosen):
        return [name for name, _ in chosen]  # applied by an earlier run of the same model
    already = _already_checkpointed(module)
    if already is not None:
        warnings.warn(
            f"activation_checkpointing_policy is set, but the model already checkpoints activations ({already}); "
            "the policy is not applied. Remove one of the two.",
            stacklevel=3,
        )
        return []
    for _, child in chosen:
        checkpoint(child)
    _turn_caches_off_in_training(module, [child for _, child in chosen])
    return [name for name, _ in chosen]


class _CacheOffInTraining:
    """A forward pre-hook and a forward hook of a module with a ``config.use_cache``: while it runs in train mode
    with gradients enabled, the cache is off (see [Note: key/value caches under recomputation]). Nested calls
    (``LlamaForCausalLM`` calls ``LlamaModel``, which shares its config) each restore what they found."""

    def __init__(self, selected: str) -> None:
        self.selected = selected  # the class name of a module the policy recomputes, for the warning
        self.found: list[Any] = []  # the config's value at each open call, innermost last
        self.warned = False

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        recomputing = module.training and torch.is_grad_enabled()
        self.found.append(module.config.use_cache if recomputing else None)
        if not recomputing:
            return None
        module.config.use_cache = False
        if kwargs.get("use_cache"):
            if not self.warned:
                self.warned = True
                warnings.warn(
                    f"use_cache=True is incompatible with activation_checkpointing_policy (the recomputation of "
                    f"{self.selected} in backward would fill the key/value cache a second time): the cache is off "
                    f"in {type(module).__name__}'s training forwards, as transformers' gradient_checkpointing_enable "
                    "turns it off.",
                    stacklevel=2,
                )
            return args, {**kwargs, "use_cache": False}
        return None

    def after(self, module: nn.Module, *_: Any) -> None:
        found = self.found.pop() if self.found else None
        if found is not None:
            module.config.use_cache = found


def _turn_caches_off_in_training(module: nn.Module, chosen: list[nn.Module]) -> None:
    """Hooks on each module of ``module`` that has a ``config.use_cache`` and holds a module of ``chosen`` (see
    [Note: key/value caches under recomputation])."""
    selected = {id(child): child for child in chosen}
    for candidate in module.modules():
        if not isinstance(getattr(getattr(candidate, "config", None), "use_cache", None), bool):
            continue
        inside = next((m for m in candidate.modules() if id(m) in selected), None)
        if inside is None:
            continue
        hooks = _CacheOffInTraining(type(inside).__name__)
        candidate.register_forward_pre_hook(hooks.before, with_kwargs=True)
        candidate.register_forward_hook(hooks.after, always_call=True)


def _chooser(root: nn.Module, policy: Any) -> Callable[[nn.Module], bool]:
    if isinstance(policy, (set, frozenset, list, tuple)):  # matched as unit_modules are
        by_class = module_class_policy(list(policy))
        return lambda module: by_class("", module)
    if _is_fsdp_policy(policy):
        picked = {id(m) for m in policy._run_policy(root, set(), {})}
        return lambda module: id(module) in picked
    if _takes_fsdp_arguments(policy):
        return lambda module: bool(
            policy(module=module, recurse=False, nonwrapped_numel=sum(p.numel() for p in module.parameters()))
        )
    return lambda module: bool(policy(module))


def _is_fsdp_policy(policy: Any) -> bool:
    try:
        from torch.distributed.fsdp.wrap import _Policy
    except ImportError:  # pragma: no cover - torch without FSDP
        return False
    return isinstance(policy, _Policy)


def _takes_fsdp_arguments(policy: Callable[..., Any]) -> bool:
    """Whether ``policy`` is an FSDP auto-wrap callable (``module, recurse, nonwrapped_numel``)."""
    try:
        parameters = inspect.signature(policy).parameters
    except (TypeError, ValueError):
        return False
    return "recurse" in parameters and "nonwrapped_numel" in parameters


def _already_checkpointed(module: nn.Module) -> str | None:
    """What in ``module`` checkpoints activations already, if anything (described)."""
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    for name, child in module.named_modules():
        if isinstance(child, CheckpointWrapper):
            return f"{name or 'the model'} is a CheckpointWrapper"
        if "checkpoint" in (_get_registry(child) or {}):
            return f"{name or 'the model'} has torch's composable checkpoint"
        if getattr(child, "gradient_checkpointing", False) is True:
            return f"{name or 'the model'} has gradient checkpointing enabled (gradient_checkpointing_enable())"
    return None
