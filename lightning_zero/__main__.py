"""Command line: ``python -m lightning_zero consolidate CHECKPOINT OUT`` and ``... check-parity MODULE:ATTR``.

Example::

    python -m lightning_zero consolidate runs/epoch=3-step=400.ckpt model.ckpt
    python -m lightning_zero consolidate runs/epoch=3-step=400.ckpt model.safetensors
    python -m lightning_zero check-parity my_package.models:MyModule --stage 3 --steps 5

``check-parity`` exits with 0 when the stage trained exactly like ``DDPStrategy`` (within ``--rtol``),
1 when it did not, and 2 when the module could not be loaded or a run failed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from lightning_zero.strategies.checkpointing import consolidate


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
    args = parser.parse_args(argv)
    if args.command == "check-parity":
        return _check_parity(parser, args)
    checkpoint = consolidate(args.checkpoint, args.output, weights_only=False if args.unsafe_pickle else None)
    params = sum(v.numel() for v in checkpoint["state_dict"].values() if hasattr(v, "numel"))
    print(f"wrote {args.output}: {len(checkpoint['state_dict'])} tensors, {params:,} elements", file=sys.stderr)
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


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
    from lightning_zero.parity import check_parity

    model = _load_module(parser, args.target, args.seed)
    try:
        report = check_parity(
            model,
            stage=args.stage,
            steps=args.steps,
            world_size=args.world_size,
            seed=args.seed,
            rtol=args.rtol,
            timeout=args.timeout,
        )
    except (RuntimeError, TimeoutError, TypeError) as error:
        print(f"check-parity: {error}", file=sys.stderr)
        return 2
    print(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
