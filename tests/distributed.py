"""Run a test function on N gloo processes: one spawn runs many checks.

``spawn(fn, world_size)`` is ``lightning_zero.tools.processes.run_on_cpu_ranks``: ``world_size`` spawned
processes, ``file://`` rendezvous, ``fn(rank, world_size, **kwargs)`` after ``init_process_group``,
every rank's return value back, the first failing rank's traceback raised in the test, and a
timeout so that a deadlock fails the test instead of hanging CI. The environment variables
Lightning's ``LightningEnvironment`` reads are set, so a ``Trainer`` built inside ``fn`` joins the
existing process group (as under torchrun) instead of launching processes of its own.

[Note: forkserver]
The ranks are started by a forkserver that imported torch, Lightning, torchmetrics and
lightning_zero once, for the whole session: a rank starts in tens of milliseconds instead of the
five to eight seconds those imports take on two cores (torchmetrics alone pulls in transformers
and scipy). With about a hundred process groups in the suite, that is most of its time. Isolation
is as under spawn: every rank is a fresh fork of the server, which never ran a test, never
initialised a process group and never ran a parallel kernel (torch starts its intra-op pool
lazily; OpenBLAS, loaded by numpy and scipy, re-creates its threads in the child through its
``pthread_atfork`` handlers). The server's environment is the one the session started with, so
``run_on_cpu_ranks`` hands each rank the caller's environment of the moment. A module that fails
to import in the server is skipped by ``multiprocessing`` and imported by the rank itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from lightning_zero.tools.processes import free_port, run_on_cpu_ranks

__all__ = ["free_port", "spawn", "spawn_killed"]

_PRELOAD = ["torch", "torch.distributed", "torchmetrics", "lightning.pytorch", "lightning.fabric", "lightning_zero"]
mp.set_forkserver_preload([*_PRELOAD, "tests.models"])


def spawn(
    fn: Callable[..., Any],
    world_size: int = 2,
    timeout: float = 300.0,
    rendezvous: str = "file",
    grace: float = 0.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, **kwargs)`` on ``world_size`` processes; return the values by rank. ``grace``: the
    seconds the other ranks get to end on their own after one failed or died."""
    return run_on_cpu_ranks(
        fn, world_size, timeout=timeout, start_method="forkserver", rendezvous=rendezvous, grace=grace, **kwargs
    )


def spawn_killed(fn: Callable[..., Any], timeout: float = 300.0, **kwargs: Any) -> None:
    """Run ``fn`` on 2 ranks that are to be killed (a crash point, ``LIGHTNING_ZERO_KILL_AT``): the harness sees the
    killed rank exit, or the other rank's error about it, whichever comes first; anything else fails the test."""
    import signal

    import pytest

    with pytest.raises(RuntimeError, match=f"exited with code {-signal.SIGKILL}|another rank exited or was killed"):
        spawn(fn, world_size=2, timeout=timeout, **kwargs)
