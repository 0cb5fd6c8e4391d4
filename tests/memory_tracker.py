"""Peak bytes of tensor storage allocated inside a block of code, on any device (CPU included).

``LiveStorageBytes`` is a ``TorchDispatchMode``: it sees every tensor that every aten op (factory
functions, copies, collectives) returns inside the block, keeps a weak reference to it, and after
each op adds up the current size of the distinct storages still alive. A storage resized to zero
bytes (a stage-3 unit released) counts as zero from then on; a tensor dropped stops counting.
Tensors created before the block are not counted, so the figure is what the block added.

``live_storages`` / ``live_bytes_since`` count differently: every tensor storage the Python heap
reaches at one moment (parameters, their ``.grad``, optimizer states, buffers an engine keeps), for
"live memory now" without tracking a block of code.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
from torch import nn
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


def live_storages() -> dict[tuple[str, int], tuple[int, Any]]:
    """Every tensor storage the Python heap reaches now (each once, any device): its bytes and the storage itself.
    Storages only C++ holds (DDP's own gradient buckets) are not seen, which flatters DDP, the denominator.

    The storages are held, not a weak reference to one tensor on each: a storage alive at ``before`` in
    ``live_bytes_since`` must never count as new, and a weakly referenced tensor (a view, a placeholder) can die
    while other tensors keep its storage alive, which then counted as new."""
    gc.collect()
    seen: dict[tuple[str, int], tuple[int, Any]] = {}
    tensors = [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]
    # A ``.grad`` that autograd set has no Python object until someone reads it: read it.
    tensors += [t.grad for t in tensors if isinstance(t, nn.Parameter) and t.grad is not None]
    for tensor in tensors:
        if tensor.is_meta:
            continue
        try:
            storage = tensor.untyped_storage()
            seen[(str(tensor.device), storage.data_ptr())] = (storage.nbytes(), storage)
        except (RuntimeError, NotImplementedError, TypeError):  # a tensor subclass without storage (a marker)
            continue
    return seen


def live_bytes_since(before: dict[tuple[str, int], tuple[int, Any]]) -> int:
    """Bytes of every storage alive now (see ``live_storages``) but those already alive at ``before`` (which holds
    them, so their addresses cannot be reused meanwhile)."""
    return sum(size for key, (size, _) in live_storages().items() if key not in before)
