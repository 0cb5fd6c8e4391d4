"""The largest GPT each system trains on this machine's 2 CPU ranks under a memory budget.

Every system gets the same question: does a ``BenchGPT`` of this size train 3 optimizer steps (fp32
weights, torch's AdamW, a micro-batch of 1 x 128 tokens per rank) with *every* process's peak RSS
under ``--budget-gib / world_size``? A probe is one fresh job (``run_on_cpu_ranks``: new
interpreters, so nothing of an earlier probe is counted), and the answer is read from the kernel's
high-water mark (``VmHWM``) of each rank at the end. A watchdog thread in each rank stops the job
(exit code 75) as soon as its RSS passes the limit, so a probe that does not fit ends early instead
of pushing the machine into swap or the OOM killer.

The sizes form one ladder: width fixed at ``--n-embd`` (1024, 16 heads), depth grown from 4 blocks
in steps of about 10% of the parameter count. Each system's search starts where the theory puts it
(bytes per parameter at rest: DDP 20Ψ with its gradient buckets, ZeRO-1 ``4Ψ+4Ψ+8Ψ/N``, ZeRO-2
``4Ψ+12Ψ/N``, ZeRO-3 / FSDP2 / DeepSpeed-3 ``16Ψ/N``) and walks the ladder (steps that double, then
bisection) to the boundary: the largest rung that fits, with the next one not fitting. That assumes that
fitting is monotone in size, which it is for these models (every term grows with depth).

Systems (each as ``benchmarks.systems`` builds it, model built whole on every rank and then handed
over, as a user without meta init does; at 2 ranks that is not the binding peak of any sharded
system, 4Ψ < 16Ψ/2):

- ``ddp``: ``DistributedDataParallel`` with its defaults;
- ``fsdp2``: ``fully_shard`` per block and on the root;
- ``ds-zero3``: DeepSpeed ZeRO-3 on its CPU accelerator (needs the ``deepspeed`` package);
- ``zero1-defaults`` / ``zero2-defaults`` / ``zero3-defaults``: our stages with the strategies' defaults;
- ``zero3-offload``: stage 3 defaults with ``offload_params=True``. On a CPU-only machine host memory
  *is* device memory, so it can only match ``zero3-defaults`` here; the row shows that it costs nothing
  extra. Its gain is device memory on a GPU (``benchmarks/gpu_check.py``).

Usage (never in CI; an idle machine, 20-60 minutes)::

    python -m benchmarks.capacity                              # 20 GiB for the 2-rank job
    python -m benchmarks.capacity --budget-gib 12 --systems ddp,zero3-defaults

Prints one markdown row per system (largest parameter count, its shape, its ratio to DDP's, the peak
RSS of its ranks) and writes every probe, the options and the versions to ``--out`` as JSON (default
``benchmarks/results/<timestamp>-capacity.json``), the table next to it (``.md``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

GIB = 2**30
WATCHDOG_EXIT = 75  # a rank's exit code when its RSS passed the limit
SYSTEM_NAMES = (
    "ddp",
    "fsdp2",
    "ds-zero3",
    "zero1-defaults",
    "zero2-defaults",
    "zero3-defaults",
    "zero3-offload",
)
# Bytes per parameter at rest on one rank of N, the search's starting guess (fp32 Adam: 4 + 4 + 8).
_BYTES_AT_REST = {
    "ddp": lambda n: 20.0,  # params, grads and DDP's gradient buckets (gradient_as_bucket_view=False)
    "zero1-defaults": lambda n: 8.0 + 8.0 / n,
    "zero2-defaults": lambda n: 4.0 + 12.0 / n,
}


def bytes_at_rest(system: str, world_size: int) -> float:
    return _BYTES_AT_REST.get(system, lambda n: 16.0 / n)(world_size)


@dataclass(frozen=True)
class Rung:
    """One size of the ladder: ``n_layer`` blocks of width ``n_embd``."""

    n_layer: int
    n_embd: int

    def config(self) -> Any:
        from benchmarks.model import BenchConfig

        return BenchConfig(
            n_layer=self.n_layer, n_head=self.n_embd // 64, n_embd=self.n_embd, block_size=128, batch_size=1
        )

    def numel(self) -> int:
        """Parameters of ``BenchGPT`` at this shape (the tied embedding once), without building it."""
        cfg = self.config()
        d = cfg.n_embd
        block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
        return cfg.vocab_size * d + cfg.block_size * d + cfg.n_layer * block + 2 * d


def ladder(n_embd: int, first: int = 4, last: int = 400, growth: float = 1.10) -> list[Rung]:
    """Depths from ``first`` blocks, each about ``growth`` times the previous parameter count."""
    depths = [first]
    while depths[-1] < last:
        depths.append(max(depths[-1] + 1, round(depths[-1] * growth)))
    return [Rung(d, n_embd) for d in depths]


# ------------------------------------------------------------------------------------------ one probe


def _watchdog(limit: int, stop: threading.Event, marker: Path) -> None:
    from benchmarks.footprint import current_rss_bytes

    while not stop.wait(0.02):
        rss = current_rss_bytes()
        if rss > limit:
            # The marker tells the parent why the job ended: the other rank may fail first, in a collective.
            marker.write_text(f"RSS {rss / GIB:.2f} GiB passed the limit {limit / GIB:.2f} GiB")
            os._exit(WATCHDOG_EXIT)


def probe_rank(
    rank: int, world_size: int, system: str, rung: Rung, limit: int, steps: int, markers: str
) -> dict[str, Any]:
    """One rank of one probe: build ``system`` at ``rung``, train ``steps`` steps, report the peak RSS."""
    import torch.distributed as dist

    from benchmarks.counting import CommCounter
    from benchmarks.engine_mode import quiet_warnings
    from benchmarks.footprint import peak_rss_bytes
    from benchmarks.model import BenchData, BenchGPT
    from benchmarks.systems import SYSTEMS, BuildContext, deepspeed_unavailable

    stop = threading.Event()
    marker = Path(markers) / f"rank{rank}"
    threading.Thread(target=_watchdog, args=(limit, stop, marker), daemon=True).start()
    quiet_warnings()
    torch.set_num_threads(1)
    config = rung.config()

    class FreshContext(BuildContext):
        """Builds the model from a seed (no reference state dict: it would be a second copy)."""

        def model(self) -> BenchGPT:
            torch.manual_seed(0)
            return BenchGPT(config)

    spec = SYSTEMS["zero3-defaults" if system == "zero3-offload" else system]
    if system == "ds-zero3":
        reason = deepspeed_unavailable()
        if reason is not None:
            return {"status": "skipped", "reason": reason}
    ctx = FreshContext(config, {}, CommCounter())
    if system == "zero3-offload":
        from benchmarks.systems import build_ours

        trainee = build_ours(3, checks="auto", block_units=False, offload_params=True)(ctx)
    else:
        trainee = spec.build(ctx)
    data = BenchData(config, seed=0)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        x, y = data.batch(step, rank)
        losses.append(trainee.step(x, y))
    elapsed = time.perf_counter() - start
    state = trainee.state_bytes().as_dict()
    dist.barrier()
    peak = peak_rss_bytes()
    stop.set()
    if not all(math.isfinite(v) for v in losses):
        return {"status": "failed", "reason": f"non-finite loss {losses}"}
    return {"status": "ok", "peak_rss": peak, "state_bytes": state, "losses": losses, "train_s": elapsed}


def run_probe(system: str, rung: Rung, world_size: int, limit: int, steps: int, timeout: float) -> dict[str, Any]:
    """One fresh job; ``fits`` says whether every rank finished under ``limit`` bytes of peak RSS."""
    from lightning_zero.tools.processes import run_on_cpu_ranks

    record: dict[str, Any] = {"system": system, "n_layer": rung.n_layer, "n_embd": rung.n_embd, "numel": rung.numel()}
    start = time.perf_counter()
    markers = tempfile.mkdtemp(prefix="capacity_")
    try:
        ranks = run_on_cpu_ranks(
            probe_rank,
            world_size,
            timeout=timeout,
            name=f"capacity {system} {rung.n_layer}x{rung.n_embd}",
            system=system,
            rung=rung,
            limit=limit,
            steps=steps,
            markers=markers,
        )
    except Exception as error:  # the watchdog's exit, an OOM kill, an error in the system
        over = sorted(Path(markers).iterdir())
        if over:
            record.update(status="over budget", fits=False, reason=f"{over[0].name}: {over[0].read_text()}")
        else:
            traceback.print_exc()
            record.update(status="failed", fits=False, reason=str(error).strip().splitlines()[-1][:300])
    else:
        if any(r["status"] == "skipped" for r in ranks):
            record.update(status="skipped", fits=False, reason=ranks[0]["reason"])
        elif any(r["status"] != "ok" for r in ranks):
            record.update(status="failed", fits=False, reason=next(r["reason"] for r in ranks if r["status"] != "ok"))
        else:
            peaks = [r["peak_rss"] for r in ranks]
            record.update(
                status="ok" if max(peaks) <= limit else "over budget",
                fits=max(peaks) <= limit,
                peak_rss=peaks,
                state_bytes=ranks[0]["state_bytes"],
                losses=ranks[0]["losses"],
                train_s=max(r["train_s"] for r in ranks),
            )
    finally:
        shutil.rmtree(markers, ignore_errors=True)
    record["wall_s"] = round(time.perf_counter() - start, 1)
    return record


def search(
    system: str, rungs: list[Rung], world_size: int, limit: int, steps: int, timeout: float, log: Any
) -> tuple[Rung | None, list[dict[str, Any]]]:
    """The largest rung ``system`` fits, walking the ladder from the theory's guess; every probe made."""
    usable = limit - 1.0 * GIB  # what an interpreter with torch and the systems imported leaves, roughly
    guess = max((i for i, r in enumerate(rungs) if r.numel() * bytes_at_rest(system, world_size) <= usable), default=0)
    probes: dict[int, dict[str, Any]] = {}

    def fits(i: int) -> bool:
        if i not in probes:
            probes[i] = run_probe(system, rungs[i], world_size, limit, steps, timeout)
            log(probes[i])
        return bool(probes[i]["fits"])

    if not fits(guess):
        if probes[guess]["status"] != "over budget":  # skipped, or an error: no size to report
            return None, [probes[guess]]
        hi, step = guess, 1  # the smallest rung known not to fit
        lo = None
        while lo is None:
            i = max(hi - step, 0)
            if fits(i):
                lo = i
            elif probes[i]["status"] != "over budget":
                return None, [probes[k] for k in sorted(probes)]
            elif i == 0:
                return None, [probes[k] for k in sorted(probes)]
            else:
                hi, step = i, step * 2
    else:
        lo, step = guess, 1  # the largest rung known to fit
        hi = None
        while hi is None:
            i = lo + step
            if i >= len(rungs):
                hi = len(rungs)
            elif fits(i):
                lo, step = i, step * 2
            else:
                hi = i
    while hi - lo > 1:  # bisect between a rung that fits and one that does not
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    best = lo
    return (rungs[best] if best is not None else None), [probes[k] for k in sorted(probes)]


def table(rows: list[dict[str, Any]], budget_gib: float, world_size: int) -> str:
    ddp = next((r["numel"] for r in rows if r["system"] == "ddp" and r.get("numel")), None)
    lines = [
        f"Largest BenchGPT trained for 3 AdamW steps on {world_size} CPU ranks, every process under "
        f"{budget_gib / world_size:g} GiB of peak RSS ({budget_gib:g} GiB for the job)",
        "",
        "| system | largest model | shape (blocks x width) | x DDP | peak RSS per rank (GiB) | next rung |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("numel") is None:
            lines.append(f"| {r['system']} | {r['status']}: {r.get('reason', '')} | | | | |")
            continue
        ratio = f"{r['numel'] / ddp:.2f}" if ddp else "-"
        peaks = ", ".join(f"{p / GIB:.2f}" for p in r["peak_rss"])
        lines.append(
            f"| {r['system']} | {r['numel'] / 1e6:.0f}M | {r['n_layer']} x {r['n_embd']} | {ratio} | {peaks} "
            f"| {r['next_status']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=20.0, help="peak RSS of the whole job (split evenly)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--systems", default=",".join(SYSTEM_NAMES))
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per probe")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEM_NAMES))
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEM_NAMES)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    out = args.out or Path("benchmarks/results") / f"{time.strftime('%Y%m%d-%H%M%S')}-capacity.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    limit = int(args.budget_gib * GIB / args.world_size)
    rungs = ladder(args.n_embd)
    all_probes: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []

    def log(probe: dict[str, Any]) -> None:
        all_probes.append(probe)
        peaks = ", ".join(f"{p / GIB:.2f}" for p in probe.get("peak_rss", []))
        print(
            f"{probe['system']:>15} {probe['n_layer']:>4} x {probe['n_embd']} ({probe['numel'] / 1e6:.0f}M): "
            f"{probe['status']} {peaks} GiB {probe['wall_s']} s {probe.get('reason', '')}",
            flush=True,
        )

    for system in systems:
        best, probes = search(system, rungs, args.world_size, limit, args.steps, args.timeout, log)
        if best is None:
            last = probes[-1] if probes else {"status": "failed", "reason": "no probe"}
            rows.append({"system": system, "status": last["status"], "reason": last.get("reason", "")})
            continue
        won = next(p for p in probes if p["n_layer"] == best.n_layer)
        bigger = [p for p in probes if p["n_layer"] > best.n_layer]
        rows.append({**won, "next_status": bigger[0]["status"] if bigger else "top of the ladder"})
    text = table(rows, args.budget_gib, args.world_size)
    print(text)
    record = {
        "benchmark": "capacity",
        "budget_gib": args.budget_gib,
        "world_size": args.world_size,
        "steps": args.steps,
        "micro_batch": [1, 128],
        "ladder": [r.__dict__ for r in rungs],
        "rows": rows,
        "probes": all_probes,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    out.write_text(json.dumps(record, indent=1))
    out.with_suffix(".md").write_text(text + "\n")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
