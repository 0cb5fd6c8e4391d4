"""One node's job in the two-node test (``tests/test_multinode.py``); also its single-node reference.

Started by torchrun, once per node, as ``tests/test_multinode.py`` does::

    python -m torch.distributed.run --nnodes 2 --nproc_per_node 1 --node_rank 0 \\
        --master_addr 127.0.0.1 --master_port 29500 tests/multinode_job.py OUT_DIR zero3 zero1

Each strategy trains ``ParityNet`` for a few steps with ``Trainer(devices=1, num_nodes=2)`` (or
``devices=N`` after ``--devices N``, for ``--nproc_per_node N``; ``zero2-node``/``zero3-node`` shard
inside each node: ``shard_size="node"``); every
rank saves its per-step losses, the final parameters and what the Trainer and the engine saw
(ranks, world size, cluster environment, shard layout) to ``OUT_DIR/rank{global_rank}.pt``. The
repository root must be importable (the test sets ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

import lightning_zero  # noqa: F401  registers "zero1", "zero2" and "zero3"
from lightning_zero import ZeRO2Strategy, ZeRO3Strategy, ZeROStrategy
from tests.models import ParityNet, quiet_trainer

MAX_STEPS = 6
HYBRID = {"zero2-node": ZeRO2Strategy, "zero3-node": ZeRO3Strategy}  # shard_size="node"


class Observer(Callback):
    """What the Trainer and the engine see while training: read in the loop, where a user would."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, ZeROStrategy):  # the reference (DDP)
            return
        sharded = strategy.sharded_model
        stats = sharded.memory_stats()
        self.seen = {
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "node_rank": trainer.node_rank,
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "num_devices": trainer.num_devices,
            "cluster_environment": type(strategy.cluster_environment).__name__,
            "creates_processes_externally": strategy.cluster_environment.creates_processes_externally,
            "process_group_world_size": torch.distributed.get_world_size(),
            "process_group_rank": torch.distributed.get_rank(),
            "comm_world_size": sharded.comm.world_size,
            "comm_rank": sharded.comm.rank,
            "comm_bytes_sent": sharded.comm.stats.bytes_sent,
            "shard_group_ranks": torch.distributed.get_process_group_ranks(sharded.shard_comm.group)
            if sharded.shard_comm.group is not None
            else list(range(torch.distributed.get_world_size())),
            # (world size of the layout, numel, padded numel, shard numel) for every unit
            "layouts": [
                (u.layout.world_size, u.layout.numel, u.layout.padded_numel, u.layout.shard_numel)
                for u in sharded.units
            ],
            "param_bytes": stats["params"],
            "optimizer_state_bytes": stats["optimizer_states"],
        }


def train(strategy: str, devices: int, num_nodes: int) -> dict[str, Any]:
    """Fit ParityNet under ``strategy``; this rank's losses, final state and observations."""
    L.seed_everything(0, verbose=False)
    model = ParityNet(optimizer="adamw")
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    observer = Observer()
    chosen = HYBRID[strategy](shard_size="node") if strategy in HYBRID else strategy
    trainer = quiet_trainer(
        strategy=chosen, devices=devices, num_nodes=num_nodes, max_steps=MAX_STEPS, callbacks=[observer]
    )
    trainer.fit(model)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {
        "losses": list(model.losses),
        "state": state,
        "trained": any(not torch.equal(v, state[k]) for k, v in initial.items()),
        "global_step": trainer.global_step,
        "seen": observer.seen,
    }


def main(argv: list[str]) -> None:
    out_dir, strategies = Path(argv[0]), argv[1:]
    devices = 1
    if strategies[:1] == ["--devices"]:
        devices, strategies = int(strategies[1]), strategies[2:]
    (out_dir / f"worker-{os.getpid()}.pid").write_text(str(os.getpid()))  # so that a hung test can stop it
    torch.set_num_threads(1)
    results = {name: train(name, devices=devices, num_nodes=2) for name in strategies}
    rank = torch.distributed.get_rank()
    # What the launcher told this process (torchrun's or srun's variables, whichever are set).
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID")
    results["env"] = {k: os.environ[k] for k in keys if k in os.environ}
    torch.save(results, out_dir / f"rank{rank}.tmp")
    os.replace(out_dir / f"rank{rank}.tmp", out_dir / f"rank{rank}.pt")  # a partial file never counts
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
