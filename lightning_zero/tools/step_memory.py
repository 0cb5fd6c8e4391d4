"""``StepMemory``: the tensor storage a block of code allocates, alive at each aten op, and its peak; the dry run's
peak in a step (see [Note: dry run] in ``dry_run.py``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_zero.engine.core.ledger import GatherLedger


class StepMemory(TorchDispatchMode):
    """Tensor storage a block of code allocates, alive at each aten op, and its peak, with stage 3's gathered units
    (``ledger``) beside it: the peak is the op where the two together are largest.

    [Note: peak bytes in a step]
    Every tensor an op returns on a storage that did not exist before the block (activations, what autograd saves,
    full gradients before their reduction, reduce-scatter buffers, the gradient shards produced, the optimizer's
    temporaries) is counted from the op that made it until its last tensor is gone (a weak reference per tensor,
    counted per storage). The gathered units are the ledger's: their buffers exist before the step and are resized,
    not allocated, so they are not counted twice. Model state at rest (parameters, masters, optimizer states) is
    what existed before and is added by the caller. Example::

        with StepMemory(sharded.gathered) as step:
            train_one_step()
        step.peak_allocated, step.gathered_at_peak
    """

    def __init__(self, ledger: GatherLedger) -> None:
        super().__init__()
        self._ledger = ledger
        self._before: set[int] = set()  # storages seen as inputs before they were made here: older than the block
        self._tensors: dict[int, int] = {}  # storage -> tensors alive on it
        self._bytes: dict[int, int] = {}
        self._refs: dict[int, Any] = {}  # the weak references themselves, kept alive (by id: they compare by value)
        self.allocated = 0
        self.peak_allocated = 0
        self.gathered_at_peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten((args, kwargs))[0]:
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                key = tensor.untyped_storage().data_ptr()
                if key not in self._tensors:
                    self._before.add(key)
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                self._track(tensor)
        gathered = self._ledger.current
        if self.allocated + gathered > self.peak_allocated + self.gathered_at_peak:
            self.peak_allocated, self.gathered_at_peak = self.allocated, gathered
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or (key in self._before and key not in self._tensors):
            return  # no memory, or a view or in-place result of a storage older than the block
        if key not in self._tensors:
            self._tensors[key] = 0
            self._bytes[key] = storage.nbytes()
            self.allocated += storage.nbytes()
        self._tensors[key] += 1

        def gone(ref: Any, key: int = key) -> None:
            self._refs.pop(id(ref), None)
            self._tensors[key] -= 1
            if self._tensors[key] == 0:
                del self._tensors[key]
                self.allocated -= self._bytes.pop(key)
                self._before.discard(key)  # the address may be handed out again

        ref = weakref.ref(tensor, gone)
        self._refs[id(ref)] = ref
