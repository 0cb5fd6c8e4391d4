"""Arithmetic of a unit's flat, padded, sharded layout. No processes, no tensors of data.

[Note: flat layout]
The parameters of one unit are laid end to end, in a fixed order, in one 1-D buffer:

- ``numel``: the sum of the parameters' element counts.
- ``padded_numel``: ``numel`` rounded up to a multiple of the world size, so that every rank's
  shard has the same size (collectives need equal chunks). The padding is zeros and never reaches
  a parameter.
- ``shard_numel``: ``padded_numel // world_size``; rank ``r`` owns the half-open range
  ``[r * shard_numel, (r + 1) * shard_numel)`` of the flat buffer (its *shard*).
- A parameter may straddle shards. The piece of parameter ``i`` inside rank ``r``'s shard is a
  ``ParamShard``: where it starts inside the shard (``shard_offset``), where it starts inside the
  flattened parameter (``param_offset``) and how many elements it has (``numel``, possibly 0).

Everything else in the engine speaks this vocabulary and points here.

[Note: aligned chunks]
A collective over a buffer cut into one chunk per rank (a reduction's chunks: see ``schedule/reduce.py``) reads and
writes each chunk at ``rank * width`` elements from the start. NCCL's kernels and the copy engines move 16 bytes
per access when the address allows it; a chunk that starts off a 16-byte boundary takes a slower path. The
caching allocator hands out blocks aligned far beyond 16 bytes (512 on CUDA), so every chunk starts aligned
exactly when ``width * element_size`` is a multiple of 16: ``aligned_numel`` rounds a chunk's elements up to that
(4 fp32 elements, 8 bf16, 2 fp64; element sizes that do not divide 16 round up to whole 16-byte multiples). The
extra elements are padding at the end of each chunk, zeros that reach no parameter: the flat layout above, and
so checkpoints, are unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

ALIGN_BYTES = 16  # see [Note: aligned chunks]


def aligned_numel(numel: int, element_size: int, align_bytes: int = ALIGN_BYTES) -> int:
    """``numel`` rounded up so that ``numel`` elements of ``element_size`` bytes fill whole ``align_bytes`` (see
    [Note: aligned chunks]).

    Example::

        >>> aligned_numel(5, 4), aligned_numel(5, 2), aligned_numel(8, 4), aligned_numel(0, 4), aligned_numel(3, 3)
        (8, 8, 8, 0, 16)
    """
    if numel < 0 or element_size < 1 or align_bytes < 1:
        raise ValueError(f"aligned_numel({numel}, {element_size}, {align_bytes}): sizes must be positive")
    step = align_bytes // math.gcd(align_bytes, element_size)  # elements per aligned run
    return -(-numel // step) * step


class ShardRange(NamedTuple):
    """Half-open range ``[start, end)`` of the flat buffer owned by one rank."""

    start: int
    end: int


class ParamShard(NamedTuple):
    """The piece of one parameter that lies in one rank's shard (see [Note: flat layout])."""

    param_index: int
    shard_offset: int
    param_offset: int
    numel: int


@dataclass(frozen=True)
class ShardLayout:
    """Where each parameter of a unit lives in the flat buffer, and which part each rank owns.

    Example::

        >>> layout = ShardLayout.from_shapes([torch.Size([3, 2]), torch.Size([3])], world_size=2)
        >>> layout.numel, layout.padded_numel, layout.shard_numel
        (9, 10, 5)
        >>> layout.shard_range(1)
        ShardRange(start=5, end=10)
        >>> [s.numel for s in layout.param_shards(1)]
        [1, 3]
    """

    shapes: tuple[torch.Size, ...]
    world_size: int

    # The derived sizes below are read on every step: computed once (``cached_property`` stores them in the
    # instance's ``__dict__``, which a frozen dataclass allows).

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")

    @classmethod
    def from_shapes(cls, shapes: list[torch.Size] | tuple[torch.Size, ...], world_size: int) -> ShardLayout:
        return cls(tuple(torch.Size(s) for s in shapes), world_size)

    @cached_property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Start of each parameter in the flat buffer."""
        offsets, total = [], 0
        for n in self.numels:
            offsets.append(total)
            total += n
        return tuple(offsets)

    @cached_property
    def numel(self) -> int:
        return sum(self.numels)

    @cached_property
    def padded_numel(self) -> int:
        return math.ceil(self.numel / self.world_size) * self.world_size

    @cached_property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> ShardRange:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        return ShardRange(rank * self.shard_numel, (rank + 1) * self.shard_numel)

    def param_shards(self, rank: int) -> list[ParamShard]:
        """One ``ParamShard`` per parameter (``numel == 0`` where the parameter misses the shard)."""
        start, end = self.shard_range(rank)
        pieces = []
        for index, (offset, numel) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(offset, start), min(offset + numel, end)
            if hi <= lo:
                pieces.append(ParamShard(index, 0, 0, 0))
            else:
                pieces.append(ParamShard(index, lo - start, lo - offset, hi - lo))
        return pieces
