"""``OptimizerSteps``: the user's optimizers, stepping this rank's shards.

Each optimizer is built over the module's parameters; ``bind`` slices its state, and its ``step()`` runs while every
parameter of its units is that parameter's 1-D master piece with the sharded gradient as ``.grad`` (``on_shards``):
``param_groups`` and ``state`` keep the objects Lightning callbacks look for.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.engine.comm.mesh import ShardGroups
from lightning_zero.engine.core.optimizer import bind_optimizer, check_optimizer_params
from lightning_zero.engine.core.unit import ShardedUnit
from lightning_zero.engine.model.param_index import ParamIndex
from lightning_zero.engine.schedule.grads import GradReducer


class OptimizerSteps:
    """The optimizers bound to one sharded model and the state of the step in progress.

    Example::

        steps = OptimizerSteps(units, ParamIndex.of(units), reducer, groups, module, order_writes=lambda: None)
        steps.bind(optimizer)
        optimizer.step()                    # enters ``on_shards`` by itself
        steps.after_optimizer_step(optimizer)
    """

    def __init__(
        self,
        units: list[ShardedUnit],
        index: ParamIndex,
        reducer: GradReducer,
        groups: ShardGroups,
        module: nn.Module,
        order_writes: Callable[[], None],
    ) -> None:
        self.units = units
        self.index = index
        self.reducer = reducer
        self.groups = groups
        self._module = module
        self._shard_of = index.shard_of
        self._unit_of = index.unit_of
        self._own_ids = frozenset(id(p) for p in index.shard_of)  # the module's parameters (optimizers hold them)
        self._order_writes = order_writes  # see ``ShardedModel.order_writes_after``
        self.optimizers: list[Optimizer] = []
        self.units_of_cache: dict[int, tuple[tuple[int, ...], list[ShardedUnit]]] = {}
        self._step_hooks: dict[int, list[Any]] = {}
        # While an optimizer steps: each parameter with what its .data was (see ``on_shards``).
        self._on_shards: list[tuple[nn.Parameter, nn.Parameter, torch.Tensor]] | None = None
        self._on_shards_units: list[ShardedUnit] = []
        self._entered_by_step_hook = False

    def bind(self, optimizer: Optimizer) -> None:
        """Let ``optimizer`` (built over the module's parameters) step this rank's shards: its state is sliced,
        and each ``optimizer.step()`` runs on the master pieces (``on_shards``)."""
        bind_optimizer(optimizer, self._shard_of)
        self.optimizers.append(optimizer)
        self._step_hooks[id(optimizer)] = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]

    def remove_hooks(self) -> None:
        """Leave a step that raised, and remove the step hooks of every optimizer."""
        if self._on_shards is not None:
            self._exit_shards()
        for handles in self._step_hooks.values():
            for handle in handles:
                handle.remove()
        self._step_hooks.clear()

    def unbind(self, optimizer: Optimizer, full: dict[str, Any]) -> None:
        """Make ``optimizer`` a plain one again, over the module's parameters with ``full``, its DDP-shaped state
        dict (``full_optimizer_state_dict``); its hooks go with ``remove_hooks``."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        optimizer.state = defaultdict(dict)
        for index, state in full["state"].items():
            optimizer.state[params[index]] = state

    def _before_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if self._on_shards is not None:
            return  # already entered by ``on_shards``
        if any(callable(a) for a in args) or kwargs.get("closure") is not None:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step(closure) on a ZeRO-sharded model: the closure would run while the "
                "parameters are this rank's master pieces. Call the closure first, then optimizer.step() without "
                "one (Lightning's strategies do this for you)."
            )
        self._enter_shards(optimizer)
        self._entered_by_step_hook = True

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if self._entered_by_step_hook:
            self._entered_by_step_hook = False
            self._exit_shards()

    @contextmanager
    def on_shards(self, optimizer: Optimizer) -> Iterator[None]:
        """While inside: every parameter of ``optimizer``'s units is its 1-D master piece, with the sharded
        gradient as its ``.grad`` (see [Note: parameters outside their unit's use] in ``unit.py``), so the
        user's optimizer, a gradient scaler or a clipping function work on shards. ``optimizer.step()`` enters
        it by itself; re-entrant."""
        if self._on_shards is not None:
            yield
            return
        self._enter_shards(optimizer)
        try:
            yield
        finally:
            self._exit_shards()

    def _enter_shards(self, optimizer: Optimizer) -> None:
        check_optimizer_params(optimizer, self._own_ids, self._module)  # e.g. add_param_group with a foreign tensor
        self._order_writes()  # the step writes master shards and optimizer states
        reducer = self.reducer
        reducer.settle()  # the backward passes' flags (see [Note: flags read at the step] in grad_flags.py)
        saved = []
        self._on_shards_units = self.units_of(optimizer)
        for unit in self._on_shards_units:
            unit.wait_host_reads()  # the step writes the master, which may be the offloaded shard itself
            unit.adopt_rebound_data()
            unit.check_no_hidden_writes()
            unit.reveal()  # the optimizer works on the parameters themselves (see [Note: reading a sharded parameter])
            # What each parameter shows now (``adopt_rebound_data`` just made sure of it), put back by ``_exit_shards``.
            shown = unit.shown_data()
            # The sharded gradients the user zeroed are dropped (see [Note: gradient markers] in markers.py); the
            # markers are replaced by the sharded gradients below, and put back by ``_exit_shards``.
            reducer.drop_unwanted(unit.params, unit.shard_params)
            for param, shard_param, data in zip(unit.params, unit.shard_params, shown):
                saved.append((param, shard_param, data))
                param.data = shard_param  # (its values, as ``shard_param.data`` would give, without a new tensor)
                param.grad = shard_param.grad
        self._on_shards = saved

    def _exit_shards(self) -> None:
        assert self._on_shards is not None
        for param, shard_param, data in self._on_shards:
            shard_param.grad = param.grad
            param.grad = None
            param.data = data
        for unit in self._on_shards_units:
            self.reducer.put_markers(unit.params, unit.shard_params)
            unit.conceal_if_sharded()
            unit.record_hidden_versions()  # the optimizer's in-place updates count as writes
        self._on_shards = None
        self._on_shards_units = []

    def shard_params_of(self, optimizer: Optimizer) -> list[nn.Parameter]:
        """The shard parameters (holders of master pieces and sharded gradients) of ``optimizer``'s parameters."""
        return [self._shard_of[p][0] if p in self._shard_of else p for g in optimizer.param_groups for p in g["params"]]

    def after_optimizer_step(self, optimizer: Optimizer, wait: bool = False) -> None:
        """Spread the updated shards of ``optimizer``'s units to every rank: one all-gather per unit whose full
        parameters are kept (stages 1 and 2), issued and left in flight. The next ``begin_step`` waits for them,
        and so does anything that uses a parameter's values before it (see [Note: parameters whose values are on
        their way] in ``core/arriving.py``). ``wait=True`` waits here."""
        for unit in self.units_of(optimizer):
            pending = unit.gather_updated_shards(async_op=True)
            if wait and pending is not None:
                pending.wait()
            else:
                unit.leave_in_flight(pending)

    def units_of(self, optimizer: Optimizer) -> list[ShardedUnit]:
        """The units whose parameters ``optimizer`` steps (worked out once per param-group shape: this
        runs after every optimizer step)."""
        shape = tuple(len(g["params"]) for g in optimizer.param_groups)
        cached = self.units_of_cache.get(id(optimizer))
        if cached is not None and cached[0] == shape:
            return cached[1]
        units = self._find_units_of(optimizer)
        self.units_of_cache[id(optimizer)] = (shape, units)
        return units

    def _find_units_of(self, optimizer: Optimizer) -> list[ShardedUnit]:
        check_optimizer_params(optimizer, self._own_ids, self._module)
        stepped = {id(self._unit_of[p]) for group in optimizer.param_groups for p in group["params"]}
        return [u for u in self.units if id(u) in stepped]
