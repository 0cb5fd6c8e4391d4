"""Peak bytes of tensor storage allocated inside a block of code, on any device (CPU included).

``LiveStorageBytes`` is a ``TorchDispatchMode``: it sees every tensor that every aten op (factory
functions, copies, collectives) returns inside the block, keeps a weak reference to it, and after
each op adds up the current size of the distinct storages still alive. A storage resized to zero
bytes (a stage-3 unit released) counts as zero from then on; a tensor dropped stops counting.
Tensors created before the block are not counted, so the figure is what the block added.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveStorageBytes(TorchDispatchMode):
    """Example::

    with LiveStorageBytes() as tracker:
        build_model()
    tracker.peak  # bytes
    """

    def __init__(self) -> None:
        super().__init__()
        self._tensors: list[weakref.ref[torch.Tensor]] = []
        self._allocated: set[int] = set()
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        inputs = {_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and not t.is_meta}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            key = _key(t)
            # A new storage, or a view of one allocated inside the block (views of older tensors are not counted).
            if key not in inputs or key in self._allocated:
                self._allocated.add(key)
                self._tensors.append(weakref.ref(t))
        self.peak = max(self.peak, self.current())
        return out

    def current(self) -> int:
        storages: dict[int, int] = {}
        alive = []
        for ref in self._tensors:
            t = ref()
            if t is None:
                continue
            alive.append(ref)
            storage = t.untyped_storage()
            storages[_key(t)] = storage.nbytes()
        self._tensors = alive
        return sum(storages.values())


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the StorageImpl: the same for every view of it
