"""One-GPU check: plain single-device training vs lightning_zero stages 1, 2 and 3, over NCCL.

    python benchmarks/gpu_check.py                          # fp32, then bf16-mixed (autocast)
    python benchmarks/gpu_check.py --precision 32-true --steps 50
    python benchmarks/gpu_check.py --dry-run                # the same logic on the CPU over gloo, tiny model

Self-contained: it starts its own one-rank process group (no torchrun; ``file://`` rendezvous), builds
the benchmark's GPT (``benchmarks.model``, config ``gpu``: about 25M parameters, 8,192 tokens per
step) from fixed weights, and trains ``warmup + steps`` steps of each variant on the same batches:

- ``plain``: the model and ``torch.optim.AdamW``, nothing else;
- ``zero1`` / ``zero2`` / ``zero3``: the same, through ``lightning_zero.engine.ShardedModel`` with one
  unit per ``Block`` and collective checks off (the engine's fast path);
- ``zero3-checks``: stage 3 with the default checks (an agreement per step on a CPU gloo group);
- ``zero3-offload``: stage 3 with ``offload_optimizer=True`` (pinned host shards, the step on the CPU).

The engine's ``Comm`` runs with ``run_alone=True``: its collectives are issued over NCCL even with
one rank, so the asynchronous handles, stream waits, events and buffers of a real run are exercised
(see [Note: streams] in ``engine/comm/comm.py``). With one rank there is nothing to shard, so this
measures the engine's own overhead on a GPU (its flat buffers, hooks, copies and collectives), not
its memory savings. ``--sanitizer`` runs two steps of every variant on the tiny model under torch's
CUDA sanitizer (``torch.cuda._sanitizer``), which reports a kernel that reads or writes a tensor
another stream is using without synchronisation, and records what it reported. Per variant and precision it reports the
median step time, tokens/s, the overhead ratio against ``plain``, ``torch.cuda.max_memory_allocated``
and the largest loss difference from ``plain``. A variant or precision that fails is reported with
its error, not raised. The result is printed as a table and, if ``$OUT`` is set (or ``--out``),
written as JSON to ``$OUT/gpu_check.json``. Nothing runs at import; on an H200 the defaults take well
under five minutes (``--max-seconds`` stops starting new variants past a budget).

If ``lightning`` is not installed, the engine is loaded without the package's Lightning glue (the
engine is pure torch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import types
from contextlib import nullcontext
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

VARIANTS = ("plain", "zero1", "zero2", "zero3", "zero3-checks", "zero3-offload")
PRECISIONS = ("32-true", "bf16-mixed")


def import_engine() -> tuple[types.ModuleType, str]:
    """``lightning_zero.engine`` and how it was imported ("package", or "engine only" without lightning)."""
    try:
        import lightning_zero.engine as engine

        return engine, "package"
    except ImportError as error:
        if "lightning" not in str(error):
            raise
        package = types.ModuleType("lightning_zero")  # skip lightning_zero/__init__.py, which imports lightning
        package.__path__ = [str(ROOT / "lightning_zero")]
        sys.modules["lightning_zero"] = package
        import lightning_zero.engine as engine

        return engine, "engine only (lightning not installed)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=(*PRECISIONS, "both"), default="both")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated from {','.join(VARIANTS)}")
    parser.add_argument("--config", default=None, help="benchmarks.model config (default: gpu; tiny with --dry-run)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 30; 3 with --dry-run)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; 1 with --dry-run)")
    parser.add_argument("--max-seconds", type=float, default=240.0, help="start no variant after this many seconds")
    parser.add_argument("--dry-run", action="store_true", help="CPU and gloo, tiny model: checks the logic only")
    parser.add_argument("--out", default=None, help="folder for gpu_check.json (default: $OUT, if set)")
    parser.add_argument("--sanitizer", action="store_true", help="also: 2 steps per variant under CUDA sanitizer")
    args = parser.parse_args(argv)
    args.config = args.config or ("tiny" if args.dry_run else "gpu")
    args.steps = args.steps or (3 if args.dry_run else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 5)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    if "plain" not in args.variants:
        args.variants.insert(0, "plain")  # the reference of every ratio
    args.precisions = list(PRECISIONS) if args.precision == "both" else [args.precision]
    return args


def init_group(device: Any) -> str:
    """A one-rank process group: NCCL on CUDA, gloo on the CPU. Returns the backend."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    init_file = Path(tempfile.mkdtemp(prefix="gpu_check_")) / "rendezvous"
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device  # binds the NCCL communicator to this GPU eagerly
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=0, world_size=1, **kwargs)
    except TypeError:  # a torch without device_id
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=0, world_size=1)
    return backend


def collective_sanity(device: Any) -> str:
    import torch
    import torch.distributed as dist

    try:
        t = torch.ones(4, device=device)
        dist.all_reduce(t)
        return "ok" if bool((t == 1).all()) else f"unexpected all_reduce result {t.tolist()}"
    except Exception as error:
        return f"{type(error).__name__}: {error}"


def run_variant(variant: str, precision: str, args: argparse.Namespace, device: Any) -> dict[str, Any]:
    import torch

    from benchmarks.model import CONFIGS, BenchData, build_model, reference_state_dict

    engine, _ = import_engine()
    config = CONFIGS[args.config]
    model = build_model(config, reference_state_dict(config, seed=0), device)
    data = BenchData(config, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    sharded = None
    if variant != "plain":
        stage = int(variant.split("-")[0][-1])
        if variant.endswith("-checks"):
            from lightning_zero.engine.comm.control import ControlChannel

            comm = engine.Comm(checks="auto", control=ControlChannel.create(run_alone=True), run_alone=True)
        else:
            comm = engine.Comm(checks="off", run_alone=True)
        sharded = engine.shard_model(
            model,
            stage=stage,
            comm=comm,
            units=engine.module_class_policy(["Block"]),
            offload_optimizer=variant.endswith("-offload"),
        )
        sharded.bind_optimizer(optimizer)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    after_setup = torch.cuda.memory_allocated(device) if cuda else None
    losses: list[float] = []
    times: list[float] = []
    for step in range(args.warmup + args.steps):
        x, y = data.batch(step, 0, device)
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if sharded is not None and sharded.comm.control is not None:
            sharded.comm.begin_sequence("training", [step], lambda step=step: f"step {step}")
        with sharded.step_context() if sharded is not None else nullcontext():
            autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16-mixed" else nullcontext()
            with autocast:
                loss = model(x, y)
            loss.backward()
        optimizer.step()
        if sharded is not None:
            sharded.after_optimizer_step(optimizer)
        losses.append(loss.item())  # synchronizes, for every variant alike
        if cuda:
            torch.cuda.synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {
        "status": "ok",
        "step_time_median_s": median,
        "tokens_per_s": config.batch_size * config.block_size / median,
        "losses": losses,
        "memory_allocated_after_setup": after_setup,
        "max_memory_allocated": torch.cuda.max_memory_allocated(device) if cuda else None,
        "model_state": sharded.memory_stats() if sharded is not None else None,
    }


def run_sanitizer(args: argparse.Namespace, device: Any) -> dict[str, str]:
    """Two steps of every variant on the tiny model under torch's CUDA sanitizer; what each reported."""
    import torch.cuda._sanitizer as sanitizer

    tiny = argparse.Namespace(**{**vars(args), "config": "tiny", "steps": 1, "warmup": 1})
    sanitizer.enable_cuda_sanitizer()
    results: dict[str, str] = {}
    for variant in args.variants:
        try:
            run_variant(variant, "32-true", tiny, device)
            results[variant] = "ok: no unsynchronized access reported"
        except Exception as error:  # the sanitizer raises CUDASanitizerErrors on a race
            results[variant] = f"{type(error).__name__}: {error}"[:2000]
    return results


def compare(rows: list[dict[str, Any]]) -> None:
    """Overhead and loss difference of each row against ``plain`` at the same precision."""
    plain = {r["precision"]: r for r in rows if r["variant"] == "plain" and r["status"] == "ok"}
    for row in rows:
        ref = plain.get(row["precision"])
        if row["status"] != "ok" or ref is None:
            continue
        row["overhead_vs_plain"] = row["step_time_median_s"] / ref["step_time_median_s"]
        row["max_loss_diff_vs_plain"] = max(abs(a - b) for a, b in zip(row["losses"], ref["losses"]))


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | precision | step (ms) | tokens/s | vs plain | max \\|Δloss\\| vs plain | max allocated (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | {r['precision']} | {r['status']}: {r.get('error', '')[:120]} | | | | |")
            continue
        mem = r["max_memory_allocated"]
        lines.append(
            f"| {r['variant']} | {r['precision']} | {r['step_time_median_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | "
            f"{r.get('overhead_vs_plain', float('nan')):.2f}x | {r.get('max_loss_diff_vs_plain', float('nan')):.1e} | "
            f"{'n/a' if mem is None else f'{mem / 2**20:,.0f}'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.perf_counter()
    import torch
    import torch.distributed as dist

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --dry-run to check the logic on the CPU")
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: keep the comparison exact
        torch.backends.cudnn.allow_tf32 = False
    _, import_mode = import_engine()
    report: dict[str, Any] = {
        "kind": "gpu_check",
        "dry_run": args.dry_run,
        "config": args.config,
        "steps": args.steps,
        "warmup": args.warmup,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "lightning_zero_import": import_mode,
        "backend": init_group(device),
    }
    report["collective_sanity"] = collective_sanity(device)
    if device.type == "cuda":
        report["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    rows: list[dict[str, Any]] = []
    for precision in args.precisions:
        for variant in args.variants:
            row: dict[str, Any] = {"variant": variant, "precision": precision}
            if time.perf_counter() - started > args.max_seconds:
                row.update(status="skipped", error=f"past --max-seconds {args.max_seconds:g}")
            else:
                try:
                    row.update(run_variant(variant, precision, args, device))
                except Exception as error:  # an unsupported option is a result, not a crash
                    traceback.print_exc()
                    row.update(status="failed", error=f"{type(error).__name__}: {error}"[:500])
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            print(f"{variant} {precision}: {row.get('step_time_median_s', row.get('error'))}", flush=True)
    compare(rows)
    report["rows"] = rows
    if args.sanitizer and device.type == "cuda":
        report["sanitizer"] = run_sanitizer(args, device)
    report["wall_s"] = time.perf_counter() - started
    text = table(rows)
    print(f"\n{report['device']}, torch {report['torch']}, config {args.config}, {args.warmup}+{args.steps} steps\n")
    print(text)
    out = args.out or os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_check.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
        (Path(out) / "gpu_check.md").write_text(text + "\n", encoding="utf-8")
        print(f"\nwritten: {Path(out) / 'gpu_check.json'}")
    dist.barrier()
    dist.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
