"""The engine's hooks on the user's modules, and what a copy or a pickle of a module makes of them.

[Note: copies of a sharded module]
``copy.deepcopy(model)`` (an EMA callback, a frozen teacher, a "best model" kept in memory) and
``torch.save(submodule)`` copy or pickle a module together with its hook dictionaries. Under DDP the
module has none of the strategy's hooks (DDP wraps it from outside); here the engine's hooks sit on the
user's modules themselves (stage 3's gather and release, the state-dict gatherer and the shard loader of
every stage), and they belong to the original: they hold its units and process groups, which neither copy
nor pickle, and in a copy they would act on the original's shards. So every such hook is an
``EngineHook``, whose copy and whose pickle are ``detached_hook``, a module-level function that does
nothing. A copy is then a plain module: its parameters are the values they read (a stage-3 parameter
whose unit is sharded copies as its gathered values, in storage of its own: see [Note: reading a sharded
parameter] in ``placeholder.py``), and it trains, saves and loads as a module that never met the engine.

The copy's hook dictionaries keep an entry per detached hook (they cannot be told to drop one while they
are copied), so a module pickled from a sharded model names ``detached_hook`` by reference: loading it
with ``torch.load(..., weights_only=False)`` needs lightning_zero importable, as it needs the module's own
class. ``state_dict()`` is the portable way to save, as under DDP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def detached_hook(*_args: Any, **_kwargs: Any) -> None:
    """What an engine hook becomes in a copy or a pickle of its module: nothing (see the note above)."""
    return None


class EngineHook:
    """A hook the engine registers on a user's module: called as the function it wraps; copied or pickled
    as ``detached_hook`` (see [Note: copies of a sharded module]).

    Example::

        module.register_forward_pre_hook(EngineHook(gather_unit))
        copy.deepcopy(module)          # a plain module: its copy of the hook does nothing
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn  # not __slots__: torch marks some hooks with an attribute (``_from_public_api``)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, _memo: dict[int, Any]) -> Callable[..., None]:
        return detached_hook

    def __reduce__(self) -> str | tuple[Any, ...]:
        return (_detached, ())


def _detached() -> Callable[..., None]:
    return detached_hook
