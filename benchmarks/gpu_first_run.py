"""The first GPU run: every variant of the engine against plain single-device training, and what a step must not do.

    python benchmarks/gpu_first_run.py                         # on a machine with a CUDA GPU (two: one more check)
    python benchmarks/gpu_first_run.py --json out.json         # also the table and every figure as JSON
    python benchmarks/gpu_first_run.py --device cpu            # the device-independent checks, tiny model, gloo

Self-contained, like ``benchmarks/gpu_check.py`` (whose one-rank process group it reuses): no torchrun, and it
loads the engine alone, without Lightning (``first_run.load_engine``). It exits with 1 if any check fails (0 when every
check passed or was skipped, with the reason), after printing one table row per check:

- ``parity``: each variant of ``benchmarks/first_run/training.py`` (stages 1-3, the collective checks,
  ``prefetch=2``, ``"bf16-mixed"`` with the default and with an fp32 ``param_dtype``, ``offload_optimizer``,
  ``offload_params``, int8 weights and gradients, compiled blocks) trains like plain training of the same model on
  the same seed and batches: bit for bit where the arithmetic is the same, within the documented bounds where it
  is not (see [Note: what each variant is held to] there). Plain training must be deterministic itself
  (``determinism``) and must learn (``trains``).
- ``no engine sync``: ``torch.cuda.set_sync_debug_mode("warn")`` over a steady step of each variant reports no
  host synchronisation from a frame of ``lightning_zero`` (see [Note: host synchronisations] in
  ``first_run/probes.py``). CPU: skipped.
- ``async save``: a background save (the driver's path: staged on the host, written by a thread) while training
  goes on holds the values of its step, bit for bit, and training resumed from it continues the run bit for bit.
- ``race``: every collective made late (``DelayedComm``: a side-stream sleep on CUDA, a worker thread's sleep on
  a CPU) changes no result, bit for bit.
- ``flat counts``: over ``--count-steps`` steady steps nothing grows: live tensors, threads, and on CUDA the
  CUDA events, pinned host buffers and their bytes, the device bytes allocated and the caching host allocator's
  current figures; with device timing on (``log_stats``) the events held stay within one step's collectives.
- ``offload memory`` (CUDA): the peak ``torch.cuda.max_memory_allocated`` of ``offload_optimizer`` and
  ``offload_params`` steps against ``estimate_memory``'s ``device_peak`` (with profiled activations), within
  ``first_run.checks.MEMORY_BOUNDS``.
- ``two ranks``: a rank that leaves the recorded track makes both ranks raise ``CollectiveMismatchError`` within
  seconds (``first_run/ranks.py``): over NCCL when two GPUs exist, over gloo on the CPU always.

On CUDA, TF32 is off, cuBLAS and torch run deterministically, and attention runs torch's math kernel (the fused
attention backward sums in a nondeterministic order, which would make a bitwise comparison meaningless). Nothing
runs at import. On an H200 the whole script is meant to take well under ten minutes (not measured yet);
``--device cpu`` takes under a minute on two shared cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SECTIONS = ("determinism", "alignment", "parity", "async save", "race", "flat counts", "offload memory", "two ranks")
RACE_VARIANTS = ("zero1", "zero2", "zero3-prefetch2", "zero2-offload", "zero3-offload-params", "zero3-int8")
COUNT_VARIANTS = ("zero2", "zero3", "zero3-offload", "zero3-offload-params", "zero3-int8")
MEMORY_VARIANTS = ("zero3-offload", "zero3-offload-params")


@dataclass
class Row:
    """One check's result: ``status`` is ``pass``, ``FAIL`` or ``skipped (why)``."""

    check: str
    variant: str
    status: str
    detail: str
    seconds: float = 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--config", default=None, help="benchmarks.model config (default: gpu; tiny on the CPU)")
    parser.add_argument("--steps", type=int, default=None, help="steps per parity run (default 12; 4 on the CPU)")
    parser.add_argument("--count-steps", type=int, default=50, help="steps over which counts must stay flat")
    parser.add_argument("--delay-ms", type=float, default=None, help="how late each collective starts (race)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated from {','.join(SECTIONS)}")
    parser.add_argument("--variants", default=None, help="comma-separated variant names (default: all)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the report as JSON to this file")
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    args.config = args.config or ("tiny" if cpu else "gpu")
    args.steps = args.steps or (4 if cpu else 12)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the step checked for host synchronisations is a steady one)")
    args.delay_ms = args.delay_ms if args.delay_ms is not None else (5.0 if cpu else 2.0)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    return args


def setup(args: argparse.Namespace) -> Any:
    """The device, made deterministic on CUDA (see the module's docstring), and the one-rank process group."""
    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on a GPU machine, or pass --device cpu for the CPU checks")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # two cores shared: without it every op waits for the other's threads
    from benchmarks.first_run import load_engine
    from benchmarks.gpu_check import init_group

    args.engine_import = load_engine()
    init_group(device)
    return device


class Checks:
    """The checks, run one after another; each one that raises is a failure with its error, never a crash."""

    def __init__(self, args: argparse.Namespace, device: Any) -> None:
        from benchmarks.first_run.training import BY_NAME, VARIANTS
        from benchmarks.model import CONFIGS

        self.args, self.device, self.config = args, device, CONFIGS[args.config]
        self.cuda = device.type == "cuda"
        names = args.variants.split(",") if args.variants else [v.name for v in VARIANTS]
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            raise SystemExit(f"unknown variant(s) {unknown}; choose from {', '.join(BY_NAME)}")
        self.variants = [BY_NAME[n] for n in names]
        self.rows: list[Row] = []
        self._references: dict[Any, Any] = {}
        self._trained: dict[str, Any] = {}

    def check(self, check: str, variant: str, body: Callable[[], tuple[bool | None, str]]) -> None:
        """Run ``body`` (``(passed, detail)``; ``passed`` is ``None`` for a skip, whose detail says why)."""
        started = time.perf_counter()
        try:
            passed, detail = body()
            if passed is None:
                status, detail = f"skipped ({detail})", ""
            else:
                status = "pass" if passed else "FAIL"
        except Exception as error:
            traceback.print_exc()
            status, detail = "FAIL", f"{type(error).__name__}: {error}"[:600]
        row = Row(check, variant, status, detail, time.perf_counter() - started)
        self.rows.append(row)
        print(f"[{row.seconds:6.1f}s] {check} {variant}: {row.status} {row.detail}", flush=True)
        if self.cuda:
            import torch

            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ plain training and parity
    def reference(self, variant: Any) -> Any:
        from benchmarks.first_run.training import PlainRun, train

        key = variant.reference.on(self.device)
        if key not in self._references:
            self._references[key] = train(PlainRun(key, self.config, self.device), self.args.steps)
        return self._references[key]

    def determinism(self) -> None:
        from benchmarks.first_run.training import PlainRun, Reference, compare, train

        def body() -> tuple[bool, str]:
            first = self.reference(_plain())
            again = train(PlainRun(Reference(), self.config, self.device), self.args.steps)
            return compare(first, again, "bitwise", self.args.steps)

        def trains() -> tuple[bool, str]:
            losses = self.reference(_plain()).losses
            end = sum(losses[-2:]) / 2
            return end < losses[0], f"loss {losses[0]:.4f} at the first step, {end:.4f} over the last two"

        self.check("determinism", "plain twice", body)
        self.check("trains", "plain", trains)

    def parity(self) -> None:
        from benchmarks.first_run.probes import capture_host_reads, capture_syncs
        from benchmarks.first_run.training import ShardedRun, compare, train

        steady = self.args.steps - 1
        for variant in self.variants:
            syncs: list[Any] = []

            def on_step(index: int, syncs: list = syncs) -> Any:
                if index != steady:
                    return None
                return _recording(capture_syncs() if self.cuda else capture_host_reads(), syncs)

            def body(variant: Any = variant, on_step: Callable = on_step) -> tuple[bool, str]:
                trained = train(ShardedRun(variant, self.config, self.device), self.args.steps, on_step)
                self._trained[variant.name] = trained
                return compare(self.reference(variant), trained, variant.bound, self.args.steps)

            self.check("parity", variant.name, body)
            if not self.cuda:

                def no_read(variant: Any = variant, syncs: list = syncs) -> tuple[bool, str]:
                    # The CPU's view of the same property: the engine reads no tensor value on the host in a backward
                    # pass, and at most once in the whole steady step (the flags, before the optimizer step).
                    if variant.name not in self._trained:
                        return False, "the parity run failed before its steady step"
                    ours = [r for r in (syncs[0] if syncs else []) if r.engine]
                    in_backward = [r for r in ours if r.in_backward]
                    shown = "; ".join(sorted({r.frame for r in ours})[:4])
                    passed = not in_backward and len(ours) <= 1
                    return passed, f"{len(ours)} engine host reads, {len(in_backward)} in backward ({shown or 'none'})"

                self.check("no engine host read", variant.name, no_read)
                continue

            def no_sync(variant: Any = variant, syncs: list = syncs) -> tuple[bool | None, str]:
                if variant.name not in self._trained:
                    return False, "the parity run failed before its steady step"
                found = syncs[0] if syncs else []
                ours = [s for s in found if s.engine]
                shown = "; ".join(sorted({f"{s.frame} [{s.thread}]" for s in ours})[:4])
                return not ours, f"{len(ours)} from lightning_zero ({shown or 'none'}), {len(found) - len(ours)} other"

            self.check("no engine sync", variant.name, no_sync)

    def trained(self, variant: Any) -> Any:
        from benchmarks.first_run.training import ShardedRun, train

        if variant.name not in self._trained:
            self._trained[variant.name] = train(ShardedRun(variant, self.config, self.device), self.args.steps)
        return self._trained[variant.name]

    # ------------------------------------------------------------------ reduction chunks
    def alignment(self) -> None:
        """Every rank's chunk of a reduction starts on a 16-byte boundary (NCCL's vectorized paths need it), at
        every world size to 8 and every dtype the engine reduces in (see [Note: aligned chunks] in
        ``lightning_zero/engine/core/layout.py``)."""
        import torch

        from lightning_zero.engine.core.layout import ShardLayout
        from lightning_zero.engine.schedule.reduce import reduce_width

        def body() -> tuple[bool, str]:
            misaligned = []
            for world_size in range(1, 9):
                for numel in (1, 7, 1000, 4099):
                    layout = ShardLayout.from_shapes([torch.Size([numel])], world_size)
                    for dtype in (torch.float32, torch.bfloat16, torch.float16):
                        width = reduce_width(layout, dtype)
                        if any(rank * width * dtype.itemsize % 16 for rank in range(world_size)):
                            misaligned.append(f"{numel} over {world_size} in {dtype}")
            return not misaligned, f"{len(misaligned)} misaligned layouts ({', '.join(misaligned[:3]) or 'none'})"

        self.check("aligned chunks", "reduce-scatter", body)

    # ------------------------------------------------------------------ asynchronous saves
    def async_save(self) -> None:
        from benchmarks.first_run import checks as bodies
        from benchmarks.first_run.training import BY_NAME

        def body() -> tuple[bool, str]:
            return bodies.async_save(BY_NAME["zero3"], self.config, self.device, self.args.steps, self.trained)

        self.check("async save", "zero3", body)

    # ------------------------------------------------------------------ late collectives
    def race(self) -> None:
        from benchmarks.first_run.probes import DelayedComm
        from benchmarks.first_run.training import ShardedRun, compare, one_rank_comm, train

        for variant in (v for v in self.variants if v.name in RACE_VARIANTS):

            def body(variant: Any = variant) -> tuple[bool, str]:
                comm = one_rank_comm(variant, DelayedComm, delay_s=self.args.delay_ms / 1000)
                try:
                    late = train(ShardedRun(variant, self.config, self.device, comm=comm), self.args.steps)
                finally:
                    comm.close()
                ok, detail = compare(self.trained(variant), late, "bitwise", self.args.steps)
                return ok and comm.delayed > 0, f"{comm.delayed} collectives {self.args.delay_ms:g} ms late; {detail}"

            self.check("race", variant.name, body)

    # ------------------------------------------------------------------ nothing grows
    def flat_counts(self) -> None:
        from benchmarks.first_run import checks as bodies
        from benchmarks.first_run.training import BY_NAME

        chosen = [v for v in self.variants if v.name in COUNT_VARIANTS]
        if BY_NAME["zero3"] in self.variants:
            chosen.append(BY_NAME["zero3"])  # again, with device timing on (log_stats)
        for number, variant in enumerate(chosen):
            timed = number == len(chosen) - 1 and variant.name == "zero3"
            name = variant.name + (" timed" if timed else "")

            def body(variant: Any = variant, timed: bool = timed) -> tuple[bool, str]:
                return bodies.flat_counts(variant, self.config, self.device, self.args.count_steps, timed)

            self.check("flat counts", name, body)

    # ------------------------------------------------------------------ offload memory
    def offload_memory(self) -> None:
        from benchmarks.first_run import checks as bodies

        for variant in (v for v in self.variants if v.name in MEMORY_VARIANTS):
            if not self.cuda:
                self.check("offload memory", variant.name, lambda: (None, "cpu"))
                continue

            def body(variant: Any = variant) -> tuple[bool, str]:
                return bodies.offload_memory(variant, self.config, self.device)

            self.check("offload memory", variant.name, body)

    # ------------------------------------------------------------------ two ranks
    def two_ranks(self) -> None:
        import torch

        from benchmarks.first_run import checks as bodies

        backends = ["gloo"]
        if self.cuda:
            backends.insert(0, "nccl")
        for backend in backends:
            if backend == "nccl" and torch.cuda.device_count() < 2:
                self.check("two ranks", "nccl", lambda: (None, f"{torch.cuda.device_count()} GPU"))
                continue
            config = self.args.config if backend == "nccl" else "tiny"
            self.check("two ranks", backend, lambda backend=backend, config=config: bodies.two_ranks(backend, config))


def _plain() -> Any:
    from benchmarks.first_run.training import Variant

    return Variant("plain", 0)


class _recording:
    """A context manager that enters ``inner`` and appends what it yields to ``into``."""

    def __init__(self, inner: Any, into: list) -> None:
        self.inner, self.into = inner, into

    def __enter__(self) -> Any:
        value = self.inner.__enter__()
        self.into.append(value)
        return value

    def __exit__(self, *exc: Any) -> Any:
        return self.inner.__exit__(*exc)


def table(rows: list[Row]) -> str:
    lines = ["| check | variant | result | detail | s |", "|---|---|---|---|---:|"]
    for r in rows:
        detail = r.detail.replace("|", "\\|")
        lines.append(f"| {r.check} | {r.variant} | {r.status} | {detail} | {r.seconds:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    device = setup(args)
    import torch
    import torch.distributed as dist

    suite = Checks(args, device)
    attention: Any = nullcontext()
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        attention = sdpa_kernel(SDPBackend.MATH)  # deterministic (see the module's docstring)
    runs = {
        "determinism": suite.determinism,
        "alignment": suite.alignment,
        "parity": suite.parity,
        "async save": suite.async_save,
        "race": suite.race,
        "flat counts": suite.flat_counts,
        "offload memory": suite.offload_memory,
        "two ranks": suite.two_ranks,
    }
    with attention:
        for section in SECTIONS:
            if section in args.sections:
                runs[section]()
    failed = [r for r in suite.rows if r.status == "FAIL"]
    report = {
        "kind": "gpu_first_run",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "config": args.config,
        "steps": args.steps,
        "count_steps": args.count_steps,
        "delay_ms": args.delay_ms,
        "lightning_zero_import": args.engine_import,
        "rows": [asdict(r) for r in suite.rows],
        "failed": len(failed),
        "wall_s": time.perf_counter() - started,
    }
    heading = f"{report['device']}, torch {report['torch']}, config {args.config}, {args.steps} steps per run"
    print(f"\n{heading}, {report['wall_s']:.0f} s\n")
    print(table(suite.rows))
    print(f"\n{len(failed)} failed, {len(suite.rows) - len(failed)} passed or skipped")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1), encoding="utf-8")
        print(f"written: {args.json}")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
