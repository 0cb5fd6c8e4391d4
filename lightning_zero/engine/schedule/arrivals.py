"""Stages 1 and 2: each unit's forward waits for its own post-step all-gather, not the first forward for all of them.

[Note: each unit waits for its own gather]
After an optimizer step, stages 1 and 2 all-gather every unit's updated shard into the full parameters and leave the
gathers in flight (see [Note: parameters whose values are on their way] in ``core/arriving.py``). Waiting for
all of them in ``begin_step``, before the forward, would make the forward's first kernel wait for the *last* unit's
gather (on NCCL a wait is the compute stream waiting for the collective's end), and the later units' gathers would
overlap nothing. DDP has no such gathers; FSDP2 and stage 3 wait for each unit's gather in that unit's forward
pre-hook. So each unit here has a forward pre-hook (``ForwardWaits``) on the module it was planned from (the unit
roots of ``plan_units``; a bucket of several, one on each), which waits for that unit's gather only, when the
module's forward starts: the compute stream then runs the first units' kernels while the later units' gathers
travel.

Which units are left to their hooks. A hook only helps if it runs, and runs eagerly, before the unit's parameters
are read:

- a parameter read before its unit's hook (a root-unit parameter that ``training_step`` reads itself, a bucket
  whose first module runs late) is not a problem in eager code: the arriving parameter waits for its unit's gather
  on first use, as it does outside a step;
- compiled code must never meet an arriving parameter (its class changes under Dynamo's guards, and its wait
  cannot be traced), and a hook inside compiled code is traced, not run. So no hook is installed on a module inside
  compiled code when the model is sharded (``modules_in_compiled_code``); a unit with a parameter of such a module
  is always waited for in ``begin_step``; a hook that finds itself traced does nothing
  (``torch.compiler.is_compiling()`` is constant while Dynamo traces, so the hook adds nothing to the graph and no
  graph break); and ``begin_step`` waits for every unit whose hook did not run eagerly in the previous
  forward. Only the units whose hook did are left in flight. A model compiled after an eager forward
  (``module.compile()`` between two steps) is waited for at ``begin_step`` from its second compiled forward on; its
  first may meet arriving parameters, whose wait then runs inside Dynamo's handling of the frame (with torch 2.13 on a
  CPU the values are the same, bit for bit).

The first forward after the model is sharded has nothing in flight; from the second on, the units whose forwards
ran eagerly are waited for in their own forward. Results are unchanged, bit for bit: what is waited for, and the
values read, are the same, only the point of the wait moves (on gloo the host blocks there instead of in
``begin_step``). Stage 3 has its own per-unit gathers and does not use this. The order of the waits is tested on a
CPU (``tests/test_streams.py``); the overlap it buys on a GPU has not been measured: no GPU has run it yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_zero.engine.core.hooks import EngineHook
from lightning_zero.engine.core.unit import ShardedUnit
from lightning_zero.engine.schedule.compiled import modules_in_compiled_code


class ForwardWaits:
    """Forward pre-hooks that make each unit's forward wait for its own post-step gather (see [Note: each unit waits
    for its own gather]). ``begin_forward()`` at the start of each step waits for the others.

    Example::

        waits = ForwardWaits(units, [[unit.module] for unit in units], root=model)
        waits.install()
        waits.begin_forward()      # in begin_step: only the units no eager hook waited for last time
        model(x)                   # each unit's hook waits for its gather
    """

    def __init__(self, units: Sequence[ShardedUnit], modules: Sequence[Sequence[nn.Module]], root: nn.Module) -> None:
        self.units = list(units)
        self.modules = [list(m) for m in modules]  # per unit, the modules whose forward waits for it
        self.root = root
        self._ran: set[int] = set()  # ids of the units whose hook ran eagerly since the last ``begin_forward``
        self._always: set[int] = set()  # ids of the units compiled code reads: waited for in ``begin_forward``
        self._handles: list[Any] = []

    def install(self) -> None:
        compiled = modules_in_compiled_code(self.root)
        read_compiled = {id(p) for m in self.root.modules() if id(m) in compiled for p in m.parameters(recurse=False)}
        self._always = {id(u) for u in self.units if any(id(p) in read_compiled for p in u.params)}
        for unit, modules in zip(self.units, self.modules):
            hook = self._pre_forward(unit)
            for module in modules:
                if id(module) not in compiled:
                    self._handles.append(module.register_forward_pre_hook(EngineHook(hook)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre_forward(self, unit: ShardedUnit) -> Callable[[nn.Module, Any], None]:
        ran = self._ran

        def wait_for_own_gather(_module: nn.Module, _args: Any) -> None:
            if torch.compiler.is_compiling():  # traced: nothing in the graph (see the note)
                return
            ran.add(id(unit))
            if unit.arriving:
                unit.wait_gather()

        return wait_for_own_gather

    def begin_forward(self) -> None:
        """Wait for the post-step gathers of the units whose hook did not run eagerly in the previous forward; leave
        the others to their own hooks."""
        ran = set(self._ran)
        self._ran.clear()
        for unit in self.units:
            if unit.arriving and (id(unit) not in ran or id(unit) in self._always):
                unit.wait_gather()

    @property
    def left_to_hooks(self) -> list[ShardedUnit]:
        """The units whose gather is still in flight, each to be waited for by its own forward (after
        ``begin_forward``)."""
        return [unit for unit in self.units if unit.arriving]
