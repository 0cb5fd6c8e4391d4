"""Run a test function on N gloo processes: one spawn runs many checks.

``spawn(fn, world_size)`` is ``lightning_zero.processes.run_on_cpu_ranks``: ``world_size`` spawned
processes, ``file://`` rendezvous, ``fn(rank, world_size, **kwargs)`` after ``init_process_group``,
every rank's return value back, the first failing rank's traceback raised in the test, and a
timeout so that a deadlock fails the test instead of hanging CI. The environment variables
Lightning's ``LightningEnvironment`` reads are set, so a ``Trainer`` built inside ``fn`` joins the
existing process group (as under torchrun) instead of launching processes of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_zero.processes import free_port, run_on_cpu_ranks

__all__ = ["free_port", "spawn"]


def spawn(fn: Callable[..., Any], world_size: int = 2, timeout: float = 300.0, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, **kwargs)`` on ``world_size`` processes; return the values by rank."""
    return run_on_cpu_ranks(fn, world_size, timeout=timeout, **kwargs)
