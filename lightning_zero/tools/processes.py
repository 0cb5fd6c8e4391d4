"""Run a function on several CPU processes joined by gloo: the machinery behind ``check_parity``
and the project's own multi-process tests.

Each process gets the environment variables Lightning's ``LightningEnvironment`` reads (so a
``Trainer`` built inside joins the process group, as under torchrun), one thread, and a process
group initialised through a ``file://`` rendezvous in a temporary directory (no port races). The
first failing rank's traceback is raised in the caller, with the original exception as its cause
when it can be pickled; a rank that does not finish within ``timeout`` seconds raises
``TimeoutError`` instead of hanging the caller.
"""

from __future__ import annotations

import contextlib
import os
import pickle
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LeaveBroken:
    """Returned by a function run with ``run_on_cpu_ranks``: ``value`` is its result, and the process exits at
    once, without the final barrier (for a function that left its process group unusable on purpose)."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _worker(
    rank: int,
    world_size: int,
    init_file: str,
    port: int,
    fn: Callable[..., Any],
    kwargs: dict,
    results: Any,
    environ: dict[str, str],
    rendezvous: str = "file",
) -> None:
    if os.environ != environ:  # a forkserver's child starts with the server's environment, not the caller's
        os.environ.clear()
        os.environ.update(environ)
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
        init = f"file://{init_file}" if rendezvous == "file" else f"tcp://127.0.0.1:{port}"
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
        value = fn(rank, world_size, **kwargs)
        if isinstance(value, LeaveBroken):
            results.put((rank, "ok", pickle.dumps(value.value)))
            results.close()
            results.join_thread()
            os._exit(0)  # collectives may be in flight that no peer will join: no barrier, no teardown
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as error:  # reported to the caller, which raises it
        pickled: bytes | None = None
        with contextlib.suppress(Exception):
            pickled = pickle.dumps(error)
        results.put((rank, "error", (traceback.format_exc(), pickled)))
        return
    dist.barrier()
    dist.destroy_process_group()


def run_on_cpu_ranks(
    fn: Callable[..., Any],
    world_size: int,
    timeout: float = 300.0,
    name: str | None = None,
    start_method: str = "spawn",
    rendezvous: str = "file",
    grace: float = 0.0,
    **kwargs: Any,
) -> list[Any]:
    """``fn(rank, world_size, **kwargs)`` on ``world_size`` CPU processes; every rank's value, by rank.

    ``fn`` and ``kwargs`` must be picklable (a module-level function). ``start_method`` is a
    ``multiprocessing`` start method: ``"spawn"`` (fresh interpreters) or ``"forkserver"`` (forks
    of a server that can import the heavy modules once, see ``set_forkserver_preload``); every rank
    gets the caller's environment variables of the moment either way. ``rendezvous``: ``"file"`` (a ``file://``
    rendezvous in a temporary directory, no port races) or ``"tcp"`` (a ``TCPStore`` hosted by rank 0, as torchrun
    and Lightning's launchers set up: it ends with rank 0's process). ``grace``: once a rank has failed or died, the
    seconds the others get to end on their own (to see what the survivors of a killed rank report) before every rank
    still running is killed. Example::

        def world(rank: int, world_size: int) -> int:
            return torch.distributed.get_world_size()

        assert run_on_cpu_ranks(world, 2) == [2, 2]
    """
    label = name or getattr(fn, "__name__", "run_on_cpu_ranks")
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    values: dict[int, Any] = {}
    with tempfile.TemporaryDirectory(prefix="lightning_zero_ranks_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        port = free_port()
        # Not daemonic: a DataLoader in fn may start worker processes of its own.
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, init_file, port, fn, kwargs, results, dict(os.environ), rendezvous),
            )
            for r in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            while len(values) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(values))
                    raise TimeoutError(f"{label}: rank(s) {missing} did not finish within {timeout:g}s (deadlock?)")
                try:
                    rank, status, value = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
                    if dead:
                        raise RuntimeError(
                            f"{label}: rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result "
                            "(an error while the process started, a crash in native code, or killed)"
                        ) from None
                    continue
                if status == "error":
                    text, pickled = value
                    cause = None
                    if pickled is not None:
                        with contextlib.suppress(Exception):
                            cause = pickle.loads(pickled)
                    raise RuntimeError(f"{label} failed on rank {rank}:\n{text}") from (
                        cause if isinstance(cause, BaseException) else None
                    )
                values[rank] = pickle.loads(value)
            for p in procs:
                p.join(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            ends = time.monotonic() + grace
            for p in procs:
                p.join(timeout=max(0.0, ends - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join()
            results.close()
    return [values[r] for r in range(world_size)]
