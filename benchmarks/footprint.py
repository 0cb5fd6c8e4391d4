"""What a system holds: model-state bytes (storage of parameters, gradients, optimizer states) and RSS.

Model state is counted by storage, not by tensor: a parameter that is a view into a flat buffer
counts the whole buffer once, a DTensor counts its local shard, and a storage reachable under two
headings counts under the first only (parameters, then gradients, then optimizer states, then other
buffers held by the optimizer object).

Peak RSS is per process, so a benchmark that runs several systems in one process resets the
kernel's high-water mark (``VmHWM``) between them by writing ``5`` to ``/proc/self/clear_refs``
(Linux >= 4.0). Where that is not possible, ``peak_rss_bytes`` falls back to the lifetime peak
from ``getrusage`` (and ``RssReset.supported`` is ``False``).
"""

from __future__ import annotations

import ctypes
import gc
import resource
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch
    DTensor = None  # type: ignore[assignment,misc]


@dataclass
class StateBytes:
    """Bytes of model state one rank holds (see the module docstring for how storages are counted)."""

    params: int = 0
    grads: int = 0
    optimizer_states: int = 0
    buffers: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_states + self.buffers

    def as_dict(self) -> dict[str, int]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer_states": self.optimizer_states,
            "buffers": self.buffers,
            "total": self.total,
        }


def from_memory_stats(stats: dict[str, int]) -> StateBytes:
    """``ShardedModel.memory_stats()`` under our headings: every kind of parameter bytes it reports
    (persistent, master copies, gathered) counts as parameters."""
    grads = stats.get("grads", 0)
    states = stats.get("optimizer_states", 0)
    params = sum(v for k, v in stats.items() if k not in ("grads", "optimizer_states"))
    return StateBytes(params=params, grads=grads, optimizer_states=states)


def _local(t: torch.Tensor) -> torch.Tensor:
    if DTensor is not None and isinstance(t, DTensor):
        return t.to_local()
    return t


def _tensors_in(value: Any, depth: int) -> Iterable[torch.Tensor]:
    """Tensors in ``value`` and in the lists, tuples and dicts it holds (not inside other objects)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 0 and isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v, depth - 1)
    elif depth > 0 and isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v, depth - 1)


def held_tensors(obj: Any, depth: int = 3) -> list[torch.Tensor]:
    """Tensors an object holds in its attributes (and in containers there): e.g. the flat buffers
    DeepSpeed's optimizer keeps. Modules are not entered (their parameters are counted as such)."""
    found: list[torch.Tensor] = []
    for name, value in vars(obj).items():
        if isinstance(value, nn.Module) or name == "state":
            continue
        found.extend(_tensors_in(value, depth))
    return found


def state_bytes(
    params: Iterable[torch.Tensor],
    grads: Iterable[torch.Tensor | None],
    optimizer_states: Iterable[Any],
    buffers: Iterable[torch.Tensor] = (),
) -> StateBytes:
    """Storage bytes under each heading, each storage counted once.

    ``optimizer_states``: the ``optimizer.state`` values (dicts of tensors and scalars); only tensors
    with at least one dimension count (a step counter is not model state worth a column)."""
    seen: set[tuple[str, int]] = set()

    def count(tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            t = _local(t)
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
        return total

    def state_tensors() -> Iterable[torch.Tensor]:
        for entry in optimizer_states:
            for v in entry.values() if isinstance(entry, dict) else [entry]:
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    yield v

    result = StateBytes()
    result.params = count(params)
    result.grads = count(grads)
    result.optimizer_states = count(state_tensors())
    result.buffers = count(t for t in buffers if t.dim() > 0)
    return result


# ---------------------------------------------------------------------------------------------- RSS

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        return 0


def peak_rss_bytes() -> int:
    """The high-water mark of this process's RSS (since the last ``reset_peak_rss``, where supported)."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def release_free_memory() -> None:
    """Collect garbage and hand freed heap back to the OS, so one system's leftovers do not count
    in the next one's RSS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> bool:
    """Restart the RSS high-water mark from the current RSS; ``False`` where the kernel does not allow it."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True
