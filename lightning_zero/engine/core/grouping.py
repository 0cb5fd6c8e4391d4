"""Which parameters form which unit.

A *unit root* is a module whose parameters are gathered and reduced together. The top module is
always a unit root; the others are chosen by a policy (by default ``default_unit_policy``, see
[Note: default units]). Every parameter belongs to exactly one unit: that of the nearest unit root
enclosing *all* modules that own it. So a weight tied between ``wte`` and ``lm_head`` lands in the
unit of their closest common ancestor, and is gathered whenever either of them runs.

Some modules read their children's parameters without calling the children (``nn.MultiheadAttention``
uses ``out_proj.weight`` directly). Their whole subtree is one unit whatever the policy says
(``ATOMIC_MODULES``), so that everything they read is gathered when they run.

[Note: default units]
One unit per module that owns parameters (``owns_parameters``) makes every ``Linear`` and ``LayerNorm``
a collective and, under stage 3, a pair of hooks: on small and medium models that costs 2-8x DDP's
step. Hand-chosen units are the model's repeated blocks (``unit_modules=["Block"]``). The default,
``default_unit_policy``, finds them from the module tree alone:

1. *Repeated blocks.* Walking down from the top, the first ``nn.ModuleList`` / ``nn.Sequential`` met
   on a path whose children include at least two parameter-holding instances of one class makes
   every parameter-holding child of that class a unit root (the transformer layers of GPT-2,
   Llama, BERT, OPT, ViT, LitGPT; the stages of a ResNet; a ``Sequential`` stack of ``Linear``). The
   walk does not descend into a block: its norms, biases and projections fold into it.
2. *Large leaves.* Outside blocks, a module that owns at least ``min_unit_numel`` parameter
   elements of its own (a big ``Linear``, an unshared embedding) is a unit root.
3. *Everything else* folds into the nearest enclosing unit root: small modules (norms, biases,
   position embeddings, heads) outside blocks into the root unit, which a step holds gathered
   throughout (see [Note: prefetch] in ``stage3.py``), so they cost no collective of their own.
4. *Small models are one unit* (checked first). A model with fewer than ``whole_model_below`` parameter elements
   (default 2^20: 4 MiB in fp32) gets no unit roots at all: each step gathers it once, holds it,
   and reduces it once, as DeepSpeed keeps parameters below its persistence thresholds whole. On
   such a model every collective is latency-bound (on two CPU ranks, tiny GPT-2, Llama, BERT, OPT,
   LitGPT, ResNet and ViT ran at 1.6-3.0x DDP's step with one unit per block, measured by
   ``benchmarks/real_models.py``), while gathering all of it costs at most 4 MiB per rank for the
   step; gradients and optimizer states stay sharded.

Why these roots are safe: a unit is gathered by a forward pre-hook on its root module, so a module
folded into a unit must run only inside that root's forward. The root unit is held for the whole
step, so anything may fold into it. A block's forward is what calls the block's own layers in every
model we know; containers (``ModuleList``, ``ModuleDict``, ``Sequential``), whose forward a model may
never call (it iterates over them), are never made unit roots. Since this cannot be known from the
module tree alone, stage 3 verifies it on the first training step (``Stage3Hooks``, [Note: folded
modules]) and names the module that ran outside its unit, pointing to ``unit_modules``.
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


CONTAINER_MODULES: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
DEFAULT_MIN_UNIT_NUMEL = 2**20
DEFAULT_WHOLE_MODEL_NUMEL = 2**20


def owns_parameters(_name: str, module: nn.Module) -> bool:
    """A policy that makes every module that registers parameters of its own a unit root (the finest grain)."""
    return any(True for _ in module.parameters(recurse=False))


def default_unit_policy(
    module: nn.Module,
    min_unit_numel: int = DEFAULT_MIN_UNIT_NUMEL,
    whole_model_below: int = DEFAULT_WHOLE_MODEL_NUMEL,
) -> UnitPolicy:
    """The policy used when none is given: repeated blocks and large leaves of ``module`` are unit roots, and a
    model of fewer than ``whole_model_below`` elements is one unit (see [Note: default units]).

    Example::

        policy = default_unit_policy(gpt)        # gpt.transformer.h is an nn.ModuleList of Block
        [p.name for p in plan_units(gpt, policy)]
        # ['<root>', 'transformer.h.0', 'transformer.h.1', ...]
    """
    roots: set[int] = set()
    if sum(p.numel() for p in module.parameters()) < whole_model_below:
        return lambda _name, _m: False
    in_blocks: set[int] = set()

    def holds_parameters(m: nn.Module) -> bool:
        return any(True for _ in m.parameters())

    def walk(m: nn.Module) -> None:
        if isinstance(m, ATOMIC_MODULES):
            return
        children = [c for c in m.children() if holds_parameters(c)]
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            by_class: dict[type[nn.Module], list[nn.Module]] = {}
            for child in children:
                # A compiled block (``torch.compile(block)``, an ``OptimizedModule``) counts as the class it wraps;
                # the wrapper is the unit root, so that the unit's hooks run outside the compiled code.
                if not isinstance(compiled_original(child), CONTAINER_MODULES):
                    by_class.setdefault(type(compiled_original(child)), []).append(child)
            for group in by_class.values():
                if len(group) >= 2:
                    for child in group:
                        roots.add(id(child))
                        in_blocks.update(id(d) for d in child.modules())
        for child in children:
            if id(child) not in in_blocks:
                walk(child)

    walk(module)
    for m in module.modules():
        if id(m) in in_blocks or isinstance(m, CONTAINER_MODULES):
            continue
        if sum(p.numel() for p in m.parameters(recurse=False)) >= min_unit_numel:
            roots.add(id(m))

    def policy(_name: str, m: nn.Module) -> bool:
        return id(m) in roots

    return policy


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


def compiled_original(module: nn.Module) -> nn.Module:
    """The module that ``torch.compile(module)`` wrapped (an ``OptimizedModule``), else ``module`` itself."""
    original = getattr(module, "_orig_mod", None)
    return original if isinstance(original, nn.Module) else module


def plan_units(module: nn.Module, policy: UnitPolicy | None = None) -> list[UnitPlan]:
    """Assign every parameter of ``module`` to one unit (see module docstring); empty units are dropped.
    ``policy=None``: ``default_unit_policy(module)``.

    Units come in module registration order; the top module's unit (if it has parameters) is named
    ``"<root>"``.
    """
    if policy is None:
        policy = default_unit_policy(module)
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
    """Stages 1 and 2: merge consecutive units (in registration order) into buckets of at most
    ``bucket_numel`` elements (a unit larger than that is a bucket of its own), as DDP's ``bucket_cap_mb``
    caps its buckets, so that each collective moves enough bytes to be efficient while no reduction buffer
    grows past the cap. Only units of the same dtype and device merge. Under these stages a unit is only the
    granularity of collectives (parameters are never gathered per module), so any grouping gives the same
    results.

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

    held = 0  # elements in ``current``
    for plan in plans:
        numel = sum(p.numel() for p in plan.params)
        if current and (
            plan.params[0].dtype != current[0].params[0].dtype
            or plan.params[0].device != current[0].params[0].device
            or held + numel > bucket_numel
        ):
            close()
            held = 0
        current.append(plan)
        held += numel
    close()
    return buckets
