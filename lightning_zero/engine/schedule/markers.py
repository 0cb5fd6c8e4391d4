"""The module's ``param.grad`` while the reduced gradient exists only as this rank's shard: a marker.

[Note: gradient markers]
The user's optimizer holds the module's parameters (see [Note: parameters outside their unit's
use] in ``unit.py``), so ``optimizer.zero_grad()`` only ever sees the module's ``param.grad``. To
keep its meaning exact, a parameter whose sharded gradient exists carries a ``GradMarker`` as its
``.grad``: a tensor subclass with the parameter's shape, dtype and device and no memory, so
``p.grad is not None`` answers as under DDP. ``zero_grad()`` removes it (``set_to_none=True``) or
zeroes it (``set_to_none=False``: the marker records the ``zero_`` instead of doing it); either
tells the next reduction to start the sharded gradient afresh, while an intact marker means
"accumulate" (gradient accumulation, or two backward passes before a step). A tensor hook takes
the marker off before autograd accumulates a new gradient into it. Any other use of a marker
(``grad_norm(module)``, ``clip_grad_norm_(module.parameters())``) raises
``ShardedGradientError``, which says what to call instead: the full gradient does not exist.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_zero.engine.core.placeholder import check_conversion
from lightning_zero.engine.errors import ShardedGradientError

_aten = torch.ops.aten


class GradMarker(torch.Tensor):
    """A module parameter's ``.grad`` while its reduced gradient exists as this rank's shard (see
    [Note: gradient markers]): shaped like the parameter, no memory; ``zero_()`` is recorded, anything
    else raises ``ShardedGradientError``.

    Example::

        param.grad = GradMarker(param)
        param.grad.zero_()            # what zero_grad(set_to_none=False) does
        assert param.grad.zeroed
    """

    zeroed: bool

    @staticmethod
    def __new__(cls, param: torch.Tensor) -> GradMarker:
        marker = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device)
        marker.zeroed = False
        return marker

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"GradMarker(shape={tuple(self.shape)}, dtype={self.dtype}, zeroed={self.zeroed})"

    def __deepcopy__(self, memo: dict) -> GradMarker:
        copy = GradMarker(self)
        copy.zeroed = self.zeroed
        return copy

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _aten.zero_.default:
            args[0].zeroed = True
            return args[0]
        if func is _aten._foreach_zero_.default:
            for tensor in args[0]:
                if isinstance(tensor, GradMarker):
                    tensor.zeroed = True
                else:
                    tensor.zero_()
            return None
        if func is _aten._to_copy.default:  # ``module.to(...)`` converts every .grad after its parameter
            marker, kwargs = args[0], kwargs or {}
            where = f"the .grad of a parameter of shape {tuple(marker.shape)}"
            check_conversion(where, marker, kwargs.get("dtype") or marker.dtype, kwargs.get("device") or marker.device)
        raise ShardedGradientError(
            f"{func.__name__} on the .grad of a parameter of shape {tuple(args[0].shape) if args else '?'}: under ZeRO "
            "the reduced gradient exists only as each rank's shard, so the module's .grad is a marker. For the "
            "gradient norm use trainer.strategy.grad_norm(); to clip, Trainer(gradient_clip_val=...) or "
            "self.clip_gradients(...); see docs/troubleshooting.md, 'The module's param.grad is not the reduced "
            "gradient'."
        )


class GradMarkers:
    """Each parameter's ``GradMarker``, and the parameters whose sharded gradient accumulates (see the note above):
    what ``GradReducer`` (``grads.py``) reads and writes of the module's ``.grad``.

    Example::

        markers = GradMarkers()
        markers.put_markers(unit.params, unit.shard_params)     # a marker where a shard holds a gradient
        optimizer.zero_grad()                                   # removes them
        markers.drop_unwanted(unit.params, unit.shard_params)   # and so the sharded gradients
    """

    def __init__(self) -> None:
        # Each parameter's marker, and the parameters whose marker was intact when a new gradient arrived (their
        # sharded gradient accumulates). Keyed by ``id(param)``: a tensor's own ``__hash__`` is a Python call, and
        # these are looked up per parameter per step. Every key is a parameter of the reducer's units, alive as long
        # as it is.
        self._markers: dict[int, GradMarker] = {}
        self.carry: set[int] = set()

    def take_marker(self, param: nn.Parameter) -> None:
        """Take ``param``'s marker off (if it has one), remembering whether its sharded gradient accumulates."""
        marker = param.grad
        if isinstance(marker, GradMarker):
            if not marker.zeroed:
                self.carry.add(id(param))
            param.grad = None

    def put_markers(self, params: list[nn.Parameter], shard_params: list[nn.Parameter]) -> None:
        """Show, for each parameter whose ``shard_param`` holds a sharded gradient, that it has one (``param.grad``
        becomes its marker). One call per unit: this runs on the step path, the marker's lookup inline."""
        markers = self._markers
        for param, shard_param in zip(params, shard_params):
            if shard_param.grad is None:
                continue
            marker = markers.get(id(param))
            if marker is not None:
                marker.zeroed = False
                try:
                    param.grad = marker  # autograd checks shape, dtype and device: a marker that no longer fits
                    continue  # is refused, and made again below
                except RuntimeError:
                    pass
            marker = markers[id(param)] = GradMarker(param)
            param.grad = marker

    def drop_unwanted(self, params: list[nn.Parameter], shard_params: list[nn.Parameter]) -> bool:
        """Forget the sharded gradients whose marker ``zero_grad()`` removed or zeroed since they were made (see
        ``has_marker``), and what this backward pass carried; ``True`` when no trainable parameter keeps one (the
        next ones are fresh, not added to earlier ones). One call per unit: ``has_marker`` inline."""
        carry = self.carry
        fresh = True
        for param, shard_param in zip(params, shard_params):
            marker = param.grad
            if not ((isinstance(marker, GradMarker) and not marker.zeroed) or id(param) in carry):
                shard_param.grad = None
            elif fresh and shard_param.grad is not None and param.requires_grad:
                fresh = False
            carry.discard(id(param))
        return fresh

    def is_marker(self, param: nn.Parameter) -> bool:
        """Whether ``param.grad`` is a marker (rather than ``None`` or a full gradient)."""
        return isinstance(param.grad, GradMarker)

    def has_marker(self, param: nn.Parameter) -> bool:
        """Whether ``param``'s sharded gradient is still wanted: its marker was neither removed nor zeroed by
        ``zero_grad()`` (or was taken off intact by this backward pass)."""
        marker = param.grad
        return (isinstance(marker, GradMarker) and not marker.zeroed) or id(param) in self.carry

    def clear_marker(self, param: nn.Parameter) -> None:
        """Take ``param``'s marker off and forget that its sharded gradient accumulates (it has none any more)."""
        if isinstance(param.grad, GradMarker):
            param.grad = None
        self.carry.discard(id(param))
