"""Run a function on N gloo processes from a test: one spawn runs many checks.

``spawn(fn, world_size)`` starts ``world_size`` processes (``spawn`` start method, ``file://``
rendezvous in a temporary directory, so no port races), calls ``fn(rank, world_size, **kwargs)``
in each after ``init_process_group``, and returns every rank's return value. The first failing
rank's traceback is raised in the test; a rank that does not finish within ``timeout`` seconds
fails the test instead of hanging CI. The environment variables Lightning's ``LightningEnvironment``
reads are set, so a ``Trainer`` built inside ``fn`` joins the existing process group (as under
torchrun) instead of launching processes of its own.
"""

from __future__ import annotations

import os
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world_size: int, init_file: str, port: int, fn: Callable, kwargs: dict, results: mp.Queue
) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "OMP_NUM_THREADS": "1",
        }
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        value = fn(rank, world_size, **kwargs)
        results.put((rank, "ok", value))
    except BaseException:  # reported to the parent, which fails the test
        results.put((rank, "error", traceback.format_exc()))
        return
    dist.barrier()
    dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int = 2, timeout: float = 300.0, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, **kwargs)`` on ``world_size`` processes; return the values by rank."""
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        port = _free_port()
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, port, fn, kwargs, results), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        values: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(values) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"{fn.__name__}: ranks {sorted(set(range(world_size)) - set(values))} "
                        f"did not finish within {timeout:.0f}s (deadlock?)"
                    )
                try:
                    rank, status, value = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                    if dead:
                        raise RuntimeError(
                            f"{fn.__name__}: rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                        ) from None
                    continue
                if status == "error":
                    raise RuntimeError(f"{fn.__name__} failed on rank {rank}:\n{value}")
                values[rank] = value
            for p in procs:
                p.join(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    return [values[r] for r in range(world_size)]
