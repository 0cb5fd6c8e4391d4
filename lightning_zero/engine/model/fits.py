"""Whether a sharded model's full parameters and its optimizers' full states fit on every rank, asked at the end of
a run before anything is gathered (see [Note: what fits at the end] in ``free_memory.py``). Each answer is a
collective: every rank learns the same, and the first rank short of memory says why."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_zero.engine.comm.comm import Comm
from lightning_zero.engine.core.optimizer import is_param_shaped
from lightning_zero.engine.core.unit import ShardedUnit
from lightning_zero.engine.core.unit_state import UnitState
from lightning_zero.engine.free_memory import FIT_MARGIN, available_bytes, describe_bytes, fits
from lightning_zero.engine.model.param_index import ParamIndex


def parameters_that_do_not_fit(units: list[ShardedUnit], comm: Comm) -> str | None:
    """Why the full parameters would not fit on some rank's device, or ``None`` (a collective).

    Example::

        reason = parameters_that_do_not_fit(sharded.units, sharded.comm)   # None: they fit on every rank
    """
    needed: dict[torch.device, int] = {}
    for unit in units:
        if unit.state is UnitState.UNSHARDED and not unit.separate_master:
            continue  # released in place
        size = unit.layout.padded_numel * torch.empty((), dtype=unit.master_dtype).element_size()
        needed[unit.device] = needed.get(unit.device, 0) + size
    return _agree_on_fit(needed, comm, units[0].device, "whether the full parameters fit")


def optimizer_states_that_do_not_fit(
    optimizers: list[Optimizer], index: ParamIndex, comm: Comm, device: torch.device
) -> str | None:
    """Why the optimizers' full per-parameter states would not fit on some rank's device, or ``None`` if they fit on
    every rank (a collective when there are optimizers).

    Example::

        reason = optimizer_states_that_do_not_fit(sharded.optimizers, sharded.index, sharded.comm, device)
    """
    if not optimizers:
        return None
    needed: dict[torch.device, int] = {}
    for optimizer in optimizers:
        for held, entry in optimizer.state.items():
            param, _ = index.param_of[held]
            shard_param = index.shard_of[param][0]
            for key, value in entry.items():
                if is_param_shaped(key, value, shard_param):
                    needed[value.device] = needed.get(value.device, 0) + param.numel() * value.element_size()
    return _agree_on_fit(needed, comm, device, "whether the full optimizer states fit")


def _agree_on_fit(needed: dict[torch.device, int], comm: Comm, device: torch.device, name: str) -> str | None:
    """``None`` if ``needed`` bytes fit on every rank's devices, else why not (a collective on ``device``)."""
    short = next(((d, n) for d, n in needed.items() if not fits(n, d)), None)
    flag = torch.tensor([0 if short else 1], dtype=torch.int64, device=device)
    comm.all_reduce(flag, op=dist.ReduceOp.MIN, name=name)
    if int(flag.item()) == 1:
        return None
    if short is None:
        return "they do not fit in the memory of another rank"
    where, count = short
    return (
        f"they need {describe_bytes(count)} of {where.type} memory on this rank, more than "
        f"{FIT_MARGIN:.0%} of the {describe_bytes(available_bytes(where) or 0)} that is free"
    )
