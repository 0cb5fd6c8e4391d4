"""Which ``torch.distributed`` collective another thread is blocked in, read from its stack: what the stall
monitor reports for a main thread inside a collective that does not go through this library (see [Note: stall
reports] in ``stall.py``).
"""

from __future__ import annotations

from typing import Any

_COLLECTIVES = frozenset(
    "all_gather all_gather_object all_gather_into_tensor all_gather_single all_reduce all_to_all all_to_all_single "
    "barrier broadcast broadcast_object_list gather gather_object reduce reduce_scatter reduce_scatter_tensor "
    "reduce_scatter_single scatter scatter_object_list monitored_barrier".split()
)


def direct_collective(frame: Any) -> tuple[tuple[int, int], str] | None:
    """If ``frame``'s thread is inside a ``torch.distributed`` collective: where (to tell a new call from the
    same one) and a description naming the caller; else ``None``.

    Example::

        blocked = direct_collective(sys._current_frames()[threading.main_thread().ident])
        # ((..., ...), "torch.distributed.all_reduce, called from tests/test_no_hang.py:120 (step)") or None
    """
    collective = None
    f = frame
    while f is not None:
        code = f.f_code
        if collective is None and code.co_name in _COLLECTIVES and "torch/distributed" in code.co_filename:
            collective = f
        elif collective is not None and "torch/distributed" not in code.co_filename:
            caller = f"{_short(code.co_filename)}:{f.f_lineno}"
            text = f"torch.distributed.{collective.f_code.co_name}, called from {caller} ({code.co_name})"
            return (id(collective), id(f)), text
        f = f.f_back
    return None


def _short(filename: str) -> str:
    parts = filename.replace("\\", "/").split("/")
    for anchor in ("site-packages", "lightning_zero", "tests"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + (1 if anchor == "site-packages" else 0) :])
    return "/".join(parts[-2:])
