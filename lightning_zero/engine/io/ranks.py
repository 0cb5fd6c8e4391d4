"""The ranks that take part in a save or a load (``Ranks``), and the one object gather their outcomes need: shared by
the checkpoint protocol and the Hugging Face exports.

Example::

    ranks = Ranks(dist.get_rank(), dist.get_world_size(), broadcast_object)
    outcomes = gather_from_every_rank(ranks, (written, error))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    """The ranks that take part in a save or a load: this one, how many, and a broadcast of a picklable object from
    rank 0 (every rank calls it; rank 0's value comes back).

    Example::

        ranks = Ranks(dist.get_rank(), dist.get_world_size(), lambda obj: broadcast_object(obj))
    """

    rank: int
    world_size: int
    broadcast: Callable[[Any], Any]
    group: Any = None  # the process group of the save's other collectives (None: the default group)

    @property
    def is_zero(self) -> bool:
        return self.rank == 0


def gather_from_every_rank(ranks: Ranks, value: Any) -> list[Any]:
    """Every rank's ``value``, on every rank."""
    if not dist.is_available() or not dist.is_initialized() or ranks.world_size == 1:
        return [value]
    values: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(values, value, group=ranks.group)
    return values
