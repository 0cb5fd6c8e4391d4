"""Keep one system's global changes out of the next system's measurements.

The systems share processes, and some patch torch globally: DeepSpeed ZeRO-3 replaces
``torch.nn.functional.linear`` with its own autograd function and leaves it there after its engine
is gone, so every later ``nn.Linear`` (DDP's, ours) would run through DeepSpeed's code.
``GlobalsGuard`` records the attributes of a few namespaces before a system is built and puts back
any that changed once it is closed, reporting which.

Attributes that appear while a system runs are left alone (importing a submodule adds one to its
package), and so are submodules themselves: only replaced values are restored.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed
import torch.nn.functional
from torch import nn


def _namespaces() -> list[Any]:
    return [
        torch,
        torch.nn.functional,
        torch.distributed,
        torch.Tensor,
        nn.Module,
        nn.Parameter,
        nn.Linear,
        nn.Embedding,
        nn.LayerNorm,
    ]


class GlobalsGuard:
    """Example::

    guard = GlobalsGuard()            # before building a system
    ...                               # build, train, close it
    restored = guard.restore()        # e.g. ["torch.nn.functional.linear"]
    """

    def __init__(self) -> None:
        self._saved = [(ns, dict(vars(ns))) for ns in _namespaces()]

    def restore(self) -> list[str]:
        restored = []
        for namespace, saved in self._saved:
            now = vars(namespace)
            for name, value in saved.items():
                if isinstance(value, types.ModuleType) or name.startswith("__"):
                    continue
                if name in now and now[name] is not value:
                    setattr(namespace, name, value)
                    restored.append(f"{getattr(namespace, '__name__', namespace)}.{name}")
        return restored
