"""``UnitState`` and ``UnitPhase``: what a unit's storage is, and where the current step is with it."""

from __future__ import annotations

import enum


class UnitState(enum.Enum):
    """Whether a unit's full parameters exist on this rank (see [Note: unit lifecycle])."""

    SHARDED = "sharded"
    UNSHARDED = "unsharded"


class UnitPhase(enum.Enum):
    """Where the current step is with a unit (see [Note: unit lifecycle]).

    [Note: unit lifecycle]
    A unit has two states, which answer different questions and change at different points:

    - its *storage*, ``UnitState``: ``SHARDED`` (only this rank's shard exists; the parameters are placeholders)
      or ``UNSHARDED`` (``flat`` is allocated and gathered, or being gathered: ``gather_in_flight``). Only
      ``unshard()`` and ``reshard()`` change it (both idempotent), and ``release``. Stages 1 and 2 stay
      ``UNSHARDED``.
    - its *phase*, ``UnitPhase``: how far the step has got with the unit, which decides when its storage may be
      freed. The stage-3 schedule sets it (``Stage3Hooks``); under stages 1 and 2 nothing is gathered or freed
      per unit, no module hook runs, and every unit stays ``IDLE``.

    Over one training step (FSDP2's ``TrainingState`` has the same four)::

        IDLE -> FORWARD -> IDLE -> PRE_BACKWARD -> POST_BACKWARD -> IDLE
             pre-      post-    backward      its gradients     end of
             forward   forward  reaches it    reduced           backward

    - ``FORWARD``: from the unit's forward pre-hook to its post-hook, in training and evaluation alike (a module
      called twice goes ``FORWARD -> IDLE`` twice). A forward while the unit is ``PRE_BACKWARD`` is an
      activation-checkpointing recomputation inside backward: the phase stays, and so does the storage (what the
      recomputation saves for backward is the parameters themselves).
    - ``IDLE`` after forward: freed, unless held (the root unit during a step) or kept for backward (the last unit
      of the recorded forward; every unit without ``reshard_after_forward``: see [Note: prefetch] in
      ``stage3.py``). The storage says which.
    - ``PRE_BACKWARD``: a gradient reached an output of the unit's forward; the unit is gathered (again) and stays
      so while its backward may still read its parameters.
    - ``POST_BACKWARD``: backward is done with the unit: the reduce-scatter of its trainable parameters' gradients
      is issued (see [Note: reduce order] in ``reduce_order.py``) and, if it has a frozen parameter, its inputs'
      gradients are computed (see [Note: frozen units] in ``stage3.py``). It is freed then, unless held. A unit that
      backward reaches again (a graph that gets to it by another path later) goes back to ``PRE_BACKWARD``.
    - ``IDLE`` when the backward pass ends (``Stage3Hooks.after_backward``): units still ``PRE_BACKWARD`` (one with
      a frozen parameter whose inputs' gradients never came) are freed then. And when the step ends
      (``Stage3Hooks.end_step``) with no unit ``PRE_BACKWARD``: a forward that raised leaves its unit ``FORWARD``,
      a step without backward leaves every unit ``IDLE`` already.

    What is not a unit's phase stays where it is decided: whether the backward pass has started, which units are
    held and which reductions were issued (the schedule's, for this pass), which gradients each rank produced (the
    reducer's). The hooks that move a unit on are ranges in a profiler trace, ``ZeRO::pre_forward``,
    ``ZeRO::post_forward``, ``ZeRO::pre_backward``, and so is its work, ``ZeRO::gather``, ``ZeRO::reduce_grads``,
    ``ZeRO::release`` (see [Note: profiler labels] in ``comm/labels.py``).
    """

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


class ParamView(enum.Enum):
    """What a unit's parameters show now (see [Note: parameters outside their unit's use] in ``unit.py``).

    - ``SHOWN``: views of ``flat``, whose values are there;
    - ``ARRIVING``: views of ``flat`` whose post-step all-gather is still in flight: each parameter waits for it on
      its first use (see [Note: parameters whose values are on their way] in ``arriving.py``);
    - ``HIDDEN``: placeholders (the unit is sharded, or gathered ahead of its use and not yet waited for).
    """

    SHOWN = "shown"
    ARRIVING = "arriving"
    HIDDEN = "hidden"
