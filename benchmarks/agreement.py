"""What one agreement costs as the world grows: the ring all-gather against the gather and broadcast.

Every step starts with an agreement on the control channel (see [Note: agreements] and [Note: agreements at
scale] in ``lightning_zero/engine/comm/control.py``). From ``TREE_FROM`` ranks on it is a gather to rank 0 and a
broadcast of every rank's row back; below, gloo's all-gather, a ring of N - 1 steps. For each world size this
benchmark times, in the same processes, a ``ControlChannel.agree`` both ways (``ring``: the all-gather forced at
every size; ``default``: what the channel does with no arguments), and, as the anchor, the one-integer
``broadcast`` that Lightning's training loop issues before every batch under DDP. Each sample starts from a
barrier, so it measures the exchange itself, not how far apart the ranks arrive; the slowest rank's median counts.

The processes are oversubscribed on a small machine (32 processes on 2 cores): what grows with N is the number of
steps that wait for each other, each a thread wake-up here and a network latency on a cluster. The absolute
figures are this machine's; the shape (linear against logarithmic) is the algorithms'.

Usage::

    python -m benchmarks.agreement                        # world sizes 2, 4, 8, 16, 32
    python -m benchmarks.agreement --world-sizes 2,3,8 --samples 40 --out /tmp/agreement.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def _run(rank: int, world_size: int, samples: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from benchmarks.results import quiet_rank
    from lightning_zero.engine.comm import control as control_module
    from lightning_zero.engine.comm.control import ControlChannel

    quiet_rank()
    channel = ControlChannel.create()
    assert channel is not None
    default_tree_from = control_module.TREE_FROM
    flag = torch.zeros(1, dtype=torch.int64)
    row = [1, 2, 3, 4]

    def agree() -> None:
        channel.agree(row, lambda: "the benchmark's agreement")

    def lightning_broadcast() -> None:
        dist.broadcast(flag, src=0)

    medians: dict[str, float] = {}
    for name, action, tree_from in (
        ("ring", agree, world_size + 1),
        ("default", agree, default_tree_from),
        ("lightning_broadcast", lightning_broadcast, default_tree_from),
    ) * 2:  # twice, interleaved: the second round is kept (the first warms the connections)
        control_module.TREE_FROM = tree_from
        times = []
        for _ in range(samples):
            dist.barrier(group=channel.group)
            start = time.perf_counter()
            action()
            times.append(time.perf_counter() - start)
        slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        medians[name] = slowest.item()
    control_module.TREE_FROM = default_tree_from
    channel.close()
    return medians


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.results import write_results
    from lightning_zero.engine.comm.control import TREE_FROM
    from lightning_zero.tools.processes import run_on_cpu_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="2,4,8,16,32")
    parser.add_argument("--samples", type=int, default=60)
    parser.add_argument("--out", default=None, help="JSON file (default results/<timestamp>-agreement.json)")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.world_sizes.split(",")]
    if any(n < 2 for n in sizes):
        parser.error(f"--world-sizes {args.world_sizes!r}: every world size must be at least 2")
    results: dict[str, Any] = {}
    lines = [
        "| ranks | ring all-gather (ms) | default (ms) | default / ring | Lightning's broadcast (ms) |",
        "|---|---|---|---|---|",
    ]
    for n in sizes:
        medians = run_on_cpu_ranks(_run, n, timeout=1800, samples=args.samples)[0]
        results[str(n)] = medians
        what = "gather + broadcast" if n >= TREE_FROM else "all-gather"
        lines.append(
            f"| {n} | {1e3 * medians['ring']:.2f} | {1e3 * medians['default']:.2f} ({what}) | "
            f"{medians['default'] / medians['ring']:.2f} | {1e3 * medians['lightning_broadcast']:.2f} |"
        )
        print(lines[-1], flush=True)
    print("\n".join(lines))
    options = {"world_sizes": sizes, "samples": args.samples, "tree_from": TREE_FROM}
    write_results("agreement", options, results, args.out)
    return results


if __name__ == "__main__":
    main()
