"""The checks of ``benchmarks/gpu_first_run.py`` that are more than a comparison with plain training: an
asynchronous save, counts over many steps, offload's peak device memory, two ranks. Each returns ``(passed,
detail)``: whether the check held, and the figures that say so."""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from benchmarks.first_run.probes import census, grown, peak_against_estimate
from benchmarks.first_run.training import ShardedRun, Trained, Variant, compare, fresh_model
from benchmarks.model import BenchConfig, BenchData

# Measured peak / the estimator's device_peak for offload. The estimate leaves out a step's transients (the
# gradients of the unit being reduced, the reduce buffers in flight: a few units' worth; 1.17-1.26 on a CPU for
# the same model, where the host's state counts as well); a device that held every unit's sharded gradient to the
# end of backward (4 bytes per parameter, 101 MB for the benchmark GPT) lands above. Set before
# any GPU ran it: the first run's figures are the calibration.
MEMORY_BOUNDS = (0.8, 1.6)
MEMORY_BATCH = 1  # sequences per step for the memory check: small activations, so that model states weigh
WARM_STEPS = 5  # steps before the first count (the first steps record orders, make buffers and pools)


def async_save(variant: Variant, config: BenchConfig, device: torch.device, steps: int, trained: Callable) -> Any:
    """Save in the background after half the steps (the driver's path for ``async_save=True``: this rank's pieces
    staged on the host, the save protocol in a thread), train on while it is written, then load the file: it must
    hold the values of its step, bit for bit, the run must be the one without the save (``trained(variant)``), and
    a run resumed from the file must end where the uninterrupted run did."""
    from lightning_zero.engine.checkpoint.background import BackgroundSaves, stage_on_host
    from lightning_zero.engine.checkpoint.pieces import piece_optimizer_state, piece_state_dict
    from lightning_zero.engine.checkpoint.saving import save_full

    at = steps // 2
    run = ShardedRun(variant, config, device)
    losses = [run.step(i) for i in range(at)]
    at_save = run.state()
    optimizer_at_save = _on_cpu(run.sharded.full_optimizer_state_dict(run.optimizer))
    checkpoint = {
        "model": piece_state_dict(run.sharded),
        "optimizer": piece_optimizer_state(run.sharded, run.optimizer, 0),
    }
    with tempfile.TemporaryDirectory(prefix="gpu_first_run_save_") as tmp:
        path = Path(tmp) / "step.ckpt"
        saves = BackgroundSaves()
        ranks = saves.prepare(timedelta(minutes=5))
        staged = stage_on_host(checkpoint, saves.pinned, saves.cpu_mesh)
        saves.start(path, lambda background: save_full(background, staged.state, path), staged, ranks)
        losses += [run.step(i) for i in range(at, steps)]  # the next step updates the shards the save copied
        saves.wait()
        saves.close()
        uninterrupted = Trained([float(v) for v in torch.stack(losses).tolist()], run.state())
        run.close()
        loaded = torch.load(path, map_location="cpu", weights_only=False)
    problems = [f"model {k}" for k, v in at_save.items() if not torch.equal(v, loaded["model"][k])]
    problems += _optimizer_differences(optimizer_at_save, loaded["optimizer"])
    resumed = ShardedRun(variant, config, device)
    resumed.sharded.load_full_state_dict(loaded["model"])
    resumed.sharded.load_full_optimizer_state_dict(resumed.optimizer, loaded["optimizer"])
    after = [resumed.step(i) for i in range(at, steps)]
    continued = Trained(uninterrupted.losses[:at] + [float(v) for v in torch.stack(after).tolist()], resumed.state())
    resumed.close()
    same_run, run_detail = compare(trained(variant), uninterrupted, "bitwise", steps)
    same_resume, resume_detail = compare(uninterrupted, continued, "bitwise", steps)
    saved = "the values of its step" if not problems else "differs: " + ", ".join(problems[:4])
    detail = f"saved at step {at}: {saved}; training meanwhile: {run_detail}; resumed: {resume_detail}"
    return not problems and same_run and same_resume, detail


def _on_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_cpu(v) for v in obj)
    return obj


def _optimizer_differences(expected: dict[str, Any], loaded: dict[str, Any]) -> list[str]:
    """The entries of an optimizer state dict that differ (tensors bit for bit)."""
    if set(expected["state"]) != set(loaded["state"]):
        return ["optimizer state entries"]
    problems = []
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            other = loaded["state"][index].get(key)
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            if not same:
                problems.append(f"optimizer {index}.{key}")
    if len(expected["param_groups"]) != len(loaded["param_groups"]):
        problems.append("optimizer param_groups")
    return problems


def flat_counts(variant: Variant, config: BenchConfig, device: torch.device, steps: int, timed: bool) -> Any:
    """Counts (``probes.census``) after ``WARM_STEPS`` steps and again ``steps`` steps later: none may have grown.
    ``timed``: with device timing on, as ``log_stats=True`` turns it on; its held events stay within one step's
    collectives, and on CUDA it counts device seconds."""
    run = ShardedRun(variant, config, device)
    if timed:
        run.comm.stats.time_on_device()
    per_step = 0
    for index in range(WARM_STEPS):
        before = sum(s.calls for s in run.comm.stats.by_kind.values())
        run.step(index)
        per_step = sum(s.calls for s in run.comm.stats.by_kind.values()) - before
    first = census(run.comm, device)
    for index in range(WARM_STEPS, WARM_STEPS + steps):
        run.step(index)
    last = census(run.comm, device)
    seconds = sum(s.seconds for s in run.comm.stats.by_kind.values())
    run.close()
    growth = grown(first, last)
    held = last["timed collectives held"]
    shown = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in growth.items())
    counts = ", ".join(f"{k} {v}" for k, v in last.items())
    detail = f"after {WARM_STEPS} and {WARM_STEPS + steps} steps: " + (f"grew: {shown}" if growth else counts)
    ok = not growth and held <= per_step
    if timed:
        detail += f"; seconds in collectives {seconds:.3g}, timed pairs held {held} (at most {per_step}: one step)"
        ok = ok and seconds > 0
    return ok, detail


def offload_memory(variant: Variant, config: BenchConfig, device: torch.device) -> Any:
    """Peak device memory of a few steady steps against ``estimate_memory``'s ``device_peak`` (model states,
    gathered units and the profiled activations) at the same batch (``MEMORY_BATCH`` sequences: small activations,
    so that the states weigh)."""
    from lightning_zero.planning.activations import profile_activations
    from lightning_zero.planning.estimate import estimate_memory

    small = dataclasses.replace(config, batch_size=MEMORY_BATCH)
    model = fresh_model(small, device, compiled=False)
    batch = BenchData(small, seed=0).batch(0, 0, device)
    profile = profile_activations(model, batch, unit_modules=["Block"])
    row = estimate_memory(
        model,
        devices=1,
        precision=variant.precision,
        offload_optimizer=variant.offload_optimizer,
        offload_params=variant.offload_params,
        unit_modules=["Block"],
        prefetch=variant.prefetch,
        activations=profile,
    ).row(f"zero{variant.stage}")
    del model, batch
    expected = row.device_peak
    peak, ratio = peak_against_estimate(lambda: ShardedRun(variant, small, device), expected, device, 3, 3)
    low, high = MEMORY_BOUNDS
    mib = 2**20
    return low <= ratio <= high, (
        f"peak {peak / mib:,.1f} MiB, estimate {expected / mib:,.1f} MiB (states {row.device.total / mib:,.1f}, "
        f"gathered {(row.gathered or 0) / mib:,.1f}, activations {row.activations / mib:,.1f}) at batch "
        f"{MEMORY_BATCH}x{small.block_size}: {ratio:.2f}x, bounds {low:g}-{high:g}x"
    )


def two_ranks(backend: str, config: str) -> Any:
    """Both ranks raise ``CollectiveMismatchError`` within ``ranks.LIMIT`` seconds of one leaving the track."""
    from benchmarks.first_run.ranks import LIMIT, leave_the_track

    outcomes = leave_the_track(backend, config)
    ok = all(outcome == "CollectiveMismatchError" and seconds < LIMIT for _, outcome, _, seconds in outcomes)
    shown = "; ".join(f"rank {rank}: {outcome} after {seconds:.1f} s" for rank, outcome, _, seconds in outcomes)
    if not ok:
        shown += " | " + " | ".join(f"rank {rank}: {message[:300]}" for rank, _, message, _ in outcomes)
    return ok, f"{shown} (limit {LIMIT:g} s)"
