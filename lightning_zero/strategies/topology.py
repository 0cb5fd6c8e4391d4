"""The process topology both front doors (the Trainer's and Fabric's strategies) describe the same way.

Lightning's Trainer and Fabric each have their own ``ParallelStrategy`` base, launchers and
hooks, but what a ZeRO strategy says about its processes is the same for both, as for Lightning's
own ``DDPStrategy`` pair: one device per local rank, ``num_nodes * num_processes`` ranks, each
rank reading its own part of the data.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_zero.engine.comm.mesh import ShardSize, resolve_shard_size


class ProcessTopology:
    """Mixed in before a Lightning ``ParallelStrategy`` (which provides ``parallel_devices``, ``local_rank`` and
    ``global_rank``); the strategy sets ``_num_nodes`` and ``_process_group_backend`` in its constructor.

    Example::

        class MyStrategy(ProcessTopology, ParallelStrategy): ...
    """

    parallel_devices: list[torch.device] | None
    local_rank: int
    global_rank: int
    _num_nodes: int
    _process_group_backend: str | None
    shard_size: ShardSize

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def resolved_shard_size(self) -> int:
        """Ranks per shard group (see [Note: hybrid sharding] in ``engine/comm/mesh.py``): ``shard_size``, with
        ``None`` as the world size and ``"node"`` as the processes of one node. Raises ``ValueError`` on every
        rank alike when it does not divide the world size (no collective needed: every rank knows both)."""
        return resolve_shard_size(self.shard_size, self.num_nodes * self.num_processes, self.num_processes)
