"""Command line: ``python -m lightning_zero consolidate CHECKPOINT OUT``, ``... check-parity MODULE:ATTR``,
``... estimate --params 7B`` (or ``... estimate FILE.py:CLASS``) and ``... dry-run FILE.py:CLASS --world-size 512``.
A bad number is one line naming its flag and what it allows, with exit status 2, as argparse reports its own
errors (the library functions raise ``ArgumentValueError`` naming the argument, turned into the flag here).

Example::

    python -m lightning_zero estimate --params 7B --devices 8,64 --precision bf16-mixed --memory 80GB
    python -m lightning_zero estimate examples/dry_run_gpt.py:GPT1B --devices 8 --unit-modules Block
    python -m lightning_zero dry-run examples/dry_run_gpt.py:GPT1B --world-size 512 --batch-shape 1,128
    python -m lightning_zero consolidate runs/epoch=3-step=400.ckpt model.ckpt
    python -m lightning_zero consolidate runs/epoch=3-step=400.ckpt model.safetensors
    python -m lightning_zero check-parity my_package.models:MyModule --stage 3 --steps 5

``dry-run`` runs one rank of an N-rank job in this process (torch's fake process group: nothing is sent) and
prints what that rank holds and sends, beside the theory and ``estimate`` (see ``lightning_zero/tools/dry_run.py``).
``check-parity`` exits with 0 when the stage trained exactly like ``DDPStrategy`` (within ``--rtol``),
1 when it did not, and 2 when the module could not be loaded or a run failed. ``estimate`` prints the
model-state memory per device and the communication per step of DDP and each stage (see ``docs/memory.md``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pickle
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from lightning_zero.driver.checkpointing import consolidate
from lightning_zero.planning.arguments import ArgumentValueError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_zero", description="lightning_zero tools")
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser(
        "consolidate",
        help="turn a sharded checkpoint directory into one full checkpoint file",
        description="Write the full state of a sharded checkpoint (any world size, any stage) as one file: "
        "a .ckpt that DDPStrategy could have written (weights, optimizer states, Lightning state), or the "
        "weights only as .safetensors. Runs on one process, without GPUs.",
    )
    merge.add_argument("checkpoint", help="sharded checkpoint directory (or a full .ckpt file)")
    merge.add_argument("output", help="output file: *.ckpt (everything) or *.safetensors (weights only)")
    merge.add_argument(
        "--unsafe-pickle",
        action="store_true",
        help="allow arbitrary pickled objects in the checkpoint's metadata (only for files you trust)",
    )
    parity = commands.add_parser(
        "check-parity",
        help="train a few steps of a LightningModule under DDP and under a ZeRO stage, and compare",
        description="Train a few steps of your LightningModule (with its own train_dataloader) under "
        "DDPStrategy and under a ZeRO stage on CPU processes over gloo, from the same weights, seed and data, "
        "and print the per-step losses, the gradient norms before clipping and the largest parameter "
        "difference. Exit status: 0 if every difference is within --rtol, 1 if not, 2 if the module could "
        "not be loaded or a run failed.",
    )
    parity.add_argument(
        "target",
        metavar="MODULE:ATTR",
        help="a LightningModule class (built with no arguments) or a zero-argument function returning a "
        "LightningModule, e.g. my_package.models:MyModule; imported from the current directory too",
    )
    parity.add_argument("--stage", type=int, choices=(1, 2, 3), default=3, help="ZeRO stage (default: 3)")
    parity.add_argument("--steps", type=_positive_int, default=5, help="optimizer steps per run (default: 5)")
    parity.add_argument("--world-size", type=_positive_int, default=2, help="number of processes (default: 2)")
    parity.add_argument("--rtol", type=float, default=1e-5, help="largest relative difference (default: 1e-5)")
    parity.add_argument("--seed", type=int, default=0, help="seed for building the module and both runs")
    parity.add_argument("--timeout", type=float, default=600, help="seconds both runs may take (default: 600)")
    for what in ("weights", "grads"):
        parity.add_argument(
            f"--quantize-{what}",
            choices=("int8",),
            help=f"the ZeRO run with quantize_{what}=int8: the report is then its drift from the exact run",
        )
    estimate = _add_estimate_parser(commands)
    dry = _add_dry_run_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "estimate":
        return _estimate(estimate, args)
    if args.command == "dry-run":
        return _dry_run(dry, args)
    if args.command == "check-parity":
        return _check_parity(parser, args)
    return _consolidate(args)


def _consolidate(args: argparse.Namespace) -> int:
    """Exit status 0 when written, 2 (with one line on stderr, no traceback) when the input cannot be used."""
    from lightning_zero.engine.io.safe_read import CorruptCheckpointError, UnsafeCheckpointError

    def refuse(text: str) -> int:
        print("consolidate: " + " ".join(text.split()), file=sys.stderr)  # one line, whatever the message
        return 2

    try:
        checkpoint = consolidate(args.checkpoint, args.output, weights_only=False if args.unsafe_pickle else None)
    except pickle.UnpicklingError as error:  # --unsafe-pickle is the way out
        reason = error.reason if isinstance(error, UnsafeCheckpointError) else str(error)
        return refuse(f"{reason}. If you trust the file, add --unsafe-pickle to the command line.")
    except (FileNotFoundError, NotADirectoryError, PermissionError, CorruptCheckpointError) as error:
        return refuse(str(error))
    params = sum(v.numel() for v in checkpoint["state_dict"].values() if hasattr(v, "numel"))
    print(f"wrote {args.output}: {len(checkpoint['state_dict'])} tensors, {params:,} elements", file=sys.stderr)
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _refuse(parser: argparse.ArgumentParser, error: ValueError, flags: dict[str, str]) -> NoReturn:
    """Exit with status 2 and one line (argparse's ``error``), naming the flag of the argument ``error`` names."""
    if isinstance(error, ArgumentValueError) and error.argument in flags:
        parser.error(f"argument {flags[error.argument]}: {' '.join(error.requirement.split())}")
    parser.error(" ".join(str(error).split()))


# The flags of the arguments of estimate_memory and dry_run, for their errors (see ``ArgumentValueError``).
_ESTIMATE_FLAGS = {
    "model_or_numel": "--params",
    "devices": "--devices",
    "nodes": "--nodes",
    "precision": "--precision",
    "optimizer_state_bytes": "--optimizer-state-bytes",
    "reduce_dtype_bytes": "--reduce-dtype-bytes",
    "param_dtype_bytes": "--param-dtype-bytes",
    "bandwidth_gbps": "--bandwidth",
    "intra_node_gbps": "--intra-node-bandwidth",
    "inter_node_gbps": "--inter-node-bandwidth",
    "pcie_gbps": "--pcie-bandwidth",
    "memory_per_device": "--memory",
    "shard_size": "--shard-size",
    "prefetch": "--prefetch",
    "largest_unit_params": "--largest-unit",
    "accumulate_grad_batches": "--accumulate-grad-batches",
    "unit_modules": "--unit-modules",
}
_DRY_RUN_FLAGS = {
    "world_size": "--world-size",
    "stage": "--strategy",
    "rank": "--rank",
    "steps": "--steps",
    "batch_shape": "--batch-shape",
    "shard_size": "--shard-size",
    "precision": "--precision",
}


def _argument(convert: Any) -> Any:
    """An argparse ``type`` from a function that raises ``ValueError`` with a readable message."""

    def parse(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from error

    parse.__name__ = convert.__name__
    return parse


def _device_counts(text: str) -> list[int]:
    counts = []
    for part in text.split(","):
        if not part.strip().isdigit() or int(part) < 1:
            raise ValueError(f"expected positive integers separated by commas (e.g. 8,64,1024), got {text!r}")
        counts.append(int(part))
    return counts


def _shard_size(text: str) -> int | str:
    if text.strip() == "node":
        return "node"
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"expected a positive number of ranks or 'node', got {text!r}")
    return int(text)


def _add_estimate_parser(commands: Any) -> argparse.ArgumentParser:
    from lightning_zero.planning.arguments import PRECISIONS, parse_bytes, parse_count

    estimate = commands.add_parser(
        "estimate",
        help="predict model-state memory per device and communication per step of DDP and ZeRO stages 1-3",
        description="Print, per device, the bytes of parameters, gradients, master copy and optimizer states "
        "that DDP and each ZeRO stage keep, the bytes each rank sends per optimizer step and how long that "
        "takes, and (with --memory) the cheapest strategy that fits. Pure arithmetic: nothing is launched. Give the "
        "model as a parameter count (--params 7B), or as dry-run takes it (FILE.py:CLASS, built on the meta device: "
        "its parameters counted and its units laid out exactly, without memory).",
    )
    estimate.add_argument(
        "target",
        nargs="?",
        metavar="FILE.py:CLASS",
        help="a LightningModule class built with no arguments (or module:CLASS), instead of --params",
    )
    estimate.add_argument("--params", type=_argument(parse_count), help="parameter count: 7B, 350M")
    estimate.add_argument(
        "--unit-modules", help="with FILE.py:CLASS: comma-separated module class names that form units (default: found)"
    )
    estimate.add_argument(
        "--devices",
        type=_argument(_device_counts),
        default=[1],
        help="devices per node, or a comma list (8,64,1024) for one table per size (default: 1)",
    )
    estimate.add_argument("--nodes", type=_positive_int, default=1, help="number of nodes (default: 1)")
    estimate.add_argument("--precision", choices=PRECISIONS, default="32-true", help="(default: 32-true)")
    estimate.add_argument(
        "--offload", action="store_true", help="master, sharded gradients and optimizer states in CPU memory"
    )
    estimate.add_argument(
        "--offload-params",
        action="store_true",
        help="stage 3: parameter shards in CPU memory too, copied to the device at each gather (implies --offload)",
    )
    estimate.add_argument(
        "--shard-size",
        type=_argument(_shard_size),
        help="ranks per shard group (hybrid sharding): a number, or 'node' for the devices of one node (default: all)",
    )
    estimate.add_argument(
        "--bandwidth",
        type=float,
        help="bus bandwidth per rank in GB/s for every collective (default: by level, stated in the output)",
    )
    estimate.add_argument(
        "--intra-node-bandwidth", type=float, help="GB/s of collectives inside one node (default: 200, NVLink class)"
    )
    estimate.add_argument(
        "--inter-node-bandwidth", type=float, help="GB/s of collectives across nodes (default: 25, one 200 Gb/s link)"
    )
    estimate.add_argument("--pcie-bandwidth", type=float, help="GB/s of host-device copies (offload; default: 25)")
    estimate.add_argument("--memory", type=_argument(parse_bytes), help="memory per device, e.g. 80GB or 80GiB")
    estimate.add_argument(
        "--optimizer-state-bytes", type=float, help="optimizer state per parameter (default: 2 x master, Adam)"
    )
    estimate.add_argument(
        "--reduce-dtype-bytes", type=_positive_int, default=4, help="element size gradients are reduced in (default: 4)"
    )
    estimate.add_argument("--param-dtype-bytes", type=_positive_int, help="mixed precision compute copy (default: 2)")
    estimate.add_argument(
        "--largest-unit", type=_argument(parse_count), help="parameters of the largest unit (stage 3's gathers)"
    )
    estimate.add_argument("--prefetch", type=int, default=1, help="units stage 3 gathers ahead (default: 1)")
    estimate.add_argument(
        "--accumulate-grad-batches",
        type=int,
        default=1,
        help="micro-batches per optimizer step: adds stages 2 and 3 with accumulate='local' (default: 1)",
    )
    estimate.add_argument(
        "--quantize-weights", choices=("int8",), help="stage 3's gathers in int8 (quantize_weights='int8')"
    )
    estimate.add_argument(
        "--quantize-grads", choices=("int8",), help="the reduce-scatters of stages 2 and 3 in int8 (quantize_grads)"
    )
    estimate.add_argument("--json", action="store_true", help="print JSON (a list when several --devices are given)")
    return estimate


def _estimate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from lightning_zero.planning.estimate import estimate_memory

    if args.target is not None and args.params is not None:
        parser.error("give the model either as --params or as FILE.py:CLASS, not both")
    if args.target is None and args.params is None:
        parser.error("the model is required: --params (a parameter count, e.g. 7B) or FILE.py:CLASS")
    model: Any = args.params
    if args.target is not None:
        from lightning_zero.tools.targets import build_on_meta

        try:
            model = build_on_meta(args.target)
        except ValueError as error:  # not a file, no such class
            parser.error(f"argument FILE.py:CLASS: {error}")
    units = [name.strip() for name in args.unit_modules.split(",")] if args.unit_modules else None
    try:
        estimates = [
            estimate_memory(
                model,
                unit_modules=units,
                devices=devices,
                nodes=args.nodes,
                precision=args.precision,
                offload_optimizer=args.offload,
                optimizer_state_bytes=args.optimizer_state_bytes,
                reduce_dtype_bytes=args.reduce_dtype_bytes,
                param_dtype_bytes=args.param_dtype_bytes,
                bandwidth_gbps=args.bandwidth,
                intra_node_gbps=args.intra_node_bandwidth,
                inter_node_gbps=args.inter_node_bandwidth,
                pcie_gbps=args.pcie_bandwidth,
                shard_size=args.shard_size,
                offload_params=args.offload_params,
                memory_per_device=args.memory,
                prefetch=args.prefetch,
                largest_unit_params=args.largest_unit,
                accumulate_grad_batches=args.accumulate_grad_batches,
                quantize_weights=args.quantize_weights,
                quantize_grads=args.quantize_grads,
            )
            for devices in args.devices
        ]
    except ValueError as error:
        _refuse(parser, error, _ESTIMATE_FLAGS)
    if args.json:
        data = [e.as_dict() for e in estimates]
        print(json.dumps(data[0] if len(data) == 1 else data, indent=2))
    else:
        print("\n\n".join(e.table() for e in estimates))
    return 0


def _add_dry_run_parser(commands: Any) -> argparse.ArgumentParser:
    dry = commands.add_parser(
        "dry-run",
        help="run one rank of an N-rank ZeRO job in this process and report its memory and communication",
        description="Act as one rank of an N-rank job on torch's fake process group (nothing is sent): build the "
        "model sharded with the real engine (meta init, units, buckets), run a few real training steps on one "
        "batch, and report this rank's model-state bytes, peak gathered bytes and bytes sent per step, beside "
        "the theory and the estimator. Values are meaningless; memory and schedule are real.",
    )
    dry.add_argument("target", metavar="FILE.py:CLASS", help="a LightningModule class built with no arguments")
    dry.add_argument("--strategy", choices=("zero1", "zero2", "zero3"), default="zero3", help="default: zero3")
    dry.add_argument("--world-size", type=_positive_int, required=True, help="ranks of the job")
    dry.add_argument("--rank", type=int, default=0, help="the rank this process plays (default: 0)")
    dry.add_argument(
        "--shard-size",
        type=_argument(_shard_size),
        help="hybrid sharding: ranks per shard group, or 'node' (8 per node here)",
    )
    dry.add_argument("--precision", default="32-true", help="32-true (default), bf16-mixed or bf16-true")
    dry.add_argument("--offload-optimizer", action="store_true", help="optimizer states in CPU memory")
    dry.add_argument("--offload-params", action="store_true", help="stage 3: parameter shards in CPU memory too")
    dry.add_argument("--unit-modules", help="comma-separated module class names that form units (default: found)")
    dry.add_argument(
        "--activation-checkpointing",
        metavar="CLASSES",
        help="comma-separated module class names whose forward is recomputed in backward (e.g. Block)",
    )
    dry.add_argument("--quantize-weights", choices=("int8",), help="stage 3's gathers in int8")
    dry.add_argument("--quantize-grads", choices=("int8",), help="the reduce-scatters of stages 2 and 3 in int8")
    dry.add_argument("--steps", type=_positive_int, default=2, help="training steps; the last is measured")
    dry.add_argument(
        "--batch-shape",
        help="e.g. 1,128: (x, y) int64 token ids of that shape (default: the module's train_dataloader)",
    )
    dry.add_argument("--json", metavar="OUT", help="also write the report as JSON to OUT")
    return dry


def _dry_run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import torch

    from lightning_zero.tools.dry_run import dry_run
    from lightning_zero.tools.dry_run_report import write_json

    try:
        shape = tuple(int(n) for n in args.batch_shape.split(",")) if args.batch_shape else None
    except ValueError:
        parser.error(f"argument --batch-shape: expected comma-separated integers, e.g. 1,128; got {args.batch_shape!r}")
    units = [name.strip() for name in args.unit_modules.split(",")] if args.unit_modules else None
    recomputed = args.activation_checkpointing
    recomputed = [name.strip() for name in recomputed.split(",")] if recomputed else None
    try:
        report = dry_run(
            args.target,
            world_size=args.world_size,
            stage=int(args.strategy[-1]),
            rank=args.rank,
            shard_size=args.shard_size,
            precision=args.precision,
            offload_optimizer=args.offload_optimizer,
            offload_params=args.offload_params,
            unit_modules=units,
            steps=args.steps,
            batch_shape=shape,
            activation_checkpointing=recomputed,
            quantize_weights=args.quantize_weights,
            quantize_grads=args.quantize_grads,
        )
    except ArgumentValueError as error:
        _refuse(parser, error, _DRY_RUN_FLAGS)
    except (ValueError, TypeError) as error:
        print(f"dry-run: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    except (MemoryError, torch.OutOfMemoryError, RuntimeError) as error:
        if not isinstance(error, (MemoryError, torch.OutOfMemoryError)) and "can't allocate memory" not in str(error):
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        batch = f"--batch-shape {args.batch_shape}" if args.batch_shape else "the module's batch"
        print(
            f"dry-run: rank {args.rank} of {args.world_size} ran out of memory in this process ({first}): it does not "
            f"fit this machine with {batch} at --world-size {args.world_size} (activations grow with the batch, and "
            "every unit is padded to a multiple of the world size)",
            file=sys.stderr,
        )
        return 2
    print(report.table())
    if args.json:
        write_json(report, args.json)
    return 0


def _load_module(parser: argparse.ArgumentParser, target: str, seed: int) -> Any:
    """Import ``MODULE:ATTR`` and build the LightningModule it names (``parser.error`` if it cannot)."""
    import lightning as L

    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        parser.error(f"expected MODULE:ATTR (e.g. my_package.models:MyModule), got {target!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: the user's package is usually right here
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as error:
        parser.error(f"cannot import {module_name!r}: {error}")
    for part in attr.split("."):
        if not hasattr(obj, part):
            parser.error(f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        parser.error(f"{target} is neither a LightningModule class nor a function returning one")
    L.seed_everything(seed, verbose=False)
    model = obj()
    if not isinstance(model, L.LightningModule):
        parser.error(f"{target}() returned a {type(model).__name__}, not a LightningModule")
    return model


def _check_parity(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from lightning_zero.tools.parity import check_parity

    model = _load_module(parser, args.target, args.seed)
    options = {f"quantize_{w}": getattr(args, f"quantize_{w}") for w in ("weights", "grads")}
    try:
        report = check_parity(
            model,
            strategy_kwargs={k: v for k, v in options.items() if v is not None},
            stage=args.stage,
            steps=args.steps,
            world_size=args.world_size,
            seed=args.seed,
            rtol=args.rtol,
            timeout=args.timeout,
        )
    except (RuntimeError, TimeoutError, TypeError, ValueError) as error:
        print(f"check-parity: {error}", file=sys.stderr)
        return 2
    print(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
