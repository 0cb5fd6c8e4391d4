"""Two ranks, one of which leaves the recorded track: both must raise ``CollectiveMismatchError`` within seconds.

Each rank trains the benchmark GPT under stage 3 with the collective checks on (the strategies' defaults: see
[Note: collective checks] in ``engine/comm/sequence.py``). From step ``LEAVES_AT`` on, rank 1 runs its first
block twice in forward (``tests/test_no_hang.py``'s "more calls" case): its extra gather leaves the sequence the
earlier steps recorded, so it agrees first, while rank 0, still on track, issues its next gather without asking.
On gloo rank 0 then blocks in a wait of its own, whose stall report finds rank 1 in an agreement; on NCCL a wait
does not block the host, and rank 0 must meet the error where the host next waits (an agreement, or a wait for
the device that reports itself: [Note: waits for the device] in ``engine/comm/device_wait.py``). A rank that has
not raised within ``LIMIT`` seconds is a failure (without the reports it would wait for the process group's
timeout, 30 minutes by default, then abort).
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

LEAVES_AT = 3  # the first step in which rank 1 leaves the track
STEPS = 6
LIMIT = 60.0  # seconds either rank may take to raise (the processes are killed after LIMIT + 30)


def _first_block_twice(model: Any, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``BenchGPT.forward`` with the first block run twice."""
    import torch.nn.functional as F

    x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1], device=idx.device))
    x = model.blocks[0](x)
    for block in model.blocks:
        x = block(x)
    logits = model.lm_head(model.ln_f(x))
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _rank(rank: int, world_size: int, backend: str, init_file: str, config: str, results: Any) -> None:
    """One rank's run (the target of a spawned process); puts ``(rank, outcome, message, seconds)``."""
    import torch.distributed as dist

    from benchmarks.first_run import load_engine

    load_engine()
    from benchmarks.first_run.training import ShardedRun, Variant
    from benchmarks.model import CONFIGS
    from lightning_zero.engine import Comm
    from lightning_zero.engine.comm.control import ControlChannel

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    if backend == "nccl":
        torch.cuda.set_device(device)
    # A timeout past LIMIT: a rank that hangs is found by the parent, not by the watchdog.
    timeout = timedelta(seconds=LIMIT + 60)
    init = f"file://{init_file}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    variant = Variant("zero3-checks", 3, checks=True)
    comm = Comm(checks="auto", control=ControlChannel.create(), stage=3)

    def forward(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        leaves = rank == 1 and step >= LEAVES_AT
        return _first_block_twice(model, x, y) if leaves else model(x, y)

    run = ShardedRun(variant, CONFIGS[config], device, comm=comm, forward=forward, rank=rank)
    outcome, message = "finished", ""
    started = time.monotonic()
    step = 0
    try:
        for step in range(STEPS):
            if step == LEAVES_AT:
                started = time.monotonic()
            run.step(step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as error:  # what each rank raises is the result
        outcome, message = type(error).__name__, str(error)
    results.put((rank, outcome, message[:2000], time.monotonic() - started))
    time.sleep(0.5)  # let the queue's feeder thread hand the result over
    os._exit(0)  # collectives may be in flight that no peer will join: no teardown


def leave_the_track(backend: str, config: str) -> list[tuple[int, str, str, float]]:
    """Run the two ranks (``spawn``); each rank's ``(rank, outcome, message, seconds from the step it left the
    track)``, or a ``"did not finish"`` outcome for a rank that gave nothing within ``LIMIT + 30`` seconds."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.Queue()
    outcomes: dict[int, tuple[int, str, str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_first_run_ranks_") as tmp:
        init_file = str(Path(tmp) / "rendezvous")
        environ = {"OMP_NUM_THREADS": "1"}
        saved = {k: os.environ.get(k) for k in environ}
        os.environ.update(environ)
        try:
            procs = [context.Process(target=_rank, args=(r, 2, backend, init_file, config, results)) for r in range(2)]
            for proc in procs:
                proc.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        deadline = time.monotonic() + LIMIT + 30
        while len(outcomes) < 2 and time.monotonic() < deadline:
            try:
                rank, outcome, message, seconds = results.get(timeout=1.0)
                outcomes[rank] = (rank, outcome, message, seconds)
            except queue.Empty:
                if all(p.exitcode is not None for p in procs) and results.empty():
                    break
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for rank, proc in enumerate(procs):
            if rank not in outcomes:
                why = f"exit code {proc.exitcode}" if proc.exitcode not in (None, -9) else "killed after the limit"
                outcomes[rank] = (rank, "did not finish", f"no result within {LIMIT + 30:g} s ({why})", float("inf"))
    return [outcomes[r] for r in range(2)]
