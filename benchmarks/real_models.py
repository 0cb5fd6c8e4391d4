"""Step time of stage 3 with the default units against DDP on the real-model matrix (``tests/real_models.py``).

Engine mode, as ``benchmarks.run``: the same tiny GPT-2, Llama, BERT, OPT, LitGPT, ResNet and ViT (library
initialization, one seed), the same per-rank batches for every system, ``zero_grad`` / forward / backward /
AdamW step, every system in the same processes, the order rotated per repeat. Systems:

- ``ddp``: ``DistributedDataParallel`` (the reference);
- ``zero3-defaults``: ``shard_model(stage=3)`` with the strategies' defaults (default units, ``checks="auto"``
  with the control channel and one step agreement per step, as the strategies run it);
- ``zero3-per-layer``: one unit per module that owns parameters (``owns_parameters``, the finest grain);
- ``zero1-defaults`` / ``zero2-defaults`` (with ``--systems``): stages 1 and 2 with their defaults;
- ``fsdp2`` (with ``--systems``): torch's ``fully_shard`` on each repeated block (the blocks the default policy
  finds, at any model size) and on the root, the anchor beside stage 3;
- ``ds-zero3`` (with ``--systems``; needs the ``deepspeed`` package): ``deepspeed.initialize`` with ZeRO stage 3
  and its defaults otherwise (fp32, no clipping), on its CPU accelerator over gloo, the other anchor.

``--mode trainer`` trains the same models through a real ``lightning.Trainer`` instead (what users run):
``ddp`` is Lightning's ``DDPStrategy()``, ``zero3-defaults`` is ``ZeRO3Strategy()`` with no arguments (and
``zero1-defaults`` / ``zero2-defaults``, with ``--systems``, ``ZeRO1Strategy()`` / ``ZeRO2Strategy()``). A
step is the whole loop iteration, from one ``on_train_batch_end`` to the next: the batch fetch, Lightning's
per-batch work (for DDP, its SIGTERM broadcast; for ours, the step agreement that replaces it), forward,
backward and the optimizer step.

Usage::

    python -m benchmarks.real_models                      # 2 CPU ranks, 3 repeats of 12 timed steps
    python -m benchmarks.real_models --models gpt2,resnet --steps 6 --repeats 1
    python -m benchmarks.real_models --mode trainer
    python -m benchmarks.real_models --mode trainer --systems ddp,zero1-defaults,zero2-defaults,zero3-defaults

Prints one markdown row per model: each system's median step time (best repeat; in engine mode a step counts
as long as its slowest rank, in Trainer mode the slower rank's median counts) and its ratio to DDP, twice: the
ratio of the best repeats, and the median of the ratios within each repeat (``paired_ratio``), the steadier of
the two on a noisy machine. Every repeat's median per model and system, the options and the versions go to
``--out`` as JSON (default ``benchmarks/results/<timestamp>-real-models.json``), the table next to it (``.md``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

SYSTEMS = ("ddp", "zero3-defaults", "zero3-per-layer")
TRAINER_SYSTEMS = ("ddp", "zero3-defaults")
# What ``--systems`` may name in each mode, and the stage of each ZeRO system.
ALLOWED = {
    "engine": ("ddp", "zero1-defaults", "zero2-defaults", "zero3-defaults", "zero3-per-layer", "fsdp2", "ds-zero3"),
    "trainer": ("ddp", "zero1-defaults", "zero2-defaults", "zero3-defaults"),
}
_STAGE = {"zero1-defaults": 1, "zero2-defaults": 2, "zero3-defaults": 3, "zero3-per-layer": 3}


def _batch(name: str, step: int, rank: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    from tests.real_models import dataset

    data = dataset(name, batch_size, seed=1000 * step + rank)
    return data.tensors[0], data.tensors[1]


def _loss(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    from tests.real_models import logits

    out = logits(name, model, x)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _time_system(name: str, system: str, rank: int, steps: int, warmup: int, batch_size: int) -> list[float]:
    from lightning_zero.engine import Comm, owns_parameters, shard_model
    from lightning_zero.engine.comm.control import ControlChannel
    from tests.real_models import build

    torch.manual_seed(0)
    model = build(name)
    sharded = None
    deepspeed_engine = None
    if system == "ddp":
        wrapped: nn.Module = DistributedDataParallel(model)
    elif system == "fsdp2":
        wrapped = _fully_shard_blocks(model)
    elif system == "ds-zero3":
        wrapped = deepspeed_engine = _deepspeed_stage3(model, batch_size)
    else:
        policy = owns_parameters if system == "zero3-per-layer" else None
        # The strategies' checks: one agreement per step on the control channel (see engine/comm/control.py).
        comm = Comm(checks="auto", control=ControlChannel.create())
        sharded = shard_model(model, stage=_STAGE[system], comm=comm, units=policy)
        wrapped = model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3) if deepspeed_engine is None else None
    if sharded is not None:
        sharded.bind_optimizer(optimizer)
    times = []
    for step in range(warmup + steps):
        x, y = _batch(name, step, rank, batch_size)
        dist.barrier()
        start = time.perf_counter()
        if deepspeed_engine is not None:  # it zeroes the gradients inside step()
            deepspeed_engine.backward(_loss(name, wrapped, x, y))
            deepspeed_engine.step()
        else:
            optimizer.zero_grad(set_to_none=True)
            if sharded is not None:
                sharded.comm.begin_sequence("training", [step], lambda: "a training step")
                with sharded.step_context():
                    _loss(name, wrapped, x, y).backward()
            else:
                _loss(name, wrapped, x, y).backward()
            optimizer.step()
            if sharded is not None:
                sharded.after_optimizer_step(optimizer)
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= warmup:
            times.append(float(elapsed))
    if sharded is not None:
        sharded.release(gather=False)
    if deepspeed_engine is not None:
        deepspeed_engine.destroy()
    return times


def _deepspeed_stage3(model: nn.Module, batch_size: int) -> nn.Module:
    """DeepSpeed ZeRO-3 over the model, torch's AdamW as the client optimizer (as every other system steps)."""
    from benchmarks.systems import deepspeed_unavailable

    reason = deepspeed_unavailable()  # sets DS_ACCELERATOR=cpu before DeepSpeed is imported
    if reason is not None:
        raise RuntimeError(f"ds-zero3 cannot run here: {reason}")
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": batch_size,
        "zero_optimization": {"stage": 3},
        "gradient_clipping": 0.0,
        "steps_per_print": 1 << 30,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    return engine


def _fully_shard_blocks(model: nn.Module) -> nn.Module:
    """FSDP2 per block: ``fully_shard`` on every unit root the default policy finds with no size threshold (the
    repeated blocks and large leaves), then on the model (the rest: embeddings, heads, norms)."""
    from torch.distributed.fsdp import fully_shard

    from lightning_zero.engine import default_unit_policy, plan_units

    units = [u for u in plan_units(model, default_unit_policy(model, whole_model_below=0)) if u.module is not model]
    for unit in sorted(units, key=lambda u: -u.name.count(".")):  # inner modules before the ones holding them
        fully_shard(unit.module)
    fully_shard(model)
    return model


def _time_in_trainer(name: str, system: str, rank: int, steps: int, warmup: int, batch_size: int) -> list[float]:
    """Loop iterations of a real ``Trainer`` (see the module's docstring), this rank's, after ``warmup``."""
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    from benchmarks.trainer_mode import BARE_TRAINER
    from tests.real_models import build

    class Batches(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return warmup + steps

        def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
            return _batch(name, step, rank, batch_size)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = build(name)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return _loss(name, self.model, *batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(Batches(), batch_size=None)

    times: list[float] = []

    class Meter(L.Callback):
        last = 0.0

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            now = time.perf_counter()
            if trainer.global_step > warmup:
                times.append(now - self.last)
            self.last = now

    # Ours by their registered names, as a user writes them (``strategy="zero3"``: the defaults).
    strategy = DDPStrategy() if system == "ddp" else f"zero{_STAGE[system]}"
    dist.barrier()
    L.Trainer(
        devices=dist.get_world_size(),
        strategy=strategy,
        max_steps=warmup + steps + 1,
        callbacks=[Meter()],
        **BARE_TRAINER,
    ).fit(Module())
    # Both ranks run in lockstep; the slower one's median counts.
    median = torch.tensor(statistics.median(times))
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return [float(median)]


def _run(rank: int, world_size: int, options: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    from benchmarks.engine_mode import rotated
    from benchmarks.results import quiet_rank

    quiet_rank()
    trainer = options["mode"] == "trainer"
    systems = tuple(options["systems"])
    time_system = _time_in_trainer if trainer else _time_system
    medians: dict[str, dict[str, list[float]]] = {}
    for name in options["models"]:
        medians[name] = {s: [] for s in systems}
        for repeat in range(options["repeats"]):
            order = rotated(list(systems), repeat)
            for system in order:
                times = time_system(name, system, rank, options["steps"], options["warmup"], options["batch_size"])
                medians[name][system].append(statistics.median(times))
    return medians


def paired_ratio(times: list[float], reference: list[float]) -> float:
    """The median, over repeats, of ``times[i] / reference[i]``: each repeat's systems run back to back in the same
    processes, so a slow drift of the machine (other work, frequency) cancels within a pair, where the ratio of
    the best repeats can pair a quiet minute with a busy one.

    Example::

        paired_ratio([1.2, 2.4, 1.3], [1.0, 2.0, 1.0])   # 1.2
    """
    return statistics.median(t / r for t, r in zip(times, reference))


def main(argv: list[str] | None = None) -> str:
    from lightning_zero.tools.processes import run_on_cpu_ranks
    from tests.real_models import NAMES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(NAMES))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--mode", choices=("engine", "trainer"), default="engine")
    parser.add_argument(
        "--systems",
        default=None,
        help=f"comma-separated, ddp first (engine: {','.join(ALLOWED['engine'])}; trainer: "
        f"{','.join(ALLOWED['trainer'])}; default: {','.join(SYSTEMS)} / {','.join(TRAINER_SYSTEMS)})",
    )
    parser.add_argument("--out", default=None, help="JSON file (default results/<timestamp>-real-models.json)")
    args = parser.parse_args(argv)
    if args.systems is None:
        systems = TRAINER_SYSTEMS if args.mode == "trainer" else SYSTEMS
    else:
        systems = tuple(args.systems.split(","))
        unknown = [s for s in systems if s not in ALLOWED[args.mode]]
        if unknown or systems[0] != "ddp" or len(set(systems)) != len(systems):
            known = ", ".join(ALLOWED[args.mode])
            parser.error(
                f"--systems {args.systems!r}: name each system once, ddp first (the reference), from {known} in "
                f"{args.mode} mode" + (f"; unknown: {', '.join(unknown)}" if unknown else "")
            )
    unknown_models = [m for m in args.models.split(",") if m not in NAMES]
    if unknown_models:
        parser.error(f"--models: unknown {', '.join(unknown_models)} (known: {', '.join(NAMES)})")
    options = {
        "mode": args.mode,
        "models": args.models.split(","),
        "systems": list(systems),
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "batch_size": args.batch_size,
    }
    result = run_on_cpu_ranks(_run, args.world_size, timeout=3600, options=options)[0]
    others = systems[1:]
    lines = [
        "| model | "
        + " | ".join(f"{s} (ms)" for s in systems)
        + " | "
        + " | ".join(f"{s} / ddp, best | paired" for s in others)
        + " |",
        "|---" * (1 + len(systems) + 2 * len(others)) + "|",
    ]
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for name, per_system in result.items():
        best = {s: min(v) for s, v in per_system.items()}
        row = summary[name] = {
            s: {
                "best_s": best[s],
                "ratio_best": best[s] / best["ddp"],
                "ratio_paired": paired_ratio(per_system[s], per_system["ddp"]),
            }
            for s in systems
        }
        lines.append(
            f"| {name} | "
            + " | ".join(f"{1000 * best[s]:.1f}" for s in systems)
            + " | "
            + " | ".join(f"{row[s]['ratio_best']:.2f} | {row[s]['ratio_paired']:.2f}" for s in others)
            + " |"
        )
    table = "\n".join(lines)
    print(table)
    out = Path(args.out or Path(__file__).parent / "results" / f"{time.strftime('%Y%m%d-%H%M%S')}-real-models.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    import lightning

    record = {
        "kind": "real_models",
        "options": {**options, "world_size": args.world_size},
        "versions": {"torch": torch.__version__, "lightning": lightning.__version__},
        "median_step_s_per_repeat": result,
        "summary": summary,
    }
    out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(table + "\n", encoding="utf-8")
    print(f"\nwritten: {out}")
    return table


if __name__ == "__main__":
    main()
