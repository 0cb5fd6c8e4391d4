"""The default units (see [Note: default units] in ``lightning_zero/engine/core/grouping.py``): which modules
they pick, on small hand-made models and on the real-model matrix, and the first-step check of folded
modules (see [Note: folded modules] in ``stage3.py``). One process, no collectives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.engine import Comm, default_unit_policy, owns_parameters, plan_units, shard_model
from lightning_zero.engine.schedule.stage3 import FoldedModuleError


class Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class Net(nn.Module):
    """Embedding, a ModuleList of blocks, a final norm, a tied head; ``big`` adds an untied large head."""

    def __init__(self, blocks: int = 3, big: int = 0) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        self.extra = nn.Linear(8, big) if big else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def blocks_policy(module: nn.Module, **kwargs):
    """The default policy without its small-model rule (these test models are all tiny)."""
    return default_unit_policy(module, whole_model_below=0, **kwargs)


def names(module: nn.Module, **kwargs) -> list[str]:
    return [p.name for p in plan_units(module, blocks_policy(module, **kwargs))]


def test_a_small_model_is_one_unit_and_a_larger_one_gets_its_blocks() -> None:
    model = Net()
    assert [p.name for p in plan_units(model)] == ["<root>"]  # plan_units' default: under 2^20 elements
    big = Net(blocks=2, big=2**19)  # extra: 9 x 2^19 elements, over the threshold (and a large leaf)
    assert [p.name for p in plan_units(big)] == ["<root>", "blocks.0", "blocks.1", "extra"]


def test_repeated_blocks_are_units_and_small_modules_fold_into_the_root() -> None:
    model = Net()
    assert names(model) == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    root = plan_units(model, blocks_policy(model))[0]
    assert root.param_names == ["emb.weight", "norm.weight", "norm.bias"]  # the tied head is emb.weight
    assert plan_units(model, blocks_policy(model))[1].param_names == [
        "blocks.0.norm.weight",
        "blocks.0.norm.bias",
        "blocks.0.fc.weight",
        "blocks.0.fc.bias",
    ]
    # The finest grain is still available.
    assert len(plan_units(model, owns_parameters)) == 1 + 3 * 2 + 1


def test_large_leaves_outside_blocks_are_units_and_a_single_block_is_not_repeated() -> None:
    model = Net(blocks=1, big=64)
    assert names(model, min_unit_numel=8 * 64) == ["<root>", "extra"]  # extra: 8*64 + 64 elements
    assert names(model) == ["<root>"]  # everything is small: one unit, held for the step


def test_containers_are_never_units_and_sequential_stacks_are() -> None:
    stack = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert names(stack) == ["0", "2", "4"]  # the root owns nothing itself
    nested = nn.Module()
    nested.groups = nn.ModuleList([nn.ModuleList([Block(), Block()]), nn.ModuleList([Block()])])
    assert names(nested) == ["<root>", "groups.0.0", "groups.0.1"]  # groups.1.0 is alone: folded


def test_multihead_attention_stays_one_unit_and_compiled_blocks_count_as_their_class() -> None:
    attn = nn.Module()
    attn.layers = nn.ModuleList(nn.MultiheadAttention(8, 2) for _ in range(2))
    plans = plan_units(attn, blocks_policy(attn))
    assert [p.name for p in plans] == ["layers.0", "layers.1"]
    assert "layers.0.out_proj.weight" in plans[0].param_names
    model = Net(blocks=2)
    model.blocks[0] = torch.compile(model.blocks[0], backend="eager")
    assert names(model) == ["<root>", "blocks.0", "blocks.1"]  # blocks.0 is the OptimizedModule around a Block


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "opt", "litgpt", "resnet", "vit"])
def test_real_models_get_their_blocks_as_units(name: str) -> None:
    from tests.real_models import build

    torch.manual_seed(0)
    model = build(name)
    assert [p.name for p in plan_units(model)] == ["<root>"]  # tiny: one unit by default
    plans = plan_units(model, blocks_policy(model))
    blocks = [p.name for p in plans[1:]]
    assert plans[0].name == "<root>"
    assert len(blocks) == 2, blocks  # two layers (two ResNet stages) in the tiny configurations
    assert blocks[0].endswith(".0") and blocks[1].endswith(".1"), blocks


def test_a_folded_module_run_outside_its_unit_is_named_on_the_first_step() -> None:
    class Bad(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = super().forward(x)
            return h + self.blocks[0].fc(h[..., :8]).sum()  # blocks.0.fc outside blocks.0's forward

    torch.manual_seed(0)
    bad = Bad(blocks=2)
    sharded = shard_model(bad, stage=3, comm=Comm(), units=blocks_policy(bad))
    x = torch.randint(0, 16, (2, 4))
    with pytest.raises(FoldedModuleError, match=r"'blocks.0.fc' \(Linear\) ran outside the forward of 'blocks.0'"):
        with sharded.step_context():
            bad(x).sum().backward()
    good = Net(blocks=2)
    sharded = shard_model(good, stage=3, comm=Comm(), units=blocks_policy(good))
    for _ in range(2):
        with sharded.step_context():
            good(x).sum().backward()
    assert not sharded.stage3._fold_checks  # removed after the first training step: later steps pay nothing


def test_the_benchmark_gpt_gets_exactly_the_hand_chosen_block_units() -> None:
    from benchmarks.model import CONFIGS, BenchGPT
    from lightning_zero.engine import module_class_policy

    model = BenchGPT(CONFIGS["default"])  # 25M parameters: over the small-model threshold
    by_hand = plan_units(model, module_class_policy(["Block"]))
    assert [(p.name, p.param_names) for p in plan_units(model)] == [(p.name, p.param_names) for p in by_hand]


def test_stage_1_and_2_buckets_are_capped_at_bucket_size_like_ddp() -> None:
    """Stages 1 and 2 merge units into buckets of at most ``bucket_numel`` elements, in registration order (DDP's
    ``bucket_cap_mb``); a unit larger than the cap is a bucket of its own, and dtypes never share one."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 16),  # 272 elements
        nn.Linear(16, 16),  # 272
        nn.Linear(16, 64),  # 1088: over the cap alone
        nn.Linear(64, 4),  # 260
        nn.Linear(4, 4),  # 20
        nn.Linear(4, 4).double(),  # 20, another dtype
    )
    before = [p.detach().clone() for p in model.parameters()]
    sharded = shard_model(
        model, stage=2, comm=Comm(), units=owns_parameters, bucket_size_mb=600 * 4 / 2**20
    )  # 600 fp32 elements
    sizes = [sum(p.numel() for p in unit.params) for unit in sharded.units]
    assert sizes == [544, 1088, 280, 20], sizes
    assert [u.name for u in sharded.units] == ["0..1", "2", "3..4", "5"]
    # Every parameter is in exactly one bucket, in registration order, with its values.
    assert [p for u in sharded.units for p in u.params] == list(model.parameters())
    for param, value in zip(model.parameters(), before):
        assert torch.equal(param.detach(), value)
