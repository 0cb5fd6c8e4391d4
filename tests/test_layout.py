"""Pure arithmetic of the flat layout: no processes."""

import doctest

import pytest
import torch

import lightning_zero.engine.core.layout as layout_module
import lightning_zero.engine.core.memory as memory_module
from lightning_zero.engine.core.grouping import module_class_policy, owns_parameters, plan_units
from lightning_zero.engine.core.layout import ShardLayout
from lightning_zero.engine.core.memory import theory_bytes, theory_comm_bytes

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
    for module in (layout_module, memory_module):
        assert doctest.testmod(module).failed == 0


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
