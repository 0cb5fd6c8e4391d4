"""Benchmark lightning_zero against DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed, side by side.

    python -m benchmarks.run                                   # engine mode, every system, 2 CPU ranks
    python -m benchmarks.run --steps 20 --repeats 3 --systems ddp,zero1,zero3,fsdp2
    python -m benchmarks.run --mode trainer --steps 10         # through lightning.Trainer (and Fabric: fabric-*)
    python benchmarks/run.py --config tiny --steps 2 --repeats 1
    python -m benchmarks.run --summarize benchmarks/results/X.jsonl   # recompute a file's summary and table

Starts ``--world-size`` gloo processes once (one thread each, ``file://`` rendezvous); inside them
every system trains the same model from the same weights on the same batches, one system after
another, repeated. Writes one JSON line per system per repeat and a summary line to ``--out``
(default ``benchmarks/results/<timestamp>.jsonl``), and the markdown table next to it (``.md``),
which it also prints. See ``benchmarks/README.md`` for what each column means.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` and ``lightning_zero`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.model import CONFIGS
from benchmarks.results import jsonl_writer, markdown_table, summarize
from benchmarks.systems import DEFAULT_SYSTEMS, SYSTEMS

RESULTS = Path(__file__).resolve().parent / "results"
TRAINER_SYSTEMS = (
    "ddp",
    "zero1",
    "zero2",
    "zero3",
    "zero1-defaults",
    "zero2-defaults",
    "zero3-defaults",
    "fsdp",
    "fsdp2",
    "ds-zero1",
    "ds-zero2",
    "ds-zero3",
    "fabric-ddp",
    "fabric-zero1",
    "fabric-zero2",
    "fabric-zero3",
)


def _worker(rank: int, world_size: int, options: dict[str, Any]) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    emit = jsonl_writer(options["out"]) if rank == 0 else (lambda record: None)
    if options["mode"] == "engine":
        from benchmarks.engine_mode import run_engine_mode

        run_engine_mode(rank, world_size, options, emit)
    else:
        from benchmarks.trainer_mode import run_trainer_mode

        run_trainer_mode(rank, world_size, options, emit)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("engine", "trainer"), default="engine")
    parser.add_argument(
        "--systems",
        default=None,
        help=f"comma-separated; engine mode: {','.join(SYSTEMS)} (default: all); trainer mode: "
        f"{','.join(TRAINER_SYSTEMS)} (default: all). DDP is always added: it is the reference.",
    )
    parser.add_argument("--config", choices=sorted(CONFIGS), default="default", help="model size (tiny: smoke tests)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per system per repeat")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--repeats", type=int, default=2, help="rounds over all systems (order rotated each round)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before the whole run is abandoned")
    parser.add_argument("--out", default=None, help="JSON lines file (default benchmarks/results/<timestamp>.jsonl)")
    args = parser.parse_args(argv)
    known = SYSTEMS if args.mode == "engine" else TRAINER_SYSTEMS
    names = [s.strip() for s in args.systems.split(",") if s.strip()] if args.systems else None
    names = names or (DEFAULT_SYSTEMS if args.mode == "engine" else list(TRAINER_SYSTEMS))
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown system(s) {unknown} for --mode {args.mode}; choose from {', '.join(known)}")
    args.systems = names if "ddp" in names else ["ddp", *names]
    if min(args.steps, args.repeats, args.world_size) < 1 or args.warmup < 0:
        parser.error("--steps, --repeats and --world-size must be >= 1, --warmup >= 0")
    return args


def _load_average() -> float | None:
    """The 1-minute load average: on a shared machine, how much else competed for the cores."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def write_report(out: Path, meta: dict[str, Any]) -> str:
    """Summarize the run records in ``out``, append (or replace) its summary line, write the table
    next to it (``.md``); return the caption and table."""
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines() if line.strip()]
    records = [r for r in lines if r.get("kind") == "run"]
    rows = summarize(records)
    summary = {"kind": "summary", **meta, "rows": rows}
    out.write_text("".join(json.dumps(r) + "\n" for r in [*records, summary]), encoding="utf-8")
    first = records[0] if records else {}
    load = meta.get("load_average") or {}
    caption = (
        f"{meta.get('mode', first.get('mode'))} mode, {first.get('numel', 0):,} parameters, "
        f"{first.get('world_size', '?')} CPU ranks (gloo), {first.get('warmup', '?')}+{first.get('steps', '?')} steps "
        f"x {1 + max((r['repeat'] for r in records), default=0)} repeats, torch {first.get('torch', '?')}, "
        f"{meta.get('cpu_count', '?')} CPUs, 1-min load average {load.get('before')} before, {load.get('after')} after"
    )
    text = f"{caption}\n\n{markdown_table(rows)}\n"
    out.with_suffix(".md").write_text(text, encoding="utf-8")
    return text


def resummarize(path: str) -> str:
    """Recompute the summary and table of an existing results file (its run records are kept)."""
    out = Path(path)
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines() if line.strip()]
    old = next((r for r in reversed(lines) if r.get("kind") == "summary"), {})
    meta = {k: v for k, v in old.items() if k not in ("kind", "rows")}
    return write_report(out, meta)


def main(argv: list[str] | None = None) -> str:
    raw = sys.argv[1:] if argv is None else argv
    if raw[:1] == ["--summarize"]:
        if len(raw) != 2:
            raise SystemExit("usage: python -m benchmarks.run --summarize RESULTS.jsonl")
        text = resummarize(raw[1])
        print(text)
        return text
    args = parse_args(argv)
    from lightning_zero.tools.processes import run_on_cpu_ranks

    out = Path(args.out) if args.out else RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("", encoding="utf-8")
    options = {**vars(args), "out": str(out)}
    print(
        f"benchmark: --mode {args.mode}, systems {','.join(args.systems)}, config {args.config}, "
        f"{args.world_size} ranks, {args.warmup}+{args.steps} steps x {args.repeats} repeats -> {out}",
        flush=True,
    )
    started = time.perf_counter()
    load_before = _load_average()
    run_on_cpu_ranks(_worker, args.world_size, timeout=args.timeout, name="benchmark", options=options)
    meta = {
        "mode": args.mode,
        "command": " ".join(["python -m benchmarks.run", *raw]),
        "options": {k: v for k, v in options.items() if k != "timeout"},
        "wall_s": time.perf_counter() - started,
        "load_average": {"before": load_before, "after": _load_average()},
        "cpu_count": os.cpu_count(),
    }
    text = write_report(out, meta)
    print(f"\n{text}\nwritten: {out} and {out.with_suffix('.md')}", flush=True)
    return text


if __name__ == "__main__":
    main()
