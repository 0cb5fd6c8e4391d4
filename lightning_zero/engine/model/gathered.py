"""Full parameter values for user code outside a forward (``ShardedModel.gathered_parameters``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lightning_zero.engine.core.unit import ShardedUnit


@contextmanager
def gathered_parameters(
    all_units: list[ShardedUnit], module: nn.Module | None = None, writable: bool = True
) -> Iterator[None]:
    """Inside, the parameters of ``module`` (default: the whole model) show their full values in the master
    dtype, as under DDP; on a normal exit, with ``writable``, what was written into them goes back to the
    shards. A collective (one all-gather per unit that needs it): call on every rank. Memory: those units'
    full parameters at once.

    Example::

        with gathered_parameters(sharded.units, model.backbone, writable=False):
            norms = {n: p.norm() for n, p in model.backbone.named_parameters()}
    """
    wanted = None if module is None else {id(p) for p in module.parameters()}
    units = [
        u for u in all_units if u.needs_gather_to_read and (wanted is None or any(id(p) in wanted for p in u.params))
    ]
    shown: list[tuple[ShardedUnit, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] = []
    failed = False
    try:
        for unit in units:
            unit.adopt_rebound_data()
            unit.check_no_hidden_writes()
            full = unit.full_flat()
            views = unit.full_views(full)
            shown.append((unit, full, views, unit.show(views)))
        shown_views = {id(unit): views for unit, _, views, _ in shown}
        for unit in all_units:  # memory that user code once rebound a parameter to sees its current values
            if id(unit) in shown_views:
                unit.refresh_aliases(shown_views[id(unit)])
            elif wanted is None or any(id(p) in wanted for p in unit.params):
                unit.adopt_rebound_data()
                unit.refresh_aliases()
        yield
    except BaseException:
        failed = True  # restore locally; writes are not spread (peers may not be here)
        raise
    finally:
        for unit, full, views, previous in shown:
            for index, (param, view) in enumerate(zip(unit.params, views)):
                if param.data_ptr() != view.data_ptr() and param.shape == view.shape:
                    with torch.no_grad():  # rebound inside (p.data = x, as ModelPruning does): keep its values
                        view.copy_(param.data)
                    unit.keep_alias(index, param.data)
            unit.hide_again(previous)
            if writable and not failed:
                unit.take_writes(full)
