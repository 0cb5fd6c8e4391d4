"""Planning a model's units and building them: the refusals that come before anything is sharded, the buckets of
stages 1 and 2, and the units themselves (materialized one at a time from the meta device when the model was built
there, with pretrained weights read into their shards)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_zero.engine.comm.mesh import ShardGroups
from lightning_zero.engine.core.grouping import UnitPlan, UnitPolicy, bucket_units, plan_units
from lightning_zero.engine.core.param_checks import check_no_shared_memory, check_no_sparse_gradients, check_unit_params
from lightning_zero.engine.core.policy import EnginePolicy
from lightning_zero.engine.core.unit import ShardedUnit
from lightning_zero.engine.hf.weights import load_weight_shards, resolve_weight_loads
from lightning_zero.engine.meta.init_trace import InitTrace
from lightning_zero.engine.meta.materialize import has_meta_tensors, materialize_units


def plan_model(
    module: nn.Module, policy: EnginePolicy, units: UnitPolicy | None
) -> tuple[list[UnitPlan], dict[int, nn.Module]]:
    """The units of ``module`` (buckets under stages 1 and 2), after every refusal, and the module each planned
    unit came from by the ``id`` of its first parameter: where its forward waits for its post-step gather under
    stages 1 and 2 (a bucket waits in each of its units' modules; see [Note: each unit waits for its own gather] in
    ``arrivals.py``). Nothing is changed before every plan was checked: a refused model is left untouched.

    Example::

        plans, planned_from = plan_model(model, EnginePolicy(stage=3), owns_parameters)
    """
    plans = plan_units(module, units)
    if not plans:
        raise ValueError(
            f"{type(module).__name__} has no parameters, so there is nothing to shard. Create the layers in "
            "__init__ or configure_model(), or use a strategy without sharding for a parameter-free model."
        )
    for plan in plans:
        check_unit_params(plan.name, plan.params, plan.param_names)
    check_no_shared_memory(module)
    check_no_sparse_gradients(module)
    planned_from = {id(plan.params[0]): plan.module for plan in plans}
    if policy.stage < 3:
        element = next((p.element_size() for p in module.parameters()), 4)
        plans = bucket_units(plans, policy.bucket_numel(element))
    return plans, planned_from


def build_units(
    module: nn.Module,
    plans: list[UnitPlan],
    groups: ShardGroups,
    policy: EnginePolicy,
    device: torch.device | None,
    meta_init: InitTrace | None,
) -> list[ShardedUnit]:
    """One ``ShardedUnit`` per plan, in plan order (collectives: call on every rank). A module built on ``meta``
    is materialized unit by unit (see [Note: meta init] in ``materialize.py``), and the pretrained weights its
    build recorded are read into the shards (see [Note: pretrained weights under meta init] in ``hf/weights.py``).

    Example::

        units = build_units(model, plans, ShardGroups(comm, comm), EnginePolicy(stage=3), None, None)
    """
    built: list[ShardedUnit | None] = [None] * len(plans)

    def build(index: int, full: torch.Tensor | None) -> None:
        built[index] = ShardedUnit(plans[index], groups.shard, policy, full=full, replicate=groups.replicate)

    # Names are resolved before the replay.
    loads = resolve_weight_loads(module, meta_init.weight_loads) if meta_init and meta_init.weight_loads else None
    if has_meta_tensors(module):
        size = groups.shard.world_size
        materialize_units(module, plans, device or torch.device("cpu"), size, build, meta_init)
    else:
        for index in range(len(plans)):
            build(index, None)
    units = [u for u in built if u is not None]
    # One set of side streams for the copies between host and device (see [Note: copies off the compute stream] in
    # core/streams.py), shared by every unit that has such copies.
    shared = next((u.streams for u in units if u.streams is not None), None)
    for unit in units:
        if unit.streams is not None:
            unit.streams = shared
    if loads is not None:
        assert meta_init is not None
        load_weight_shards(units, loads)
        meta_init.weight_loads.clear()
    return units
