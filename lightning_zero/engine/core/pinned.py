"""Pinned (page-locked) host memory of exactly the size asked for, and returned when its tensor dies.

[Note: exact pinned memory]
A copy between the device and host memory is asynchronous only when the host memory is pinned; the engine pins
the offloaded master and compute shards, the host gradients of ``offload_optimizer`` and the staging buffers of
asynchronous saves. ``torch.empty(..., pin_memory=True)`` and ``Tensor.pin_memory()`` take that memory from
torch's caching host allocator, which rounds every request up to a power of two (a 1.1 GiB shard pins 2 GiB) and
keeps a freed block for later requests instead of giving it back (until ``torch._C._host_emptyCache()``): up to
twice the pinned RAM, for as long as the process lives. DCP's stager (``StateDictStager`` in
``torch/distributed/checkpoint/_state_dict_stager.py``) pins exact sizes instead, and so does this module, the same
way: an ordinary (pageable) host tensor from the CPU allocator, its bytes registered with ``cudaHostRegister``
(``torch.cuda._pin_memory_utils.pin_memory``: the portable flag, page-locked for every context), and unregistered
by a finalizer on its storage, which runs when the last tensor that uses the storage is gone and before the memory
is freed (torch keeps a storage's Python object alive as long as the storage is). The finalizer does not run at
interpreter exit, where the CUDA context may already be gone (as DCP's). The driver tracks registrations by exact
byte range, so two buffers that share a page register apart; a registered range reads as pinned to
``Tensor.is_pinned()`` (``cudaPointerGetAttributes`` reports host memory), and a ``copy_(non_blocking=True)`` into
or out of it is a DMA transfer queued on the stream. (CUDA's documented behaviour, which DCP relies on; not yet
checked on a device here. On a CPU the finalizer's timing is: ``tests/test_offload.py``.)

Registering is slow (the pages are locked one by one, as ``cudaHostAlloc`` does), and ``cudaHostUnregister`` may
synchronise the device: a buffer is registered once and reused, never made per step. The per-step host gradients
are therefore taken from a ``PinnedPool`` (one per unit), whose buffers are handed out again once nothing else uses
them. On a build without CUDA nothing can be pinned; every function here takes the registration as an argument
(``HostRegistration``), so that what it asks for (the exact bytes, once per buffer) is testable on a CPU.

Example::

    host = pinned_empty((3, 5), torch.float32)       # 60 bytes registered, not 64
    pool = PinnedPool()
    grads = pool.take((1000,), torch.float32)        # the same buffer again once ``grads`` and its views are gone
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch


class HostRegistration(NamedTuple):
    """How host memory is pinned: ``register(pointer, bytes)`` and ``unregister(pointer)`` (CUDA's by default; a
    recording fake in tests)."""

    register: Callable[[int, int], None]
    unregister: Callable[[int], None]


def _cuda_register(pointer: int, nbytes: int) -> None:
    from torch.cuda import _pin_memory_utils

    _pin_memory_utils.pin_memory(pointer, nbytes)


def _cuda_unregister(pointer: int) -> None:
    from torch.cuda import _pin_memory_utils

    _pin_memory_utils.unpin_memory(pointer)


CUDA_HOST = HostRegistration(_cuda_register, _cuda_unregister)


def pinned_bytes(shape: Sequence[int] | torch.Size, dtype: torch.dtype) -> int:
    """The bytes a pinned buffer of ``shape`` and ``dtype`` registers: exactly its elements' (no rounding)."""
    numel = 1
    for size in shape:
        numel *= size
    return numel * dtype.itemsize


def pinned_empty(
    shape: Sequence[int] | torch.Size, dtype: torch.dtype, host: HostRegistration = CUDA_HOST
) -> torch.Tensor:
    """An uninitialised host tensor of ``shape`` and ``dtype`` whose exact bytes are pinned until it (and every view
    of it) is gone (see [Note: exact pinned memory])."""
    tensor = torch.empty(tuple(shape), dtype=dtype, device="cpu")
    nbytes = pinned_bytes(shape, dtype)
    if nbytes:  # nothing to register (and no pointer) for an empty tensor
        pointer = tensor.data_ptr()
        host.register(pointer, nbytes)
        finalizer = weakref.finalize(tensor.untyped_storage(), host.unregister, pointer)
        finalizer.atexit = False  # the CUDA context may be gone by then (as DCP's stager does)
    return tensor


def pinned_copy(
    source: torch.Tensor, dtype: torch.dtype | None = None, host: HostRegistration = CUDA_HOST
) -> torch.Tensor:
    """A pinned host copy of ``source`` (in ``dtype``, default its own), of exactly its size."""
    copy = pinned_empty(source.shape, dtype or source.dtype, host)
    copy.copy_(source)
    return copy


def _uses(tensor: torch.Tensor) -> int:
    """How many tensors (and storage objects) hold ``tensor``'s storage."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


class PinnedPool:
    """Pinned buffers of one shape and dtype, handed out again once nothing but the pool uses them: the host
    gradients of one offloaded unit, made once per run instead of once per step (see [Note: exact pinned memory]).

    A buffer is idle when its storage has no user besides the pool's own tensor (its use count is back to what it
    was when it was made: a gradient that is a view of it, or any other tensor on its storage, counts). A buffer
    still in use (sharded gradients kept across steps, or accumulated into) is never handed out: a new one is
    made, at most ``keep`` are kept (two serve accumulation: one holds the gradients, the other takes each
    micro-batch's), and beyond that a new buffer is only the caller's (unpinned when it dies).

    Example::

        pool = PinnedPool(keep=2)
        a = pool.take((4,), torch.float32)
        b = pool.take((4,), torch.float32)   # ``a`` is still alive: another buffer
        del a
        c = pool.take((4,), torch.float32)   # ``a``'s buffer again
    """

    def __init__(self, keep: int = 2, host: HostRegistration = CUDA_HOST) -> None:
        self.keep = keep
        self.host = host
        self._buffers: list[tuple[torch.Tensor, int]] = []  # each buffer, and its use count when idle

    def take(self, shape: Sequence[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A pinned host buffer of ``shape`` and ``dtype`` (uninitialised) that nothing else uses."""
        # A view is handed out, never the pool's own tensor: whoever holds it (or a view of it) adds a user.
        shape = torch.Size(shape)
        for buffer, idle in self._buffers:
            if buffer.shape == shape and buffer.dtype == dtype and _uses(buffer) == idle:
                return buffer.view(shape)
        buffer = pinned_empty(shape, dtype, self.host)
        if len(self._buffers) >= self.keep:
            return buffer
        self._buffers.append((buffer, _uses(buffer)))
        return buffer.view(shape)

    def clear(self) -> None:
        """Drop the kept buffers (each is unpinned once the last tensor using it is gone)."""
        self._buffers.clear()

    @property
    def nbytes(self) -> int:
        """The pinned bytes the pool keeps."""
        return sum(b.numel() * b.element_size() for b, _ in self._buffers)
