"""Pure arithmetic of the flat layout: no processes."""

import doctest

import pytest
import torch

import lightning_zero.engine.core.layout as layout_module
import lightning_zero.engine.core.memory as memory_module
import lightning_zero.engine.schedule.reduce as reduce_module
from lightning_zero.engine.core.grouping import module_class_policy, owns_parameters, plan_units
from lightning_zero.engine.core.layout import ShardLayout
from lightning_zero.engine.core.memory import theory_bytes, theory_comm_bytes
from lightning_zero.engine.schedule.reduce import _reduce_plan, reduce_width

SHAPES = [torch.Size([3, 5]), torch.Size([7]), torch.Size([]), torch.Size([2, 2, 2]), torch.Size([0]), torch.Size([1])]


@pytest.mark.parametrize("world_size", range(1, 9))
def test_shards_partition_every_parameter_exactly_once(world_size: int) -> None:
    layout = ShardLayout.from_shapes(SHAPES, world_size)
    assert layout.numel == 15 + 7 + 1 + 8 + 0 + 1
    assert layout.padded_numel % world_size == 0
    assert 0 <= layout.padded_numel - layout.numel < world_size
    covered = {i: [] for i in range(len(SHAPES))}
    for rank in range(world_size):
        start, end = layout.shard_range(rank)
        assert end - start == layout.shard_numel
        for piece in layout.param_shards(rank):
            if piece.numel:
                flat_start = layout.offsets[piece.param_index] + piece.param_offset
                assert flat_start == start + piece.shard_offset  # same element, two coordinates
                covered[piece.param_index].append((piece.param_offset, piece.numel))
    for index, pieces in covered.items():
        position = 0
        for offset, numel in sorted(pieces):
            assert offset == position
            position += numel
        assert position == layout.numels[index]


def test_layout_rejects_bad_world_size_and_rank() -> None:
    with pytest.raises(ValueError, match="world_size"):
        ShardLayout.from_shapes(SHAPES, 0)
    with pytest.raises(ValueError, match="rank 2"):
        ShardLayout.from_shapes(SHAPES, 2).shard_range(2)


def test_doctests() -> None:
    for module in (layout_module, memory_module, reduce_module):
        assert doctest.testmod(module).failed == 0


@pytest.mark.parametrize("world_size", range(1, 9))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8])
def test_every_reduction_chunk_starts_16_byte_aligned(world_size: int, dtype: torch.dtype) -> None:
    """A reduction's buffer is one chunk per rank, ``reduce_width`` elements each (the rank's range of the layout,
    its slot, zeros): every chunk starts on a 16-byte boundary, the padding is less than 16 bytes, and every
    element of the layout still lands in exactly one place of its rank's range, never in the slot or the padding
    (see [Note: aligned chunks] in ``core/layout.py``). At 8 ranks, chunks of ``shard_numel + 1`` elements were
    aligned only for one layout size in four (fp32)."""
    for shapes in (SHAPES, [torch.Size([1])], [torch.Size([4095]), torch.Size([3])], [torch.Size([7, 9])]):
        layout = ShardLayout.from_shapes(shapes, world_size)
        width = reduce_width(layout, dtype)
        itemsize = dtype.itemsize
        assert all(rank * width * itemsize % 16 == 0 for rank in range(world_size)), (shapes, width)
        assert layout.shard_numel + 1 <= width and (width - layout.shard_numel - 1) * itemsize < 16
        seen = torch.zeros(world_size, width, dtype=torch.int64)
        for places in _reduce_plan(layout):
            for _start, row, column, count, rows in places:
                if rows:
                    seen[row : row + rows, :count] += 1
                else:
                    seen[row, column : column + count] += 1
        assert int(seen[:, : layout.shard_numel].min()) == int(seen.max()) == 1  # the ranges, each element once
        assert int(seen[:, layout.shard_numel :].sum()) == 0  # nothing in the slots or the padding


def test_theory_reproduces_the_classic_figures() -> None:
    gb = [theory_bytes(s, 7_000_000_000, 8).total / 1e9 for s in (None, 1, 2, 3)]
    assert gb == pytest.approx([112, 63, 38.5, 14])
    assert theory_comm_bytes(1, 100, 2) == 400
    assert theory_comm_bytes(3, 100, 4) == 900


def test_tied_weights_go_to_the_common_ancestor_unit() -> None:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(5, 2)
    model.blocks = torch.nn.Sequential(Block(), Block())
    model.head = torch.nn.Linear(2, 5, bias=False)
    model.head.weight = model.emb.weight
    plans = plan_units(model, owns_parameters)
    assert [p.name for p in plans] == ["<root>", "blocks.0.fc", "blocks.1.fc"]  # "head" owns nothing of its own
    assert plans[0].param_names == ["emb.weight"]
    by_class = plan_units(model, module_class_policy(["Block"]))
    assert [p.name for p in by_class] == ["<root>", "blocks.0", "blocks.1"]
    assert by_class[1].param_names == ["blocks.0.fc.weight", "blocks.0.fc.bias"]
