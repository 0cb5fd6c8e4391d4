"""What the first GPU run watches beside the results: host synchronisations, collectives made late, what stays
alive step after step, and the peak device memory of offload against the estimator.

[Note: host synchronisations]
``torch.cuda.set_sync_debug_mode("warn")`` makes every call that blocks the host until the device has caught up
(``.item()``, ``.tolist()``, ``bool()`` of a device tensor, a blocking copy to the host, a stream synchronisation)
warn with "called a synchronizing CUDA operation". The warning is raised where the Python code called into torch,
so ``capture_syncs`` records the Python stack of each (``warnings.showwarning`` is called synchronously inside the
call that warns) and blames the innermost frame outside torch's own package: a read inside ``torch.optim`` that
the engine called is the engine's. Waiting for a CUDA event (``Event.synchronize``, what offload's step on the host
does once its gradients have landed) is not one of the calls the mode reports.

[Note: late collectives]
``DelayedComm`` is a ``Comm`` whose collectives start late, so that anything that reads a collective's output
before waiting for it, or writes its input before it has run, sees other values (a race that a fast device or a
quick gloo thread would hide). On CUDA each collective is issued while a side stream is current, after that side
stream has waited for the compute stream and run a ``torch.cuda._sleep``: ProcessGroupNCCL's stream waits for the
current stream at the issue, so the collective starts after the sleep, while the compute stream goes on (it waits
only at ``wait()``, as without the delay). On a CPU each collective is issued from a worker thread after a
``time.sleep`` (one thread, so the order of issue is kept), and the work handed back waits for the issue first.
It wraps ``Comm._timed``, through which every collective of the engine is issued; nothing of the engine changes.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lightning_zero.engine import Comm

TORCH_DIR = str(Path(torch.__file__).resolve().parent)
PACKAGE_DIR = str(Path(__file__).resolve().parents[2] / "lightning_zero")
SYNC_TEXT = "called a synchronizing CUDA operation"


# ---------------------------------------------------------------------- host synchronisations
class Sync(NamedTuple):
    """One synchronising call: the frame blamed (``file:line in function``), whether it is the engine's, the
    thread it ran in."""

    frame: str
    engine: bool
    thread: str


def blamed_frame(stack: traceback.StackSummary) -> traceback.FrameSummary | None:
    """The innermost frame outside torch's package and the warnings machinery (see [Note: host synchronisations])."""
    for frame in reversed(stack):
        name = str(Path(frame.filename).resolve()) if frame.filename and not frame.filename.startswith("<") else ""
        if name.startswith(TORCH_DIR) or name.endswith(("warnings.py", "probes.py")) or not name:
            continue
        return frame
    return None


@contextmanager
def capture_syncs() -> Iterator[list[Sync]]:
    """Every host synchronisation with the CUDA device inside the block, in any thread (see [Note: host
    synchronisations])."""
    found: list[Sync] = []

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if SYNC_TEXT not in str(message):
            return  # (any other warning of the step is not shown: "always" would repeat it at every call)
        frame = blamed_frame(traceback.extract_stack())
        where = f"{frame.filename}:{frame.lineno} in {frame.name}" if frame else f"{filename}:{lineno}"
        engine = frame is not None and str(Path(frame.filename).resolve()).startswith(PACKAGE_DIR)
        found.append(Sync(where, engine, threading.current_thread().name))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show  # restored by catch_warnings
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")


class HostRead(NamedTuple):
    """One read of a tensor's value on the host: the frame blamed, whether it is the engine's, whether it ran inside
    a backward pass (autograd's graph task, its hooks and callbacks included)."""

    frame: str
    engine: bool
    in_backward: bool


# Tensor methods that hand a value to Python: on a GPU tensor each waits for the device. They are seen as the
# interpreter calls them (``sys.setprofile``'s ``c_call``): a torch function or dispatch mode misses ``tolist``
# (it reads the memory below the dispatcher) and what autograd's callbacks run at the end of a backward pass.
_READS = {"item", "tolist", "__bool__", "__float__", "__int__"}
# Engine reads that are no device wait on a GPU either: ``_any`` reads on the CPU only (off it, it runs the work
# instead of asking); the control channel's agreement rows live in host memory on every device (a gloo group).
_NOT_DEVICE_READS = {("quantized.py", "_any"), ("control.py", "_settle")}


@contextmanager
def capture_host_reads() -> Iterator[list[HostRead]]:
    """Every value the block hands from a tensor to Python (``item()``, ``tolist()``, ``bool()``, ``float()``,
    ``int()``), in this thread (where a CPU backward pass runs): on a GPU each waits for the device, so the CPU sees
    where a GPU step would (the CPU stand-in for ``capture_syncs``; a read of a host copy, as the step's flags are
    read, counts too)."""
    found: list[HostRead] = []
    previous = sys.getprofile()

    def observe(frame: Any, event: str, arg: Any) -> None:
        if event != "c_call" or getattr(arg, "__name__", None) not in _READS:
            return
        if not isinstance(getattr(arg, "__self__", None), torch.Tensor):
            return
        stack = traceback.extract_stack(frame)
        blamed = blamed_frame(stack)
        where = f"{blamed.filename}:{blamed.lineno} in {blamed.name}" if blamed else "?"
        engine = blamed is not None and str(Path(blamed.filename).resolve()).startswith(PACKAGE_DIR)
        if blamed is not None and (Path(blamed.filename).name, blamed.name) in _NOT_DEVICE_READS:
            engine = False
        found.append(HostRead(where, engine, torch._C._current_graph_task_id() != -1))

    sys.setprofile(observe)
    try:
        yield found
    finally:
        sys.setprofile(previous)


# ---------------------------------------------------------------------- late collectives
class _LateWork:
    """The work of a collective issued by ``DelayedComm``'s thread: waits for the issue, then for the work."""

    def __init__(self, issued: Future) -> None:
        self._issued = issued

    def wait(self, timeout: timedelta | None = None) -> bool:
        work = self._issued.result()
        return work.wait() if timeout is None else work.wait(timeout=timeout)

    def is_completed(self) -> bool:
        return self._issued.done() and self._issued.result().is_completed()


class DelayedComm(Comm):
    """A ``Comm`` whose every collective starts ``delay_s`` late (see [Note: late collectives]).

    Example::

        comm = DelayedComm(checks="off", run_alone=True, delay_s=0.002)
        sharded = shard_model(model, stage=3, comm=comm)   # results must not change
    """

    def __init__(self, *args: Any, delay_s: float = 0.002, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.delay_s = delay_s
        self.delayed = 0  # collectives made late
        self._side: dict[torch.device, torch.cuda.Stream] = {}
        self._issuer: ThreadPoolExecutor | None = None

    def _timed(self, kind: str, bytes_sent: int, describe: Callable[[], str], fn, *args, **kwargs):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        late = self._late_on_device if first is not None and first.is_cuda else self._late_on_host
        return super()._timed(kind, bytes_sent, describe, late(fn, first), *args, **kwargs)

    def _late_on_device(self, fn: Callable[..., Any], first: torch.Tensor) -> Callable[..., Any]:
        def issue(*args: Any, **kwargs: Any) -> Any:
            device = first.device
            side = self._side.get(device)
            if side is None:
                side = self._side[device] = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            self.delayed += 1
            with torch.cuda.stream(side):
                torch.cuda._sleep(int(self.delay_s * 1e9))  # cycles: delay_s at 1 GHz, half of it at 2 GHz
                return fn(*args, **kwargs)

        return issue

    def _late_on_host(self, fn: Callable[..., Any], first: torch.Tensor | None) -> Callable[..., Any]:
        def issue(*args: Any, **kwargs: Any) -> Any:
            if self._issuer is None:
                self._issuer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="late collectives")
            self.delayed += 1

            def later() -> Any:
                time.sleep(self.delay_s)
                return fn(*args, **kwargs)

            return _LateWork(self._issuer.submit(later))

        return issue

    def close(self) -> None:
        if self._issuer is not None:
            self._issuer.shutdown(wait=True)
            self._issuer = None


# ---------------------------------------------------------------------- what stays alive
def census(comm: Comm, device: torch.device) -> dict[str, int]:
    """What this process holds now that could grow step after step: tensors, CUDA events and pinned host buffers
    (found through the garbage collector, which tracks every tensor and event object), the device bytes allocated,
    the caching host allocator's current figures, the threads, and the collectives whose device timing is still
    held (``CommStats.device_timing``)."""
    gc.collect()
    objects = gc.get_objects()
    tensors = [o for o in objects if isinstance(o, torch.Tensor)]
    timing = comm.stats.device_timing
    counts = {
        "tensors": len(tensors),
        "threads": threading.active_count(),
        "timed collectives held": len(timing.held) if timing is not None else 0,
    }
    if device.type != "cuda":
        return counts
    pinned: dict[int, int] = {}
    for t in tensors:
        try:
            if t.device.type == "cpu" and t.is_pinned():
                storage = t.untyped_storage()
                pinned[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):  # a tensor subclass without storage (a marker)
            continue
    counts["cuda events"] = sum(isinstance(o, torch.cuda.Event) for o in objects)
    counts["pinned buffers"] = len(pinned)
    counts["pinned bytes"] = sum(pinned.values())
    counts["device bytes allocated"] = torch.cuda.memory_allocated(device)
    try:
        host_stats = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):  # a torch without it
        host_stats = {}
    for key, value in host_stats.items():
        if "current" in key and isinstance(value, int):
            counts[f"caching host allocator {key}"] = value
    return counts


def grown(before: dict[str, int], after: dict[str, int]) -> dict[str, tuple[int, int]]:
    """The counts that are larger ``after`` than ``before`` (``timed collectives held`` may move within what a
    step issues, so only its growth past one step's worth would be a leak: the caller bounds it)."""
    return {
        k: (before.get(k, 0), v) for k, v in after.items() if v > before.get(k, 0) and k != "timed collectives held"
    }


# ---------------------------------------------------------------------- offload memory
def peak_against_estimate(
    run_factory: Callable[[], Any],
    estimate: float,
    device: torch.device,
    warmup: int,
    steps: int,
) -> tuple[float, float]:
    """``torch.cuda.max_memory_allocated`` over ``steps`` steady steps of a run (above what was allocated before it
    was built), and its ratio to ``estimate`` (the estimator's ``device_peak``)."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    run = run_factory()
    for index in range(warmup):
        run.step(index)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    for index in range(warmup, warmup + steps):
        run.step(index)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    run.close()
    return peak, peak / estimate
