"""``--mode trainer``: the same model as a ``LightningModule``, timed through a real ``lightning.Trainer``.

Each system is a Lightning strategy; a ``StepMeter`` callback times every training batch as the whole
loop iteration, from one ``on_train_batch_end`` to the next (the batch fetch, Lightning's per-batch work
such as DDP's SIGTERM broadcast or the step agreement of ours that replaces it, forward, backward and
the optimizer step; the first timed batch, with ``--warmup 0``, from its ``on_train_batch_start``), and
reads losses, bytes sent and model state as the engine mode does. The Trainer runs in the benchmark's own
processes (the process group is up, and the environment variables Lightning's
``LightningEnvironment`` reads are set), so it launches nothing and joins that group.

Systems: ``ddp`` (``DDPStrategy``), ``zero1``/``zero2``/``zero3`` (ours, ``unit_modules=["Block"]``,
``collective_checks="off"``), ``fsdp`` (Lightning's ``FSDPStrategy``, FSDP1, one unit per ``Block``),
``fsdp2`` (``ModelParallelStrategy`` with ``fully_shard`` per ``Block`` and root in ``configure_model``)
and ``ds-zero1``/``ds-zero2``/``ds-zero3`` (``DeepSpeedStrategy``, which Lightning allows on CUDA only:
reported as failed with Lightning's reason on CPU). ``fabric-ddp`` and ``fabric-zero1``/``2``/``3`` run the same
model in a Fabric loop (``fabric_mode.py``), so Fabric's rows sit next to the Trainer's.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from benchmarks.counting import CommCounter, register_counted_allreduce
from benchmarks.engine_mode import describe_error, gather_results, quiet_warnings, rotated
from benchmarks.fabric_mode import FABRIC_LABELS, measure_fabric
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
from benchmarks.model import CONFIGS, BenchConfig, BenchData, BenchGPT, build_model, count_params, reference_state_dict
from benchmarks.results import RankResult, merge_ranks
from benchmarks.systems import AdamWSettings

LABELS = {
    "ddp": ("DDPStrategy", None),
    "zero1": ("lightning_zero ZeRO1Strategy", 1),
    "zero2": ("lightning_zero ZeRO2Strategy", 2),
    "zero3": ("lightning_zero ZeRO3Strategy", 3),
    "zero1-defaults": ("lightning_zero ZeRO1Strategy(), the defaults", 1),
    "zero2-defaults": ("lightning_zero ZeRO2Strategy(), the defaults", 2),
    "zero3-defaults": ("lightning_zero ZeRO3Strategy(), the defaults", 3),
    "fsdp": ("Lightning FSDPStrategy (FSDP1, per Block)", 3),
    "fsdp2": ("Lightning ModelParallelStrategy (FSDP2, per Block + root)", 3),
    "ds-zero1": ("Lightning DeepSpeedStrategy stage 1", 1),
    "ds-zero2": ("Lightning DeepSpeedStrategy stage 2", 2),
    "ds-zero3": ("Lightning DeepSpeedStrategy stage 3", 3),
}


#: A Trainer that does nothing but train on the CPU: no logger, checkpoints, progress bar, summary, sampler or
#: validation (what every timed Trainer of the benchmarks runs with).
BARE_TRAINER: dict[str, Any] = {
    "accelerator": "cpu",
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "use_distributed_sampler": False,
    "limit_val_batches": 0,
    "num_sanity_val_steps": 0,
}


class StepBatches(Dataset):
    """Item ``i`` is this rank's batch of step ``i`` (already a batch: use ``batch_size=None``)."""

    def __init__(self, data: BenchData, rank: int, length: int) -> None:
        self.data, self.rank, self.length = data, rank, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data.batch(step, self.rank)


class BenchModule(L.LightningModule):
    def __init__(
        self, config: BenchConfig, state: dict[str, torch.Tensor], data: BenchData, length: int, adamw: AdamWSettings
    ) -> None:
        super().__init__()
        self.config, self.initial_state, self.data, self.length, self.adamw = config, state, data, length, adamw
        self.model: BenchGPT | None = None
        self.fully_shard = False  # set for ModelParallelStrategy

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = build_model(self.config, self.initial_state)
        if self.fully_shard:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.model(x, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.adamw.make(self.parameters())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(StepBatches(self.data, self.global_rank, self.length), batch_size=None, shuffle=False)


class StepMeter(Callback):
    """Per-batch wall time, loss, collectives and (after the last batch) model state and peak RSS."""

    def __init__(self, warmup: int, steps: int, counter: CommCounter) -> None:
        self.warmup, self.steps, self.counter = warmup, steps, counter
        self.result = RankResult()
        self._start = 0.0
        self._counts_before: dict[str, tuple[int, int]] = {}

    def _counts(self, trainer: L.Trainer) -> dict[str, tuple[int, int]]:
        sharded = getattr(trainer.strategy, "sharded_model", None)
        if sharded is not None:
            return {k: (v.calls, v.bytes_sent) for k, v in sharded.comm.stats.by_kind.items()}
        return self.counter.counts()

    def _state(self, trainer: L.Trainer, module: L.LightningModule) -> StateBytes:
        sharded = getattr(trainer.strategy, "sharded_model", None)
        if sharded is not None:
            return from_memory_stats(sharded.memory_stats())
        params = list(module.parameters())
        states = [s for opt in trainer.optimizers for s in opt.state.values()]
        return state_bytes(params, [p.grad for p in params], states)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if isinstance(trainer.strategy.model, DistributedDataParallel):
            # Lightning registers a DDP communication hook on CUDA only: install the counted one here.
            register_counted_allreduce(trainer.strategy.model)
        release_free_memory()  # what setup freed (the full model a sharded strategy started from)
        self.result.peak_rss_reset = reset_peak_rss()

    def _start_timing(self, trainer: L.Trainer) -> None:
        torch.distributed.barrier()
        self._counts_before = self._counts(trainer)
        self._start = time.perf_counter()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if idx == self.warmup == 0:
            self._start_timing(trainer)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        now = time.perf_counter()
        elapsed, self._start = now - self._start, now
        self.result.losses.append(float(outputs["loss"]))
        if idx == self.warmup - 1:  # the next iteration is timed from here
            self._start_timing(trainer)
        if idx >= self.warmup:
            self.result.step_times.append(elapsed)
        if idx == self.warmup + self.steps - 1:
            self.result.set_comm(self._counts_before, self._counts(trainer), self.steps)
            self.result.state_bytes = self._state(trainer, pl_module).as_dict()
            self.result.peak_rss = peak_rss_bytes()


def make_strategy(name: str, module: BenchModule, world_size: int) -> Any:
    """The Lightning strategy for ``name`` (imports are local: each may be unavailable)."""
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()  # StepMeter makes its all-reduces countable
    if name.startswith("zero") and name.removesuffix("-defaults") in ("zero1", "zero2", "zero3"):
        from lightning_zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy, ZeROStrategy

        base = name.removesuffix("-defaults")
        cls = {"zero1": ZeRO1Strategy, "zero2": ZeRO2Strategy, "zero3": ZeRO3Strategy}[base]
        kwargs: dict[str, Any] = {} if name != base else {"unit_modules": ["Block"], "collective_checks": "off"}
        if "meta_init" in inspect.signature(ZeROStrategy.__init__).parameters:
            # Build the real model in configure_model, from the reference weights, as every other system does
            # (meta_init would create the layers with their own reset_parameters()).
            kwargs["meta_init"] = False
        return cls(**kwargs)
    if name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        from benchmarks.model import Block

        return FSDPStrategy(auto_wrap_policy={Block}, use_orig_params=True)
    if name == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        module.fully_shard = True
        return ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    if name.startswith("ds-zero"):
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(
            config={
                "zero_optimization": {"stage": int(name[-1])},
                "gradient_clipping": 0.0,
                "train_micro_batch_size_per_gpu": module.config.batch_size,
            }
        )
    raise ValueError(f"unknown trainer-mode system {name!r}")


def measure_trainer(
    name: str, options: dict[str, Any], make_module: Callable[[], BenchModule], counter: CommCounter, world_size: int
) -> RankResult:
    warmup, steps = options["warmup"], options["steps"]
    release_free_memory()
    torch.distributed.barrier()
    meter = StepMeter(warmup, steps, counter)
    meter.result.rss_baseline = current_rss_bytes()
    guard = GlobalsGuard()
    try:
        module = make_module()
        trainer = L.Trainer(
            devices=world_size,
            strategy=make_strategy(name, module, world_size),
            max_steps=warmup + steps,
            callbacks=[meter],
            **BARE_TRAINER,
        )
        trainer.fit(module)
        result = meter.result
        if len(result.step_times) != steps:
            raise RuntimeError(f"the Trainer ran {len(result.losses)} of {warmup + steps} steps")
    except Exception as error:  # reported in the table; the other systems still run
        reason = describe_error(error)
        # Lightning refuses some strategies on a CPU before running anything: that is "cannot run here".
        status = "skipped" if any(word in reason for word in ("GPU", "CUDA")) else "failed"
        result = RankResult(status=status, reason=reason)
    finally:
        meter = trainer = module = None  # drop the references before the next system is measured
        result.restored_globals = guard.restore()
        release_free_memory()
    return result


def run_trainer_mode(rank: int, world_size: int, options: dict[str, Any], emit: Callable[[dict], None]) -> None:
    quiet_warnings()
    for logger_name in ("lightning.pytorch", "lightning.fabric", "lightning_zero"):
        logging.getLogger(logger_name).setLevel(logging.WARNING)
    counter = CommCounter()
    counter.install()
    config = CONFIGS[options["config"]]
    state = reference_state_dict(config, options["seed"])
    data = BenchData(config, options["seed"])
    length = options["warmup"] + options["steps"]
    adamw = AdamWSettings(lr=options["lr"])
    meta = {
        "mode": "trainer",
        "config": options["config"],
        "model": config.as_dict(),
        "numel": count_params(BenchGPT(config)),
        "world_size": world_size,
        "steps": options["steps"],
        "warmup": options["warmup"],
        "tokens_per_step": config.batch_size * config.block_size * world_size,
        "torch": torch.__version__,
        "lightning": L.__version__,
    }

    def make_module() -> BenchModule:
        return BenchModule(config, state, data, length, adamw)

    for repeat in range(options["repeats"]):
        for name in rotated(list(options["systems"]), repeat):
            if name.startswith("fabric-"):  # the same model in a hand-written Fabric loop
                result = measure_fabric(name, options, config, state, data, adamw, counter, world_size)
            else:
                result = measure_trainer(name, options, make_module, counter, world_size)
            everyone = gather_results(result)
            if rank == 0:
                label, stage = {**LABELS, **FABRIC_LABELS}[name]
                emit(merge_ranks(everyone, system=name, label=label, theory_stage=stage, repeat=repeat, meta=meta))
