"""What a stage-1 or stage-2 parameter answers while the all-gather that refreshes it is in flight.

[Note: parameters whose values are on their way]
Stages 1 and 2 keep the full parameters on every rank and refresh them after each optimizer step with one
all-gather per unit into the buffer the parameters are views of (``ShardedModel.after_optimizer_step``).
Waiting for those gathers there puts one more meeting of the ranks on the step path than DDP has (on small
models a wait of about 1 ms: the faster rank waits for the slower wherever they meet). Instead they are
left in flight, and the parameters of each such unit switch to a subclass of their own class (``arrive``)
whose ``__torch_function__`` waits for the unit's gather before any access that is not metadata
(``_ARRIVING_METADATA``: shape, dtype, ``.grad``, hooks, ``requires_grad``), then switches the parameters
back (``settle``, from ``ShardedUnit._finish_gather``) and runs the function on the now plain parameters.
Each unit's forward waits for its own (see [Note: each unit waits for its own gather] in ``schedule/arrivals.py``;
``begin_step`` waits for the units compiled code reads, so a compiled forward never meets these classes);
Lightning's loop in between (``on_train_batch_end``, logging, the next batch's agreement and fetch,
``on_train_batch_start``) runs while the gathers travel; and any
code that reads values earlier (a callback reading weights, ``state_dict()``, ``copy.deepcopy``, a write,
rebinding ``.data``) waits first and sees exactly what it saw before. The engine's own readers
(``full_flat``, the next optimizer step's ``_enter_shards``, ``release``, a load) call ``_finish_gather``
first. Unlike a hidden stage-3 parameter (see [Note: reading a sharded parameter] in ``placeholder.py``),
nothing is gathered on a read: the values are already travelling to every rank, so a read on one rank only
is local and cannot pair with another rank's collective.

On CUDA the gathers run on the communication stream and ``Pending.wait`` makes the current stream wait for
them (no host sync); a host read afterwards (``.item()``) synchronises as it always does. The cost when
nothing reads early: two class assignments per parameter per step.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from torch import nn

from lightning_zero.engine.core.placeholder import METADATA, is_hidden, leaves, passthrough

_ARRIVING_METADATA: frozenset[Any] = METADATA - {torch.Tensor.data.__set__, torch.Tensor.untyped_storage}


class _Arriving:
    """Mixed into a parameter's class while an all-gather into its storage is in flight (see the note above)."""

    __slots__ = ()
    _unit: weakref.ref[ArrivingUnit]
    _visible: type

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _ARRIVING_METADATA:
            with passthrough():
                return func(*args, **kwargs)
        for param in leaves((args, kwargs)):
            if isinstance(param, _Arriving):
                unit = type(param)._unit()
                if unit is not None and any(param is p for p in unit.params):
                    unit.wait_gather()  # settles every parameter of the unit
                if isinstance(param, _Arriving):  # a copy of one (``copy.deepcopy``), or its unit is gone
                    param.__class__ = type(param)._visible
        return func(*args, **kwargs)  # no argument is of this class any more: dispatched as usual


class ArrivingUnit(Protocol):
    """The unit whose gather a parameter waits for: a ``ShardedUnit`` (``unit.py``), named by its shape."""

    params: list[nn.Parameter]

    def wait_gather(self) -> None: ...


def arrive(params: list[nn.Parameter], unit: ArrivingUnit, classes: dict[type, type]) -> None:
    """Switch ``params`` (of ``unit``, whose gather is in flight) to classes that wait for it on use (``classes``
    caches them per original class; see [Note: parameters whose values are on their way]).

    Example::

        arrive(unit.params, unit, unit._arriving_classes)   # the gather into the parameters is in flight
        ...
        settle(unit.params)                                 # once it is waited for
    """
    for param in params:
        cls = type(param)
        if isinstance(param, _Arriving) or is_hidden(param):
            continue
        arriving = classes.get(cls)
        if arriving is None:
            arriving = classes[cls] = type(
                f"Arriving{cls.__name__}",
                (_Arriving, cls),
                {"__slots__": (), "_unit": weakref.ref(unit), "_visible": cls},
            )
        param.__class__ = arriving


def settle(params: list[nn.Parameter]) -> None:
    """Switch ``params`` back from their arriving classes (idempotent)."""
    for param in params:
        if isinstance(param, _Arriving):
            param.__class__ = type(param)._visible
