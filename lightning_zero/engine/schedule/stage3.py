"""Stage-3 module hooks: gather a unit just in time, release it right after use.

- forward pre-hook: ``unshard()`` (one all-gather for the unit);
- forward post-hook: if the outputs need gradients, hook them so that the unit is gathered again
  as soon as backward reaches it; then ``reshard()`` unless backward already holds it (an
  activation-checkpointing recomputation runs the forward inside backward);
- after the unit's gradients are reduced (``GradReducer``), or when backward ends: ``reshard()``
  (a unit with frozen parameters: see [Note: frozen units]).

Each of these moves the unit to its next phase, ``FORWARD``, ``IDLE``, ``PRE_BACKWARD``, ``POST_BACKWARD``, and
the phase says what backward still needs (see [Note: unit lifecycle] in ``unit_state.py``).

The forward hooks run eagerly, outside ``torch.compile`` graphs (see [Note: torch.compile] in ``compiled.py``).

[Note: prefetch]
The order in which units run is recorded on the first training step, once for forward and once for
backward, and on the first evaluation step (validation, test, predict, or a step under ``no_grad``)
for the forward of evaluation, which may differ. On later steps, when unit ``k`` of that order
starts, the all-gathers of the next ``prefetch`` units are issued asynchronously, so that they
travel while unit ``k`` computes; the unit's own hook then only waits. At most ``prefetch + 1``
units (plus the held root unit) are gathered at once in forward; in backward one more at most, a
unit whose reduction or whose inputs' gradients (see [Note: frozen units]) are still to come, as
long as units complete in the order of the first step (see [Note: reduce order] in ``reduce_order.py``). A
step that leaves the recorded order (control flow that changed) simply stops prefetching for the
rest of that pass, and units prefetched but not used are freed when the backward pass or the step
ends. ``reshard_after_forward=False`` keeps each unit gathered from its forward until its gradients
are reduced: no second all-gather in backward (``2Ψ`` instead of ``3Ψ`` communication) for the
memory of all units at once. When a step runs several forwards under ``no_grad`` in a row (a generation loop,
one per token), the first is prefetched as above, and each later one along an order of its own, recorded per
first unit (see [Note: joined forwards] in ``joined.py``).

The root unit (parameters the ``LightningModule`` owns directly, or weights tied across
branches) is used outside any submodule's forward, in ``training_step`` itself: during a step
``ShardedModel.begin_step`` / ``end_step`` *hold* it (``hold`` / ``unhold``), and the hooks above
leave a held unit gathered. Outside steps (a callback calling the model) it is gathered just in
time like any other unit.

[Note: frozen units]
A unit whose parameters all require a gradient is done with in backward once they all have one: it
is freed when the ``GradReducer`` issues its reduction. A frozen parameter gives no such signal, yet
its value may still be needed: in a LoRA layer ``x @ W.T + x @ A.T @ B.T`` the node that computes the
input's gradient through the frozen ``W`` runs *after* ``A`` and ``B`` have their gradients (autograd
runs later-created nodes first). So a unit with a frozen parameter also waits for the gradients of its
forward's inputs (the tensors among its positional and keyword arguments that require a gradient):
each forward that runs with gradients registers a hook on them (``register_multi_grad_hook``, mode
``"all"``), and the unit is freed once every such hook has fired and its trainable parameters, if any,
have been reduced. Every node of the unit's forward that backward runs leads to one of those inputs or
to one of those parameters, so none runs later. A hook that never fires (an output that did not reach
the loss) only keeps the unit gathered until backward ends. Values the forward reads from
elsewhere (a tensor attribute that requires a gradient, a parameter of another unit) are not its
inputs: such a unit should own them, or be a root; the default units fold tied weights into the root.

[Note: folded modules]
A module that owns parameters but is not a unit root is *folded* into the unit of an enclosing module
(see [Note: default units] in ``grouping.py``), whose forward pre-hook gathers them. That is right only
if the folded module runs inside that forward (or while the unit is held). The module tree cannot
tell; the first training step does: a forward pre-hook on every folded module checks that its unit
is gathered, and raises ``FoldedModuleError`` naming the module and the unit otherwise (instead of
computing with parameters that are not gathered). The checks are removed when the first training
step ends, so later steps pay nothing. Modules inside compiled code are not checked (a hook there
would break the graph once and force a recompile).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from lightning_zero.engine.comm.labels import label
from lightning_zero.engine.core.grouping import ROOT_NAME
from lightning_zero.engine.core.hooks import EngineHook
from lightning_zero.engine.core.unit import ShardedUnit
from lightning_zero.engine.core.unit_state import UnitPhase
from lightning_zero.engine.errors import FoldedModuleError
from lightning_zero.engine.schedule.compiled import outside_graphs
from lightning_zero.engine.schedule.joined import JoinedForwards
from lightning_zero.engine.schedule.order import UnitOrder

if TYPE_CHECKING:
    from lightning_zero.engine.comm.comm import Comm


class Stage3Hooks:
    """Installs and removes the hooks above on every unit.

    Example::

        hooks = Stage3Hooks(units, reducer.queue_finish)
        hooks.install()
        out = model(x)          # units gathered one at a time, released after their forward
    """

    def __init__(
        self,
        units: list[ShardedUnit],
        queue_finish: Callable[[], None],
        prefetch: int = 1,
        reshard_after_forward: bool = True,
        root: torch.nn.Module | None = None,
        comm: Comm | None = None,
    ) -> None:
        self.units = units
        self.root = root  # the whole model: where compiled code is looked for (see [Note: folded modules])
        self.queue_finish = queue_finish
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        # Which units backward still needs is their phase, PRE_BACKWARD (see [Note: unit lifecycle] in unit_state.py).
        self.held: set[ShardedUnit] = set()
        self._handles: list[Any] = []
        self.forward_order = UnitOrder()
        self.backward_order = UnitOrder()
        self.eval_order = UnitOrder()  # the forward of evaluation steps (see [Note: prefetch])
        self._pass_order: UnitOrder | None = None  # the forward order this step follows, if any
        # See [Note: frozen units]: input-gradient hooks registered and not fired yet; units reduced.
        self._open_inputs: dict[ShardedUnit, int] = {}
        self._reduced: set[ShardedUnit] = set()
        self._training = False
        self._backward_started = False
        self._fold_checks: list[Any] = []
        # No-grad forwards that ranks run different numbers of times (see [Note: joined forwards] in joined.py): with
        # the world's ``comm`` (whose sequence checks every unit's gathers), and a whole model to hook.
        self.joined = JoinedForwards(units, comm, self._prefetch) if comm is not None and root is not None else None
        if comm is not None and self.joined is not None:
            comm.forward_server = self.serve_forward

    def install(self) -> None:
        for unit in self.units:
            module = unit.module
            pre_forward = outside_graphs(self._pre_forward(unit))
            self._handles.append(module.register_forward_pre_hook(pre_forward, with_kwargs=True))
            self._handles.append(module.register_forward_hook(outside_graphs(self._post_forward(unit))))
        compiled: set[int] = set()
        for top in [self.root] if self.root is not None else [u.module for u in self.units]:
            for module in top.modules():
                if _is_compiled(module):
                    compiled.update(id(m) for m in module.modules())
        self._install_fold_checks(compiled)
        if self.joined is not None and self.root is not None and len(self.units) > 1:
            self.joined.install(self.root, compiled)

    def _install_fold_checks(self, compiled: set[int]) -> None:
        """See [Note: folded modules]; ``compiled``: the ids of the modules inside compiled code."""
        for unit in self.units:
            mine = {id(p) for p in unit.params}
            for name, module in unit.module.named_modules():
                if id(module) in compiled or module is unit.module:
                    continue
                if not any(id(p) in mine for p in module.parameters(recurse=False)):
                    continue
                where = name if unit.name.startswith("<") else f"{unit.name}.{name}"
                self._fold_checks.append(module.register_forward_pre_hook(EngineHook(self._check_folded(unit, where))))

    def _check_folded(self, unit: ShardedUnit, where: str):
        def hook(_module: torch.nn.Module, _args: Any) -> None:
            if self._training and not (unit.is_unsharded and not unit.gather_in_flight):
                raise FoldedModuleError(
                    f"{where!r} ({type(_module).__name__}) ran outside the forward of {unit.name!r}, the unit its "
                    "parameters belong to, so they were not gathered. Name the classes whose forward calls it as units "
                    "(ZeRO3Strategy(unit_modules=[...]), e.g. the model's block class), or make it a unit itself."
                )

        return hook

    def _remove_fold_checks(self) -> None:
        for handle in self._fold_checks:
            handle.remove()
        self._fold_checks.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._remove_fold_checks()
        if self.joined is not None:
            self.joined.remove()
            if self.joined.comm.forward_server == self.serve_forward:
                self.joined.comm.forward_server = None

    # ------------------------------------------------------------------ prefetch
    def begin_forward(self, training: bool) -> None:
        """A step starts: prefetch (or, on the first such step, record) in the forward order of training or of
        evaluation."""
        self._training = training
        self._pass_order = self.forward_order if training else self.eval_order
        if training:
            self._open_inputs.clear()
        # A no-grad step that other ranks serve: its first forward is joined (gathered along its own order, in the
        # sequence its step began), not prefetched along the evaluation order (see [Note: joined forwards]).
        served = self.joined is not None and self.joined.comm.step_served
        if self.joined is not None:
            self.joined.close(sequence=not served)
        upcoming = self._pass_order.start()
        if not served:
            self._prefetch(upcoming)

    def serve_forward(self, code: int, step: bool) -> str | None:
        """Take part in the gathers of a no-grad forward that other ranks run, the one starting at the unit whose name
        has ``code``, or with ``step`` the first forward of a no-grad step that they begin, with the root unit's
        gather before it (see [Note: Fabric steps] in ``fabric/wrapper.py``); ``None`` once served, or why this
        rank cannot serve it. A step is served only between steps, where this rank's units are as the runners' were
        when they began it; then they are freed, as the runners' are when it ends."""
        assert self.joined is not None
        if not step:
            return self.joined.serve(code)
        if self._pass_order is not None or self.held:
            return "it is inside a step of its own"
        gathered = {unit for unit in self.units if unit.is_unsharded}
        root = next((unit for unit in self.units if unit.name == ROOT_NAME), None)
        if root is not None and root not in gathered:
            root.serve_gather()  # (what the runners' hold of it gathers)
        why = self.joined.serve(code, gathered - {root})
        self.free_unused()
        return why

    def prefetch_first(self) -> None:
        """Issue the gathers of the first units of the recorded training forward, before the step begins (see
        [Note: gathers at the start of a batch] in ``sharded_model.py``); nothing before the order is recorded."""
        if self.forward_order.recorded is not None:
            self._prefetch(self.forward_order.recorded)

    def _prefetch(self, upcoming: list[ShardedUnit]) -> None:
        for unit in upcoming[: self.prefetch]:
            if unit not in self.held:
                unit.unshard(async_op=True)

    def _pre_forward(self, unit: ShardedUnit):
        def hook(_module: torch.nn.Module, args: Any, kwargs: Any) -> None:
            with label("ZeRO::pre_forward", unit.name):
                self._unit_starts(unit, (args, kwargs))

        return hook

    def _unit_starts(self, unit: ShardedUnit, inputs: Any) -> None:
        if unit.phase is not UnitPhase.PRE_BACKWARD:  # else a recomputation inside backward: backward keeps it
            unit.phase = UnitPhase.FORWARD
        joined = self.joined
        if joined is not None and unit not in self.held:
            if self._pass_order is not None and not torch.is_grad_enabled():  # see [Note: joined forwards]
                with joined.comm.forward_collectives():
                    if not joined.unit_starts(unit):  # the first no-grad forward since they met: prefetch
                        self._prefetch_in_step(unit)
                    unit.unshard()
                return
            joined.close()
        self._prefetch_in_step(unit)
        unit.unshard()
        if torch.is_grad_enabled() and not all(p.requires_grad for p in unit.params):
            self._watch_inputs(unit, inputs)

    def _prefetch_in_step(self, unit: ShardedUnit) -> None:
        """Prefetch the units that follow ``unit`` in the order this step follows (see [Note: prefetch])."""
        order = self._pass_order
        if order is not None and torch.is_grad_enabled() == self._training and unit not in self.held:
            self._prefetch(order.reached(unit))

    def replay_eval_forward(self) -> None:
        """Gather and release every unit of one evaluation forward, in the order the first evaluation step
        recorded, with the same prefetches, without running any module: the collectives that a rank which has run
        out of evaluation batches issues for each batch the other ranks still run (see [Note: uneven evaluation]
        in ``strategies/agreement.py``). Call under ``torch.no_grad()``, between ``begin_forward(False)`` and
        ``end_step()``, as for the step it stands for."""
        with self.joined.frame() if self.joined is not None else nullcontext():  # one forward, whatever repeats
            for unit in self.eval_order.recorded or []:
                self._unit_starts(unit, None)
                self._unit_ends(unit, None)

    def _watch_inputs(self, unit: ShardedUnit, inputs: Any) -> None:
        """See [Note: frozen units]."""
        tensors = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            self._open_inputs[unit] = self._open_inputs.get(unit, 0) + 1
            register_multi_grad_hook(tensors, self._inputs_done(unit), mode="all")

    def _inputs_done(self, unit: ShardedUnit):
        def hook(_grads: Any) -> None:
            self._open_inputs[unit] = self._open_inputs.get(unit, 1) - 1
            self._free_if_done(unit)

        return hook

    def _post_forward(self, unit: ShardedUnit):
        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            with label("ZeRO::post_forward", unit.name):
                self._unit_ends(unit, output)

        return hook

    def _unit_ends(self, unit: ShardedUnit, output: Any) -> None:
        if unit.phase is UnitPhase.FORWARD:
            unit.phase = UnitPhase.IDLE
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        training = tensors and torch.is_grad_enabled()
        if training:
            register_multi_grad_hook(tensors, self._pre_backward(unit), mode="any")
        # Kept gathered: every unit without reshard_after_forward; the unit that ends the recorded forward
        # in any case, since backward starts with it.
        keep = training and (not self.reshard_after_forward or self.forward_order.at_end(unit))
        if unit.phase is not UnitPhase.PRE_BACKWARD and unit not in self.held and not keep:
            unit.reshard()

    def _pre_backward(self, unit: ShardedUnit):
        def hook(_grad: torch.Tensor) -> None:
            with label("ZeRO::pre_backward", unit.name):
                self.queue_finish()
                if not self._backward_started:
                    self._backward_started = True
                    self.forward_order.finish()
                    self.backward_order.start()
                unit.phase = UnitPhase.PRE_BACKWARD
                if unit not in self.held:
                    self._prefetch(self.backward_order.reached(unit))
                unit.unshard()

        return hook

    def after_unit_reduced(self, unit: ShardedUnit) -> None:
        """All trainable parameters have their gradient: free the unit now, unless its backward may still need
        a frozen parameter's value (see [Note: frozen units])."""
        self._reduced.add(unit)
        self._free_if_done(unit)

    def _free_if_done(self, unit: ShardedUnit) -> None:
        if unit.phase is not UnitPhase.PRE_BACKWARD or self._open_inputs.get(unit, 0) > 0:
            return
        if any(p.requires_grad for p in unit.params) and unit not in self._reduced:
            return
        unit.phase = UnitPhase.POST_BACKWARD
        if unit not in self.held:
            unit.reshard()

    def after_backward(self) -> None:
        self.backward_order.finish()
        self._backward_started = False
        self._open_inputs.clear()
        self._reduced.clear()
        for unit in self.units:
            if unit.phase is UnitPhase.PRE_BACKWARD and unit not in self.held:
                unit.reshard()
            unit.phase = UnitPhase.IDLE
        self.free_unused()

    def free_unused(self) -> None:
        """Units gathered but not in use (prefetched for a pass that went elsewhere, kept after forward)."""
        for unit in self.units:
            if unit.is_unsharded and unit not in self.held and unit.phase is not UnitPhase.PRE_BACKWARD:
                unit.reshard()

    def end_step(self) -> None:
        if self.joined is not None:
            self.joined.close()
        if self._training and self._fold_checks:
            self._remove_fold_checks()  # the first training step has run them
        if self._pass_order is not None:
            self._pass_order.finish()
        self._pass_order = None
        self._training = False
        if not any(unit.phase is UnitPhase.PRE_BACKWARD for unit in self.units):
            for unit in self.units:  # (a forward that raised left its unit FORWARD)
                unit.phase = UnitPhase.IDLE
            self.free_unused()

    def hold(self, unit: ShardedUnit) -> None:
        """Gather ``unit`` and keep it gathered until ``unhold`` (the root unit during a step)."""
        self.held.add(unit)
        unit.unshard()

    def unhold(self, unit: ShardedUnit) -> None:
        self.held.discard(unit)
        unit.reshard()


def _is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs as compiled code (``torch.compile(module)`` or ``module.compile()``)."""
    return hasattr(module, "_orig_mod") or getattr(module, "_compiled_call_impl", None) is not None
