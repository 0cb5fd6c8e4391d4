"""Command line: ``python -m lightning_zero consolidate CHECKPOINT OUT``.

Example::

    python -m lightning_zero consolidate runs/epoch=3-step=400.ckpt model.ckpt
    python -m lightning_zero consolidate runs/epoch=3-step=400.ckpt model.safetensors
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

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
    args = parser.parse_args(argv)
    checkpoint = consolidate(args.checkpoint, args.output, weights_only=False if args.unsafe_pickle else None)
    params = sum(v.numel() for v in checkpoint["state_dict"].values() if hasattr(v, "numel"))
    print(f"wrote {args.output}: {len(checkpoint['state_dict'])} tensors, {params:,} elements", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
