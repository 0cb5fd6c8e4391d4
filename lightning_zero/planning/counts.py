"""Element counts per rank that the estimator's formulas need (``Counts``): from a model, its units planned and laid
out by the engine's own ``plan_units`` and ``ShardLayout`` (padding and frozen parameters included); from a bare
parameter count, the unpadded theory.

Example::

    counts = count_model(plan_model(model, None), world_size=8)
    counts.shard, counts.gathered_numel(prefetch=1)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from torch import nn

from lightning_zero.engine.comm.quantized import BLOCK, mixed_blocks, row_bytes
from lightning_zero.engine.core.grouping import ROOT_NAME, module_class_policy, plan_units
from lightning_zero.engine.core.layout import ShardLayout

WIRE_BYTES_PER_ELEMENT = 1 + 4 / BLOCK  # an int8 value and its share of the block's fp32 scale


class Counts(NamedTuple):
    """Element counts per rank that the formulas need; for a bare count, the unpadded theory."""

    numel: float  # every parameter (Ψ)
    trainable: float  # parameters with requires_grad
    padded: float  # sum of padded_numel over units (stages 1 and 2 keep these full buffers)
    trainable_padded: float  # the same over units with a trainable parameter (what is reduced)
    shard: float  # sum of shard_numel over units (master, stage-3 compute shard)
    grad_shard: float  # the same over units with a trainable parameter (sharded gradients)
    state_shard: float  # trainable elements in the fullest rank's shards (optimizer states)
    units: int | None  # how many units (None: unknown, a bare count)
    largest_unit: int | None  # padded numel of the largest unit other than the root (None: unknown)
    root_unit: int = 0  # padded numel of the root unit (0: none, or a bare count)
    # Padded and shard numel of the units stage 3 gathers once per micro-batch rather than twice (see
    # ``stage3_gathered_bytes``): the root unit and the unit that ends the forward. 0: a bare count.
    once_padded: int = 0
    once_shard: int = 0
    # Per unit: its shard_numel, how many full blocks of its quantized rows go exactly, whether it has a trainable
    # parameter (see [Note: blocks that span parameters] in engine/comm/quantized.py), whether stage 3 gathers it
    # once per micro-batch. None: a bare count.
    quantized_rows: tuple[tuple[int, int, bool, bool], ...] | None = None

    def quantized_bytes(self, element: int, world_size: int, trainable_only: bool) -> float:
        """Bytes of one quantized collective of every unit (or of those with a trainable parameter), all its rows:
        1 + 4/256 per element, and ``element`` bytes per element of the blocks sent exactly."""
        if self.quantized_rows is None:
            return (self.trainable_padded if trainable_only else self.padded) * WIRE_BYTES_PER_ELEMENT
        return float(
            sum(
                world_size * row_bytes(numel, element, exact)
                for numel, exact, trainable, _ in self.quantized_rows
                if trainable or not trainable_only
            )
        )

    def stage3_gathered_bytes(self, element: int, world_size: int, quantized: bool) -> float:
        """Bytes of the all-gathers of one stage-3 micro-batch, all ranks' rows (the ring's (N-1)/N not applied).

        [Note: gathers per micro-batch]
        Every unit is gathered in its forward and again when backward reaches it, with two exceptions that the
        engine makes (see [Note: prefetch] in ``engine/schedule/stage3.py``): the root unit is held gathered for the
        whole step, and the unit that ends the recorded forward stays gathered for the backward that starts with
        it. Each is gathered once. Which unit ends the forward is known only by running the model; the estimate
        takes the last unit in registration order other than the root, the last block of a transformer. So a
        model below the one-unit threshold (the root unit alone, see [Note: default units] in
        ``engine/core/grouping.py``) is gathered once per micro-batch, as stages 1 and 2 are, and a bare count
        keeps the theory's two gathers of everything (3Ψ in all with the reduction)."""
        if not quantized:
            return (2 * self.padded - self.once_padded) * element
        if self.quantized_rows is None:
            return 2 * self.padded * WIRE_BYTES_PER_ELEMENT
        return float(
            sum(
                (1 if once else 2) * world_size * row_bytes(numel, element, exact)
                for numel, exact, _, once in self.quantized_rows
            )
        )

    def gathered_numel(self, prefetch: int) -> float | None:
        """Elements stage 3 holds gathered at once: the root unit, held for the whole step, and ``prefetch + 1``
        other units (at most all of them) of the largest size: the one computing and those gathered ahead."""
        if self.largest_unit is None:
            return None
        others = (self.units - (1 if self.root_unit else 0)) if self.units is not None else prefetch + 1
        return float(self.root_unit + min(prefetch + 1, others) * self.largest_unit)


def count_numel(numel: int, world_size: int, largest_unit_params: int | None) -> Counts:
    shard = numel / world_size
    return Counts(numel, numel, numel, numel, shard, shard, shard, None, largest_unit_params)


Planned = tuple[list[int], list[bool], bool]  # a unit's parameter numels, which are trainable, whether it is the root


def plan_model(model: nn.Module, unit_modules: Sequence[type[nn.Module] | str] | None) -> list[Planned]:
    """Each unit's parameter numels and which are trainable, as the engine would group them."""
    policy = None if unit_modules is None else module_class_policy(list(unit_modules))
    return [
        ([p.numel() for p in u.params], [p.requires_grad for p in u.params], u.name == ROOT_NAME)
        for u in plan_units(model, policy)
    ]


def count_model(units: list[Planned], world_size: int) -> Counts:
    per_rank = [0] * world_size  # trainable elements in each rank's shards
    numel = trainable = padded = trainable_padded = shard = grad_shard = largest = root = 0
    once_padded = once_shard = 0
    quantized_rows = []
    # The units gathered once per micro-batch under stage 3: the root, and the last other unit (see [Note: gathers
    # per micro-batch]).
    ends_forward = max((i for i, (_, _, is_root) in enumerate(units) if not is_root), default=None)
    for index, (numels, trainable_mask, is_root) in enumerate(units):
        layout = ShardLayout.from_shapes([(n,) for n in numels], world_size)
        starts = (offset for offset, n in zip(layout.offsets, numels) if n)  # as ShardedUnit plans its blocks
        exact = max(map(len, mixed_blocks(layout.shard_numel, world_size, starts)), default=0)
        once = is_root or index == ends_forward
        quantized_rows.append((layout.shard_numel, exact, any(trainable_mask), once))
        if once:
            once_padded += layout.padded_numel
            once_shard += layout.shard_numel
        numel += layout.numel
        padded += layout.padded_numel
        shard += layout.shard_numel
        if is_root:
            root = layout.padded_numel
        else:
            largest = max(largest, layout.padded_numel)
        if any(trainable_mask):
            trainable_padded += layout.padded_numel
            grad_shard += layout.shard_numel
        size = layout.shard_numel
        for offset, n, is_trainable in zip(layout.offsets, numels, trainable_mask):
            if not is_trainable or n == 0:
                continue
            trainable += n
            first, last = offset // size, (offset + n - 1) // size
            for rank in range(first, last + 1):  # a parameter's pieces, rank by rank
                per_rank[rank] += min(offset + n, (rank + 1) * size) - max(offset, rank * size)
    counts = (numel, trainable, padded, trainable_padded, shard, grad_shard, max(per_rank), len(units), largest, root)
    return Counts(*counts, once_padded, once_shard, tuple(quantized_rows))
