"""``--mode engine``: every system driven by hand, in the same processes, one after another.

Runs inside each benchmark process (the process group is up). For each repeat, every system is
built from the reference weights, trained ``warmup + steps`` steps on the shared batches, measured
and thrown away; the order of the systems rotates from one repeat to the next so that no system
always runs first (cold caches) or last.
"""

from __future__ import annotations

import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.counting import CommCounter
from benchmarks.footprint import current_rss_bytes, peak_rss_bytes, release_free_memory, reset_peak_rss
from benchmarks.isolation import GlobalsGuard
from benchmarks.model import CONFIGS, BenchData, BenchGPT, count_params, reference_state_dict
from benchmarks.results import RankResult, merge_ranks
from benchmarks.systems import SYSTEMS, AdamWSettings, BuildContext, SystemSpec


def quiet_warnings() -> None:
    """The deprecation warnings of torch 2.13's renamed collectives, once per call site, drown the output."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed.*")


def rotated(items: list[Any], shift: int) -> list[Any]:
    if not items:
        return items
    shift %= len(items)
    return items[shift:] + items[:shift]


def gather_results(result: RankResult) -> list[RankResult]:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    return everyone


def describe_error(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def measure(
    spec: SystemSpec, ctx: BuildContext, data: BenchData, rank: int, warmup: int, steps: int, unavailable: str | None
) -> RankResult:
    """Build ``spec``, train it, read what it holds and sent. Collective-free outside the system's own
    steps except two barriers, so every rank reaches the same points."""
    if unavailable is not None:
        return RankResult(status="skipped", reason=unavailable)
    release_free_memory()
    dist.barrier()
    result = RankResult()
    trainee = None
    guard = GlobalsGuard()
    try:
        result.rss_baseline = current_rss_bytes()
        trainee = spec.build(ctx)
        release_free_memory()  # what building freed (the full model a sharded system started from)
        result.peak_rss_reset = reset_peak_rss()  # from here: model state, then training's transients
        counts_before: dict[str, tuple[int, int]] = {}
        for step in range(warmup + steps):
            x, y = data.batch(step, rank)
            if step == warmup:
                dist.barrier()  # the timed steps start together
                counts_before = trainee.comm_counts()
            start = time.perf_counter()
            result.losses.append(trainee.step(x, y))
            if step >= warmup:
                result.step_times.append(time.perf_counter() - start)
        result.set_comm(counts_before, trainee.comm_counts(), steps)
        result.state_bytes = trainee.state_bytes().as_dict()
        result.peak_rss = peak_rss_bytes()
    except Exception as error:  # reported in the table; the other systems still run
        traceback.print_exc()
        result = RankResult(status="failed", reason=describe_error(error))
    finally:
        if trainee is not None:
            trainee.close()
        del trainee
        result.restored_globals = guard.restore()
        release_free_memory()
    return result


def run_engine_mode(rank: int, world_size: int, options: dict[str, Any], emit: Callable[[dict], None]) -> None:
    """The benchmark body of one rank; rank 0 passes every record to ``emit`` as soon as it exists."""
    quiet_warnings()
    counter = CommCounter()
    counter.install()  # before any system (DeepSpeed keeps references to the collectives it first sees)
    config = CONFIGS[options["config"]]
    seed = options["seed"]
    state = reference_state_dict(config, seed)
    data = BenchData(config, seed)
    numel = count_params(BenchGPT(config))
    ctx = BuildContext(config, state, counter, AdamWSettings(lr=options["lr"]))
    specs = [SYSTEMS[name] for name in options["systems"]]
    unavailable = {spec.name: spec.unavailable() for spec in specs}  # once: importing DeepSpeed takes seconds
    meta = {
        "mode": "engine",
        "config": options["config"],
        "model": config.as_dict(),
        "numel": numel,
        "world_size": world_size,
        "steps": options["steps"],
        "warmup": options["warmup"],
        "tokens_per_step": config.batch_size * config.block_size * world_size,
        "torch": torch.__version__,
    }
    for repeat in range(options["repeats"]):
        for spec in rotated(specs, repeat):
            mine = measure(spec, ctx, data, rank, options["warmup"], options["steps"], unavailable[spec.name])
            everyone = gather_results(mine)
            if rank == 0:
                emit(
                    merge_ranks(
                        everyone,
                        system=spec.name,
                        label=spec.label,
                        theory_stage=spec.theory_stage,
                        repeat=repeat,
                        meta=meta,
                    )
                )
