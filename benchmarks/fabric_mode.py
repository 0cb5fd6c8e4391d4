"""The ``fabric-*`` systems of ``--mode trainer``: the same model in a hand-written loop through ``lightning.fabric``.

``fabric-ddp`` is Fabric's ``DDPStrategy``; ``fabric-zero1`` / ``fabric-zero2`` / ``fabric-zero3`` are
``lightning_zero.fabric``'s strategies (``unit_modules=["Block"]``, ``collective_checks="off"``, the real
model built from the reference weights as every other system). Each step is timed from the forward to the
end of ``optimizer.step()`` (``zero_grad`` follows, untimed), and losses, bytes sent and model state are read
as ``trainer_mode.StepMeter`` reads them, so the rows sit next to the Trainer's in one table.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from benchmarks.counting import CommCounter, register_counted_allreduce
from benchmarks.engine_mode import describe_error
from benchmarks.footprint import (
    StateBytes,
    current_rss_bytes,
    from_memory_stats,
    peak_rss_bytes,
    release_free_memory,
    reset_peak_rss,
    state_bytes,
)
from benchmarks.isolation import GlobalsGuard
from benchmarks.model import BenchConfig, BenchData, build_model
from benchmarks.results import RankResult
from benchmarks.systems import AdamWSettings

FABRIC_LABELS = {
    "fabric-ddp": ("Fabric DDPStrategy", None),
    "fabric-zero1": ("lightning_zero.fabric ZeRO1Strategy", 1),
    "fabric-zero2": ("lightning_zero.fabric ZeRO2Strategy", 2),
    "fabric-zero3": ("lightning_zero.fabric ZeRO3Strategy", 3),
}


def _strategy(name: str) -> Any:
    if name == "fabric-ddp":
        from lightning.fabric.strategies import DDPStrategy

        return DDPStrategy()
    from lightning_zero.fabric import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy

    cls = {"fabric-zero1": ZeRO1Strategy, "fabric-zero2": ZeRO2Strategy, "fabric-zero3": ZeRO3Strategy}[name]
    return cls(unit_modules=["Block"], collective_checks="off")


def measure_fabric(
    name: str,
    options: dict[str, Any],
    config: BenchConfig,
    state: dict[str, torch.Tensor],
    data: BenchData,
    adamw: AdamWSettings,
    counter: CommCounter,
    world_size: int,
) -> RankResult:
    from lightning.fabric import Fabric

    warmup, steps = options["warmup"], options["steps"]
    release_free_memory()
    torch.distributed.barrier()
    result = RankResult()
    result.rss_baseline = current_rss_bytes()
    guard = GlobalsGuard()
    fabric = model = optimizer = None
    try:
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=_strategy(name))
        fabric.launch()
        model = fabric.setup_module(build_model(config, state))
        optimizer = fabric.setup_optimizers(adamw.make(model.parameters()))
        driver = getattr(fabric.strategy, "driver", None)  # lightning_zero.fabric strategies only
        sharded = driver.sharded if driver is not None else None
        if isinstance(model._forward_module, DistributedDataParallel):
            register_counted_allreduce(model._forward_module)

        def counts() -> dict[str, tuple[int, int]]:
            if sharded is not None:
                return {k: (v.calls, v.bytes_sent) for k, v in sharded.comm.stats.by_kind.items()}
            return counter.counts()

        def model_state() -> StateBytes:
            if sharded is not None:
                return from_memory_stats(sharded.memory_stats())
            params = list(model.parameters())
            return state_bytes(params, [p.grad for p in params], list(optimizer.state.values()))

        release_free_memory()
        result.peak_rss_reset = reset_peak_rss()
        before: dict[str, tuple[int, int]] = {}
        for step in range(warmup + steps):
            if step == warmup:
                torch.distributed.barrier()
                before = counts()
            x, y = data.batch(step, fabric.global_rank)
            start = time.perf_counter()
            loss = model(x, y)
            fabric.backward(loss)
            optimizer.step()
            elapsed = time.perf_counter() - start
            result.losses.append(float(loss))
            if step >= warmup:
                result.step_times.append(elapsed)
            if step == warmup + steps - 1:  # read where the Trainer's StepMeter does: after the step, gradients kept
                result.set_comm(before, counts(), steps)
                result.state_bytes = model_state().as_dict()
                result.peak_rss = peak_rss_bytes()
            optimizer.zero_grad()
        fabric.strategy.teardown()
    except Exception as error:  # reported in the table; the other systems still run
        result = RankResult(status="failed", reason=describe_error(error))
    finally:
        fabric = model = optimizer = None
        result.restored_globals = guard.restore()
        release_free_memory()
    return result
