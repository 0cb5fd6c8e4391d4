"""The process topology both front doors (the Trainer's and Fabric's strategies) describe the same way.

Lightning's Trainer and Fabric each have their own ``ParallelStrategy`` base, launchers and
hooks, but what a ZeRO strategy says about its processes is the same for both, as for Lightning's
own ``DDPStrategy`` pair: one device per local rank, ``num_nodes * num_processes`` ranks, each
rank reading its own part of the data.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from lightning_zero.engine.comm.mesh import ShardSize, resolve_shard_size


class ProcessTopology:
    """Mixed in before a Lightning ``ParallelStrategy`` (which provides ``parallel_devices``, ``local_rank`` and
    ``global_rank``); the strategy sets ``_num_nodes`` in its constructor and holds a ``driver``.

    Example::

        class MyStrategy(ProcessTopology, ParallelStrategy): ...
    """

    parallel_devices: list[torch.device] | None
    cluster_environment: Any
    node_rank: int
    start_method: str
    _launcher: Any
    local_rank: int
    global_rank: int
    _num_nodes: int
    shard_size: ShardSize
    driver: Any

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
        return self.driver.process_group_backend

    def set_world_ranks(self) -> None:
        """Tell the cluster environment and Lightning's ``rank_zero_only`` this process's global rank."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def configure_zero_launcher(self, multiprocessing: type, subprocess_script: type) -> None:
        """The door's launcher (Lightning's Trainer and Fabric each have their own classes): ``popen`` re-runs the
        script, as for ``DDPStrategy``; the other start methods start processes with ``multiprocessing``."""
        assert self.cluster_environment is not None
        if self.start_method == "popen":
            self._launcher = subprocess_script(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = multiprocessing(self, start_method=self.start_method)

    def connect_ranks(self) -> None:
        """The end of ``setup_environment`` in both doors, after Lightning's own: the seed, the ranks, the shard
        size checked (one that does not divide the world fails here, on every rank) and the process group."""
        reset_seed()
        self.set_world_ranks()
        self.resolved_shard_size()
        assert self.cluster_environment is not None
        self.driver.connect(self.cluster_environment, self.root_device)

    def resolved_shard_size(self) -> int:
        """Ranks per shard group (see [Note: hybrid sharding] in ``engine/comm/mesh.py``): ``shard_size``, with
        ``None`` as the world size and ``"node"`` as the processes of one node. Raises ``ValueError`` on every
        rank alike when it does not divide the world size (no collective needed: every rank knows both)."""
        return resolve_shard_size(self.shard_size, self.num_nodes * self.num_processes, self.num_processes)
