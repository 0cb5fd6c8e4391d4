"""``torch.compile`` and the engine: what runs inside compiled graphs, and what stays outside.

[Note: torch.compile]
``torch.compile(module)`` and ``module.compile()`` both run ``module``'s own hooks eagerly and compile
its ``forward``. Inside that ``forward``, Dynamo inlines the call of every submodule, *with its hooks*.
The stage-3 forward hooks (``stage3.py``) of a unit called from compiled code must not be traced:

- they issue collectives. Traced, Dynamo swaps the gloo broadcasts of an all-gather for functional
  collectives and runs it on fake tensors, which fails at the first compile
  (``TorchRuntimeError: ... making fake tensor call``: what a traced hook raises);
- they resize storages and read Python state that changes from call to call (which units are
  gathered, held or prefetched, the order recorded on the first step): traced, each such value would
  become a guard (a recompile) or be frozen into the graph at the value it had when traced.

So every stage-3 module hook is wrapped in ``torch.compiler.disable`` (``outside_graphs``), as FSDP2
does with its own hooks. Dynamo cannot trace across such a call: its graph ends where a unit's module
is called, the hooks run eagerly, and the unit's own ``forward`` is compiled as a frame of its own
(its parameters are gathered by then). So:

- **Stages 1 and 2** install no module hook inside compiled code (their gradient hooks fire in autograd's
  engine after the compiled backward produced the gradient; the forward pre-hooks that wait for each unit's
  post-step gather go only on modules outside compiled code, and do nothing when traced: see [Note: each unit
  waits for its own gather] in ``arrivals.py``): a compiled module gives DDP's graphs.
- **Stage 3** breaks the graph wherever compiled code calls a unit. With one unit per module that owns
  parameters (``unit_modules=[nn.Linear, nn.LayerNorm, ...]``), each ``Linear`` and ``LayerNorm`` is one, so
  little is fused. With transformer blocks as units (``unit_modules=[Block]``, or the default's repeated
  blocks) and each block compiled, a block contains no other unit: one graph per block, as DDP's, and
  ``fullgraph=True`` works.
- A graph break inside a loop (``for block in self.blocks``) makes Dynamo run that whole frame eagerly
  and compile the frames it calls instead: compiling a whole model under stage 3 compiles, in effect,
  the code of each unit.

Compiled code reads the same tensors eager code does, so the stage-3 rules for reading parameters
outside their unit's forward apply to it unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from lightning_zero.engine.core.hooks import EngineHook

_REASON = (
    "a lightning_zero stage-3 hook: it gathers or frees a unit's parameters, with collectives, so it runs eagerly "
    "and the graph breaks at the unit. For one graph without breaks (fullgraph=True), make each compiled module "
    "a unit that contains no other: ZeRO3Strategy(unit_modules=[TheCompiledClass])"
)
# Dynamo prints ``reason`` in its graph-break messages; torch.compiler.disable takes it from torch 2.7 on.
_DISABLE_KWARGS = {"reason": _REASON} if "reason" in inspect.signature(torch.compiler.disable).parameters else {}


class _EagerHook(EngineHook):
    """An engine hook that runs eagerly even when compiled code calls it. Disabling the class's ``__call__`` (not
    the wrapped function) is what lets a block compiled with ``fullgraph=True`` call it: Dynamo skips a disabled
    ``__call__`` as it skips a disabled function given as the hook, where a call into an object that then calls
    a disabled function is a graph break."""

    __call__ = torch.compiler.disable(EngineHook.__call__, **_DISABLE_KWARGS)


def outside_graphs(hook: Callable[..., object]) -> EngineHook:
    """``hook``, run eagerly even when compiled code calls it: Dynamo ends its graph before the call and
    resumes after it (see [Note: torch.compile]); copied and pickled as a detached hook (see [Note: copies of a
    sharded module] in ``engine/core/hooks.py``).

    Example::

        module.register_forward_pre_hook(outside_graphs(gather_unit))
    """
    return _EagerHook(hook)


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs as compiled code (``torch.compile(module)`` or ``module.compile()``)."""
    return hasattr(module, "_orig_mod") or getattr(module, "_compiled_call_impl", None) is not None


def modules_in_compiled_code(root: torch.nn.Module) -> set[int]:
    """The ids of ``root``'s modules that run inside compiled code now: each compiled module and what it contains."""
    inside: set[int] = set()
    for module in root.modules():
        if is_compiled(module):
            inside.update(id(m) for m in module.modules())
    return inside
