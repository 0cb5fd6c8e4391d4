"""Which parameters form which unit.

A *unit root* is a module whose parameters are gathered and reduced together. The top module is
always a unit root; the others are chosen by a policy (by default: every module that owns
parameters directly). Every parameter belongs to exactly one unit: that of the nearest unit root
enclosing *all* modules that own it. So a weight tied between ``wte`` and ``lm_head`` lands in the
unit of their closest common ancestor, and is gathered whenever either of them runs.

Some modules read their children's parameters without calling the children (``nn.MultiheadAttention``
uses ``out_proj.weight`` directly). Their whole subtree is one unit whatever the policy says
(``ATOMIC_MODULES``), so that everything they read is gathered when they run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

ROOT_NAME = "<root>"
ATOMIC_MODULES: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)
UnitPolicy = Callable[[str, nn.Module], bool]


@dataclass
class UnitPlan:
    """The parameters of one unit, in a fixed order that is the same on every rank."""

    name: str
    module: nn.Module
    params: list[nn.Parameter]
    param_names: list[str]


def owns_parameters(_name: str, module: nn.Module) -> bool:
    """The default policy: a module that registers parameters of its own is a unit root."""
    return any(True for _ in module.parameters(recurse=False))


def module_class_policy(classes: Sequence[type[nn.Module] | str]) -> UnitPolicy:
    """A policy that makes instances of ``classes`` (types, or class names as strings) unit roots."""
    types = tuple(c for c in classes if isinstance(c, type))
    names = {c for c in classes if isinstance(c, str)}

    def policy(_name: str, module: nn.Module) -> bool:
        cls = type(module)
        return isinstance(module, types) or cls.__name__ in names or f"{cls.__module__}.{cls.__qualname__}" in names

    return policy


def _common_prefix(paths: list[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for level in zip(*parts):
        if any(x != level[0] for x in level):
            break
        common.append(level[0])
    return ".".join(common)


def plan_units(module: nn.Module, policy: UnitPolicy = owns_parameters) -> list[UnitPlan]:
    """Assign every parameter of ``module`` to one unit (see module docstring); empty units are dropped.

    Units come in module registration order; the top module's unit (if it has parameters) is named
    ``"<root>"``.
    """
    modules = dict(module.named_modules(remove_duplicate=False))
    atomic = [name for name, m in modules.items() if name and isinstance(m, ATOMIC_MODULES)]
    inside_atomic = {name for name in modules for a in atomic if name.startswith(a + ".")}
    roots = {""} | {name for name, m in modules.items() if name and name not in inside_atomic and policy(name, m)}

    owners: dict[int, list[str]] = {}
    first_name: dict[int, str] = {}
    param_by_id: dict[int, nn.Parameter] = {}
    for mod_name, mod in modules.items():
        for pname, param in mod.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append(mod_name)
            first_name.setdefault(id(param), f"{mod_name}.{pname}" if mod_name else pname)
            param_by_id[id(param)] = param

    assigned: dict[str, list[int]] = {}
    for pid, paths in owners.items():
        path = _common_prefix(paths)
        while path not in roots:
            path = path.rpartition(".")[0]
        assigned.setdefault(path, []).append(pid)

    # Registration order for units and, within a unit, for parameters.
    order = {name: i for i, name in enumerate(modules)}
    param_order = {id(p): i for i, (_, p) in enumerate(module.named_parameters(remove_duplicate=True))}
    plans = []
    for root in sorted(assigned, key=order.__getitem__):
        pids = sorted(assigned[root], key=param_order.__getitem__)
        plans.append(
            UnitPlan(
                name=root or ROOT_NAME,
                module=modules[root],
                params=[param_by_id[p] for p in pids],
                param_names=[first_name[p] for p in pids],
            )
        )
    return plans


def bucket_units(plans: list[UnitPlan], bucket_numel: int) -> list[UnitPlan]:
    """Stages 1 and 2: merge consecutive units (in registration order) into buckets of at least
    ``bucket_numel`` elements, so that each collective moves enough bytes to be efficient. Only units of
    the same dtype and device merge. Under these stages a unit is only the granularity of collectives
    (parameters are never gathered per module), so any grouping gives the same results.

    Example::

        plans = bucket_units(plan_units(model), bucket_numel=25 * 2**20 // 4)   # about 25 MB of fp32
    """
    if bucket_numel <= 0:
        return plans
    buckets: list[UnitPlan] = []
    current: list[UnitPlan] = []

    def close() -> None:
        if not current:
            return
        first, last = current[0], current[-1]
        name = first.name if len(current) == 1 else f"{first.name}..{last.name}"
        buckets.append(
            UnitPlan(
                name=name,
                module=first.module,
                params=[p for plan in current for p in plan.params],
                param_names=[n for plan in current for n in plan.param_names],
            )
        )
        current.clear()

    for plan in plans:
        if current and (
            plan.params[0].dtype != current[0].params[0].dtype or plan.params[0].device != current[0].params[0].device
        ):
            close()
        current.append(plan)
        if sum(p.numel() for c in current for p in c.params) >= bucket_numel:
            close()
    close()
    return buckets
