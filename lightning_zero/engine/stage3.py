"""Stage-3 module hooks: gather a unit just in time, release it right after use.

- forward pre-hook: ``unshard()`` (one all-gather for the unit);
- forward post-hook: if the outputs need gradients, hook them so that the unit is gathered again
  as soon as backward reaches it; then ``reshard()`` unless backward already holds it (an
  activation-checkpointing recomputation runs the forward inside backward);
- after the unit's gradients are reduced (``GradReducer``), or when backward ends: ``reshard()``.

The root unit (parameters the ``LightningModule`` owns directly, or weights tied across
branches) is used outside any submodule's forward, in ``training_step`` itself: during a step
``ShardedModel.begin_step`` / ``end_step`` *hold* it (``hold`` / ``unhold``), and the hooks above
leave a held unit gathered. Outside steps (a callback calling the model) it is gathered just in
time like any other unit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from lightning_zero.engine.unit import ShardedUnit


class Stage3Hooks:
    """Installs and removes the hooks above on every unit.

    Example::

        hooks = Stage3Hooks(units, reducer.queue_finish)
        hooks.install()
        out = model(x)          # units gathered one at a time, released after their forward
    """

    def __init__(self, units: list[ShardedUnit], queue_finish: Callable[[], None]) -> None:
        self.units = units
        self.queue_finish = queue_finish
        self.in_backward: set[ShardedUnit] = set()
        self.held: set[ShardedUnit] = set()
        self._handles: list[Any] = []

    def install(self) -> None:
        for unit in self.units:
            module = unit.module
            self._handles.append(module.register_forward_pre_hook(self._pre_forward(unit)))
            self._handles.append(module.register_forward_hook(self._post_forward(unit)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre_forward(self, unit: ShardedUnit):
        def hook(_module: torch.nn.Module, _args: Any) -> None:
            unit.unshard()

        return hook

    def _post_forward(self, unit: ShardedUnit):
        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors and torch.is_grad_enabled():
                register_multi_grad_hook(tensors, self._pre_backward(unit), mode="any")
            if unit not in self.in_backward and unit not in self.held:
                unit.reshard()

        return hook

    def _pre_backward(self, unit: ShardedUnit):
        def hook(_grad: torch.Tensor) -> None:
            self.queue_finish()
            self.in_backward.add(unit)
            unit.unshard()

        return hook

    def after_unit_reduced(self, unit: ShardedUnit) -> None:
        """All trainable parameters have their gradient: free the unit now, unless a frozen
        parameter's value may still be needed later in this backward."""
        if unit in self.in_backward and len(unit.trainable_indices) == len(unit.params):
            self.in_backward.discard(unit)
            if unit not in self.held:
                unit.reshard()

    def after_backward(self) -> None:
        for unit in self.in_backward - self.held:
            unit.reshard()
        self.in_backward.clear()

    def hold(self, unit: ShardedUnit) -> None:
        """Gather ``unit`` and keep it gathered until ``unhold`` (the root unit during a step)."""
        self.held.add(unit)
        unit.unshard()

    def unhold(self, unit: ShardedUnit) -> None:
        self.held.discard(unit)
        unit.reshard()
