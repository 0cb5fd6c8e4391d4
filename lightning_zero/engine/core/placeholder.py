"""What a stage-3 parameter answers while its unit is sharded: metadata as under DDP, values gathered on
a read that every rank makes, and a clear error for what cannot be given.

[Note: reading a sharded parameter]
While its unit is sharded, a stage-3 parameter's ``.data`` is a placeholder (see [Note: parameters
outside their unit's use] in ``unit.py``), and the parameter object itself is switched to a subclass of
its own class (``hide``; ``reveal`` switches it back when the unit is gathered). The subclass defines
``__torch_function__``, so every torch function or method that receives the parameter comes here
first, and is answered by what it needs:

- **metadata** (``shape``, ``dtype``, ``device``, ``numel()``, ``requires_grad``, ``.grad``, hooks,
  ``data_ptr()``, ``is_shared()``): answered from the placeholder, exactly as DDP would, at no cost.
  ``ModelSummary``, optimizers' constructors, freezing (``requires_grad_``) and Lightning's checks
  only ever ask these.
- **a read of values** (``p.norm()``, ``p.detach().cpu()``, ``torch.equal(a.data, b.data)``,
  ``copy.deepcopy``): the units of the sharded parameters among the arguments are gathered (one
  all-gather each, in unit order, checked against the other ranks like any collective outside a step:
  see [Note: collective checks] in ``sequence.py``), the function runs on the gathered values, and the
  gathered copy is freed with the result. A read on every rank (a hook, ``on_fit_start``, a metric over
  the weights) gives DDP's value; a read on one rank only (``if trainer.is_global_zero: print(p.sum())``)
  is a collective the other ranks do not issue, and ends as a ``CollectiveMismatchError`` or a stall
  report naming the read, never as a hang or a wrong value. What a read returns that still points
  into the gathered copy (``p.data``, ``p.detach()``, ``p[0]``, ``p.view(-1)``) is a read-only tensor:
  a write into it (``p.data.clamp_(...)``), which under DDP would change the parameter and here would be
  lost, raises ``ShardedParameterWriteError`` instead of being dropped.
- **a write** (an in-place method of the parameter, ``out=`` the parameter, ``p[...] = x``): refused
  with ``ShardedParameterWriteError``, naming ``gathered_parameters()`` (which writes back into the
  shards). Rebinding ``p.data = x`` stays allowed: the engine takes the new values over (see
  ``ShardedUnit.adopt_rebound_data``).
- **a read that autograd records** (the parameter requires a gradient and gradients are enabled, as
  in any Lightning hook): served, but the gathered copy is not the parameter, so a gradient could not
  reach it. The copy therefore enters the computation through a node whose backward raises
  ``ShardedParameterReadError`` (an L2 penalty over ``self.parameters()`` in ``training_step`` would
  otherwise train silently without it); a read that is only logged or compared never runs backward.
- ``repr`` and formatting describe the parameter without reading it (printing on one rank must not
  become a collective).

The subclass is created once per unit and per parameter class (``type(p)`` is an ``nn.Parameter``
subclass meanwhile, ``isinstance`` checks are unaffected), and switching costs one attribute
assignment per parameter at each ``reshard`` / gather: nothing on the forward's hot path, where the
parameters are revealed and plain. The engine's own accesses to hidden parameters run under
``passthrough()`` (torch's ``DisableTorchFunctionSubclass``), which skips all of this.

FSDP2 reaches the same end with DTensor parameters (a read is a collective on every rank; on one rank,
a hang); DeepSpeed's empty placeholders read as a silently wrong shape.

A stage-1 or stage-2 parameter whose refresh after the step is still in flight switches class the same way
(``arriving.py``).
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from torch import nn

from lightning_zero.engine.errors import (
    ShardedConversionError,
    ShardedParameterReadError,
    ShardedParameterWriteError,
)

_T = torch.Tensor
# Answered from the placeholder: what a function may ask of a parameter without reading its values.
METADATA: frozenset[Any] = frozenset(
    {
        _T.shape.__get__,
        _T.dtype.__get__,
        _T.device.__get__,
        _T.layout.__get__,
        _T.ndim.__get__,
        _T.requires_grad.__get__,
        _T.requires_grad.__set__,
        _T.grad.__get__,
        _T.grad.__set__,
        _T.grad.__delete__,
        _T.is_leaf.__get__,
        _T.retains_grad.__get__,
        _T.grad_fn.__get__,
        _T._version.__get__,
        _T.is_cuda.__get__,
        _T.is_cpu.__get__,
        _T.is_meta.__get__,
        _T.is_sparse.__get__,
        _T.is_quantized.__get__,
        _T.is_nested.__get__,
        _T.itemsize.__get__,
        _T.nbytes.__get__,
        _T.data.__set__,  # rebinding: taken over by the engine (ShardedUnit.adopt_rebound_data)
        _T.size,
        _T.dim,
        _T.numel,
        _T.nelement,
        _T.element_size,
        _T.stride,
        _T.storage_offset,
        _T.is_contiguous,
        _T.is_floating_point,
        _T.is_complex,
        _T.is_signed,
        _T.is_inference,
        _T.is_shared,
        _T.is_pinned,
        _T.data_ptr,
        _T.untyped_storage,
        _T.get_device,
        _T.requires_grad_,
        _T.retain_grad,
        _T.register_hook,
        _T.register_post_accumulate_grad_hook,
        _T.__len__,
        _T.__hash__,
        # New tensors shaped like the parameter (optimizers' state at construction: Adagrad's ``full_like``).
        torch.zeros_like,
        torch.ones_like,
        torch.empty_like,
        torch.full_like,
        torch.rand_like,
        torch.randn_like,
        torch.randint_like,
        _T.new_empty,
        _T.new_zeros,
        _T.new_ones,
        _T.new_full,
        torch._has_compatible_shallow_copy_type,
        torch.is_tensor,
        torch.is_floating_point,
        torch.is_complex,
        torch.numel,
    }
)
_DESCRIBE = frozenset({_T.__repr__, _T.__str__, _T.__format__})
# Reads that autograd does not record, so they are served even where the parameter requires a gradient.
_NO_GRAD_READS = frozenset({_T.detach, _T.data.__get__, _T.tolist, _T.item, _T.numpy, _T.__bool__, torch.equal})
_IN_PLACE_EXCEPTIONS = frozenset({"requires_grad_", "share_memory_"})


class HidingUnit(Protocol):
    """The unit that hides its parameters: a ``ShardedUnit`` (``unit.py``), named here by its shape so that the two
    modules do not import each other."""

    name: str
    params: list[nn.Parameter]
    param_names: list[str]

    def read_values(self, params: list[nn.Parameter]) -> list[torch.Tensor]: ...


def passthrough() -> torch._C.DisableTorchFunctionSubclass:
    """A context in which hidden parameters behave as plain tensors (their placeholders): for the engine's own
    accesses. Example::

        with passthrough():
            previous = [p.data for p in unit.params]
    """
    return torch._C.DisableTorchFunctionSubclass()


class _Hidden:
    """Mixed into a parameter's class while its unit is sharded (see the note above)."""

    __slots__ = ()
    _unit: weakref.ref[HidingUnit]
    _visible: type

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in METADATA:
            with passthrough():
                if func is _DATA_SET:  # ``module.to(torch.float64)`` rebinds each parameter's data
                    check_conversion(_where(args[0]), args[0], args[1].dtype, args[1].device)
                return func(*args, **kwargs)
        hidden = _hidden_in((args, kwargs))
        if not hidden:  # only copies of hidden parameters (``copy.deepcopy``), made plain on the way
            with passthrough():
                return func(*args, **kwargs)
        if func in _DESCRIBE:
            return _describe(hidden[0])
        if func is torch.equal and len(args) == 2 and all(isinstance(a, torch.Tensor) for a in args):
            with passthrough():  # Lightning's BaseFinetuning compares parameters pairwise: most pairs need no values
                if args[0] is args[1]:
                    return True
                if args[0].shape != args[1].shape:
                    return False
        if _writes(func, args, kwargs, hidden):
            raise _write_error(hidden[0])
        return _read(func, args, kwargs, hidden)

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Parameter:
        # A copy has real data of its own: a parameter of the visible class, with the gathered values.
        if id(self) in memo:
            return memo[id(self)]
        values = self.detach()  # a read (see the note above)
        with passthrough():
            copy = type(self)._visible(values.clone(memory_format=torch.preserve_format), self.requires_grad)
        memo[id(self)] = copy
        return copy

    def __reduce_ex__(self, protocol: int) -> Any:
        # Pickled (``torch.save(module)``) as that copy: the visible class, the gathered values in storage of their
        # own (``p.data`` would pickle the whole gathered unit it is a view of), no hooks (see [Note: copies of a
        # sharded module] in ``hooks.py``).
        return self.__deepcopy__({}).__reduce_ex__(protocol)


_DATA_SET = _T.data.__set__


def check_conversion(where: str, old: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    """Raise ``ShardedConversionError`` if ``dtype`` or ``device`` (of data given to a sharded parameter, or of a
    gradient's conversion) is not ``old``'s: ``module.to(...)`` during training, which the shards cannot follow."""
    if dtype != old.dtype or torch.device(device) != old.device:
        raise ShardedConversionError(where, f"{old.dtype} on {old.device}", f"{dtype} on {torch.device(device)}")


def _hidden_in(tree: Any) -> list[nn.Parameter]:
    """The hidden parameters among ``tree``'s leaves (arguments, lists of tensors, keyword arguments). A tensor of
    a hidden class that is not its unit's parameter (a ``copy.deepcopy`` of one, whose data is real) is switched back
    to its own class instead."""
    found: list[nn.Parameter] = []
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, _Hidden):
            if owner_of(item)[1] is None:
                item.__class__ = type(item)._visible
            elif not any(item is f for f in found):
                found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found


def _writes(func: Any, args: tuple, kwargs: dict, hidden: list[nn.Parameter]) -> bool:
    name = getattr(func, "__name__", "")
    if func is _T.__setitem__:
        return bool(args) and any(args[0] is p for p in hidden)
    if name.endswith("_") and not name.endswith("__") and name not in _IN_PLACE_EXCEPTIONS:
        return bool(args) and any(args[0] is p for p in hidden)
    out = kwargs.get("out")
    return out is not None and bool(_hidden_in(out))


def owner_of(param: nn.Parameter) -> tuple[HidingUnit | None, str | None]:
    """The unit a hidden parameter belongs to and its name there; ``(unit, None)`` if it is not one of the unit's
    parameters (a copy), ``(None, "?")`` if the unit no longer exists."""
    unit = type(param)._unit()
    if unit is None:
        return None, "?"
    for p, name in zip(unit.params, unit.param_names):
        if p is param:
            return unit, name
    return unit, None


def _where(param: nn.Parameter) -> str:
    unit, name = owner_of(param)
    return f"parameter {name!r} (unit {unit.name!r})" if unit is not None else "a stage-3 parameter"


def _describe(param: nn.Parameter) -> str:
    with passthrough():
        shape, dtype = tuple(param.shape), param.dtype
    return (
        f"Parameter(sharded by lightning_zero stage 3: {_where(param)}, shape={shape}, dtype={dtype}; its values "
        "are read on every rank, or inside strategy.gathered_parameters())"
    )


def _write_error(param: nn.Parameter | str, read: bool = False) -> Exception:
    where = param if isinstance(param, str) else _where(param)
    what = (
        f"values read from {where} outside its module's forward (a gathered copy) were written in place"
        if read
        else f"{where} was written in place outside its module's forward"
    )
    return ShardedParameterWriteError(
        f"{what}, while its unit is sharded (stage 3), so the write would be lost. Write inside "
        "`with trainer.strategy.gathered_parameters(module):` (or ShardedModel.gathered_parameters), which writes "
        "back into the shards, or load values with module.load_state_dict(...)."
    )


def _grad_read_text(param: nn.Parameter) -> str:
    return (
        f"a gradient was to flow into {_where(param)} through a read made outside its module's forward, while its "
        "unit was sharded (stage 3): the read was served from a gathered copy, which cannot pass a gradient on to "
        "the parameter, so the step would silently miss it. Use the parameter inside its module's forward (or let "
        "the LightningModule own it directly: parameters of the root unit stay gathered for the whole step), or "
        "read it under torch.no_grad() or through .detach() if no gradient is wanted."
    )


class _Unreachable(torch.autograd.Function):
    """A gathered copy that requires a gradient it cannot pass on: backward raises (see the note above)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, anchor: torch.Tensor, text: str) -> torch.Tensor:
        ctx.text = text
        return value.clone()

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise ShardedParameterReadError(ctx.text)


class _GatheredCopy(torch.Tensor):
    """A view of the gathered copy a read was served from: readable like any tensor, refuses writes (they would
    be lost: the parameter's values live in the shards). See the note above."""

    _source: str

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        copies = [t for t in leaves((args, kwargs)) if isinstance(t, _GatheredCopy)]
        if func in _DESCRIBE or func in METADATA or func is _T.__hash__:
            with passthrough():
                return func(*args, **kwargs)
        if _writes(func, args, kwargs, copies):
            raise _write_error(copies[0]._source, read=True)
        with passthrough():
            result = func(*args, **kwargs)
            storages = {c.untyped_storage().data_ptr() for c in copies}
            return _keep_read_only(result, storages, copies[0]._source)


def leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree``: its items, through nested lists, tuples and dict values.

    Example::

        leaves((args, kwargs))   # every argument of a torch call, keyword arguments included
    """
    found, stack = [], [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        else:
            found.append(item)
    return found


def _keep_read_only(result: Any, storages: set[int], source: str) -> Any:
    """``result``, with every tensor in it that points into one of ``storages`` made a ``_GatheredCopy``."""
    if isinstance(result, torch.Tensor) and not isinstance(result, _GatheredCopy):
        if result.untyped_storage().data_ptr() in storages and result.grad_fn is None:
            copy = result.as_subclass(_GatheredCopy)
            copy._source = source
            return copy
        return result
    if isinstance(result, (list, tuple)) and not isinstance(result, torch.Size):
        items = [_keep_read_only(item, storages, source) for item in result]
        return type(result)(items) if not hasattr(result, "_fields") else type(result)(*items)
    return result


def _read(func: Any, args: tuple, kwargs: dict, hidden: list[nn.Parameter]) -> Any:
    """Run ``func`` on the gathered values of the hidden parameters among its arguments."""
    owners: dict[int, tuple[HidingUnit, list[nn.Parameter]]] = {}
    for param in hidden:
        unit, _ = owner_of(param)
        if unit is None:
            raise ShardedParameterReadError(
                "a stage-3 parameter whose sharded model no longer exists was read; rebuild the model, or read "
                "the weights from a checkpoint (lightning_zero.consolidate_checkpoint)"
            )
        owners.setdefault(id(unit), (unit, []))[1].append(param)
    values: dict[int, torch.Tensor] = {}
    recorded = torch.is_grad_enabled() and func not in _NO_GRAD_READS
    for unit, params in sorted(owners.values(), key=lambda entry: entry[0].name):  # the same order on every rank
        views = unit.read_values(params)
        for param, view in zip(params, views):
            if recorded and param.requires_grad:
                view = _Unreachable.apply(view, torch.empty(0, requires_grad=True), _grad_read_text(param))
            values[id(param)] = view
    with passthrough():
        result = func(*_substitute(args, values), **_substitute(kwargs, values))
        storages = {view.untyped_storage().data_ptr() for view in values.values()}
        return _keep_read_only(result, storages, _where(hidden[0]))


def _substitute(tree: Any, values: dict[int, torch.Tensor]) -> Any:
    if isinstance(tree, _Hidden):
        return values[id(tree)]
    if isinstance(tree, (list, tuple)) and not isinstance(tree, torch.Size):
        items = [_substitute(item, values) for item in tree]
        return type(tree)(items) if not hasattr(tree, "_fields") else type(tree)(*items)
    if isinstance(tree, dict):
        return {key: _substitute(item, values) for key, item in tree.items()}
    return tree


def hide(params: list[nn.Parameter], unit: HidingUnit, classes: dict[type, type]) -> None:
    """Switch ``params`` (of ``unit``) to their hidden classes (``classes`` caches them per original class)."""
    for param in params:
        cls = type(param)
        if isinstance(param, _Hidden):
            continue
        hidden = classes.get(cls)
        if hidden is None:
            hidden = classes[cls] = type(
                f"Sharded{cls.__name__}", (_Hidden, cls), {"__slots__": (), "_unit": weakref.ref(unit), "_visible": cls}
            )
        param.__class__ = hidden


def reveal(params: list[nn.Parameter]) -> None:
    """Switch hidden ``params`` back to their own classes (idempotent)."""
    for param in params:
        if isinstance(param, _Hidden):
            param.__class__ = type(param)._visible


def is_hidden(tensor: Any) -> bool:
    """Whether ``tensor`` is a stage-3 parameter whose unit is sharded (its class switched by ``hide``).

    Example::

        hide(unit.params, unit, classes)
        assert is_hidden(unit.params[0])
    """
    return isinstance(tensor, _Hidden)


def has_hidden_parameters(module: nn.Module) -> bool:
    """Whether some parameter of ``module`` is a stage-3 parameter whose unit is sharded."""
    return any(isinstance(p, _Hidden) for p in module.parameters())


def refuse_module_sharded_elsewhere(module: nn.Module) -> None:
    """Raise if ``module`` still holds parameters that another sharded model keeps sharded (a module kept sharded
    after a run, set up again by another strategy or Trainer): they cannot be read whole, nor sharded again."""
    hidden = [name for name, p in module.named_parameters() if isinstance(p, _Hidden)]
    if hidden:
        raise ValueError(
            f"{len(hidden)} parameter(s) of this module (first: {hidden[0]!r}) are still sharded by the lightning_zero "
            "strategy of an earlier run, which kept them sharded because they do not fit whole. Run "
            "validate/test/predict with the Trainer that trained it, or save a checkpoint there "
            "(trainer.save_checkpoint) and load it into a new model."
        )
