"""Bytes each rank sends, for the systems that do not count their own collectives.

Our engine counts its collectives in ``Comm.stats``; DDP, ``ZeroRedundancyOptimizer``, FSDP2 and
DeepSpeed do not. ``CommCounter`` counts theirs in two ways:

- a shim over the ``torch.distributed`` collectives that Python code calls as attributes of the
  package (``dist.all_gather_single(...)``, ``torch.distributed.reduce_scatter_tensor(...)``):
  FSDP2, ``ZeroRedundancyOptimizer`` and DeepSpeed's ``TorchBackend`` all call them that way;
- for DDP, whose C++ reducer reaches the process group without going through Python,
  ``register_counted_allreduce`` installs DDP's own default all-reduce as a communication hook,
  which issues the same all-reduces through ``dist.all_reduce``.

Bytes follow the same ring model as ``lightning_zero.engine.comm.comm`` (what the ZeRO paper's 2Ψ / 3Ψ
figures assume): an all-gather, reduce-scatter or all-to-all sends ``(N - 1) / N`` of the full
buffer, an all-reduce twice that, a reduce ``(N - 1) / N`` of the buffer (a reduce-scatter then a
gather to the root), a broadcast the whole buffer from its source only.

The shim replaces attributes of ``torch.distributed`` for the life of the (benchmark) process: it is
installed once, before DeepSpeed captures any of those functions, and counts only while
``active``. It is a measuring device for this benchmark, never something a library should do.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# name -> (kind, argument holding the tensor(s) whose size is "the full buffer")
_WRAPPED: dict[str, tuple[str, str]] = {
    "all_reduce": ("all_reduce", "tensor"),
    "all_reduce_coalesced": ("all_reduce", "tensors"),
    "reduce": ("reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "_all_gather_base": ("all_gather", "output_tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_coalesced": ("all_gather", "output_tensor_lists"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_reduce_scatter_base": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "all_to_all_single": ("all_to_all", "input"),
}


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def ring_bytes(kind: str, nbytes: int, world_size: int, is_source: bool = True) -> int:
    """Bytes one rank sends for one collective of ``kind`` over a buffer of ``nbytes``."""
    if world_size <= 1:
        return 0
    share = nbytes * (world_size - 1) // world_size
    if kind == "all_reduce":
        return 2 * share
    if kind == "broadcast":
        return nbytes if is_source else 0
    return share


class CommCounter:
    """Calls and bytes sent by this rank, per kind of collective.

    Example::

        counter = CommCounter()
        counter.install()                       # once per process, before DeepSpeed is initialised
        before = counter.bytes_sent
        ...                                     # run steps
        sent = counter.bytes_sent - before
        register_counted_allreduce(DistributedDataParallel(model))   # DDP's buckets, counted too
    """

    def __init__(self) -> None:
        self.bytes_by_kind: dict[str, int] = defaultdict(int)
        self.calls_by_kind: dict[str, int] = defaultdict(int)
        self.active = True
        self._local = threading.local()
        self._originals: dict[str, Callable[..., Any]] = {}

    @property
    def bytes_sent(self) -> int:
        return sum(self.bytes_by_kind.values())

    def counts(self) -> dict[str, tuple[int, int]]:
        """``{kind: (calls, bytes sent)}`` so far."""
        return {k: (self.calls_by_kind[k], self.bytes_by_kind[k]) for k in self.calls_by_kind}

    def add(self, kind: str, nbytes: int) -> None:
        if self.active:
            self.bytes_by_kind[kind] += nbytes
            self.calls_by_kind[kind] += 1

    def install(self) -> None:
        """Wrap the collectives of ``torch.distributed`` (idempotent)."""
        for name, (kind, arg) in _WRAPPED.items():
            original = getattr(dist, name, None)
            if original is None or name in self._originals:
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(original, kind, arg))

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, fn: Callable[..., Any], kind: str, arg: str) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "inside", False):  # one collective implemented through another
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            group = bound.arguments.get("group")
            world_size = dist.get_world_size(group)
            is_source = True
            if kind == "broadcast":
                src = bound.arguments.get("src")
                if src is None and bound.arguments.get("group_src") is not None:
                    src = dist.get_global_rank(group, bound.arguments["group_src"])
                is_source = src == dist.get_rank()
            self.add(kind, ring_bytes(kind, _nbytes(bound.arguments.get(arg)), world_size, is_source))
            self._local.inside = True
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.inside = False

        return counted


def register_counted_allreduce(ddp: torch.nn.parallel.DistributedDataParallel) -> None:
    """Make ``ddp`` all-reduce its buckets from Python (DDP's own default hook: average, one all-reduce
    per bucket), so that the shim counts them; the C++ reducer would otherwise bypass it."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
