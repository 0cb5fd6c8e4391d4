"""The process topology both front doors (the Trainer's and Fabric's strategies) describe the same way.

Lightning's Trainer and Fabric each have their own ``ParallelStrategy`` base, launchers and
hooks, but what a ZeRO strategy says about its processes is the same for both, as for Lightning's
own ``DDPStrategy`` pair: one device per local rank, ``num_nodes * num_processes`` ranks, each
rank reading its own part of the data.
"""

from __future__ import annotations

from typing import Any

import torch


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
