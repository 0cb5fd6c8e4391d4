"""``activation_checkpointing_policy``: the selected modules recompute their forward in backward,
through both doors, under every stage, bitwise as DDP with the same modules checkpointed by hand (and as no
checkpointing at all where nothing is random), each block run twice per micro-batch and, under stage 3, no gather
added; names, state dicts and checkpoints as without it. Hugging Face decoder layers with their models' cache
default (``use_cache=True``) train as DDP with transformers' own checkpointing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDP
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from lightning_zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy
from lightning_zero.engine.comm.comm import Comm
from lightning_zero.engine.schedule.recompute import apply_activation_checkpointing, selected_modules
from lightning_zero.fabric import ZeRO3Strategy as ZeRO3FabricStrategy
from tests.block_net import BLOCKS, WIDTH, Block, BlockNet, assert_same, fabric_run, fit
from tests.distributed import spawn
from tests.real_models import RealModelNet

STEPS, ACCUMULATE = 3, 2
STAGES = {"zero1": ZeRO1Strategy, "zero2": ZeRO2Strategy, "zero3": ZeRO3Strategy}


class LateBlockNet(BlockNet):
    """``BlockNet`` with its layers made in ``configure_model`` (dropout 0.1)."""

    def __init__(self, by_hand: bool = False) -> None:
        L.LightningModule.__init__(self)
        self.by_hand, self.most_gathered = by_hand, 0
        self.blocks: nn.ModuleList | None = None

    def configure_model(self) -> None:
        if self.blocks is not None:
            return
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(Block(0.1) for _ in range(BLOCKS))
        self.blocks[1].up.bias.requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)
        if self.by_hand:
            for block in self.blocks:
                checkpoint(block)


@contextmanager
def _gathers_counted() -> Iterator[Counter]:
    """Every all-gather the engine issues meanwhile, by unit name (``Comm.all_gather`` wrapped in this process)."""
    counts: Counter = Counter()
    original = Comm.all_gather

    def counting(self: Comm, output: torch.Tensor, source: torch.Tensor, name: str = "", **kwargs: Any) -> Any:
        counts[name] += 1
        return original(self, output, source, name=name, **kwargs)

    Comm.all_gather = counting  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        Comm.all_gather = original  # type: ignore[method-assign]


def _trainer_cases(rank: int, world_size: int) -> None:
    for dropout in (0.1, 0.0):
        L.seed_everything(0)
        by_hand = fit(DDPStrategy(), BlockNet(dropout, by_hand=True), STEPS)
        for stage, cls in STAGES.items():
            L.seed_everything(0)
            model = BlockNet(dropout)
            got = fit(cls(activation_checkpointing_policy={Block}), model, STEPS)
            assert_same(got, by_hand, f"{stage} dropout={dropout}: against DDP with the blocks checkpointed by hand")
            # Each block's forward twice per micro-batch (the recomputation), as in the reference.
            assert [b.calls for b in model.blocks] == [2 * STEPS] * BLOCKS, (stage, model.blocks[0].calls)
        if dropout == 0.0:  # nothing random: checkpointing changes no bit
            L.seed_everything(0)
            plain = fit(DDPStrategy(), BlockNet(dropout), STEPS)
            assert_same(by_hand, plain, "checkpointed by hand against no checkpointing")
    # Stage 3 with a unit per block and gradient accumulation: against the same stage with the blocks checkpointed
    # by hand (DDP sums the micro-batches before its reduction, stage 3 after: see docs/parity.md), and the gathers
    # counted: the recomputation adds none (it runs on the unit that backward gathered), so each block is gathered as
    # often as without checkpointing, at most twice per micro-batch (plus once when the module is made whole at the
    # end of fit).
    L.seed_everything(0)
    reference = fit(ZeRO3Strategy(unit_modules=[Block]), BlockNet(0.1, by_hand=True), STEPS, ACCUMULATE)
    L.seed_everything(0)
    model = BlockNet(0.1)
    with _gathers_counted() as counts:
        strategy = ZeRO3Strategy(unit_modules=[Block], activation_checkpointing_policy={Block})
        got = fit(strategy, model, STEPS, ACCUMULATE)
    assert_same(got, reference, "zero3 with accumulation: against the blocks checkpointed by hand")
    micro_batches = STEPS * ACCUMULATE
    assert [b.calls for b in model.blocks] == [2 * micro_batches] * BLOCKS, model.blocks[0].calls
    L.seed_everything(0)
    with _gathers_counted() as without:
        fit(ZeRO3Strategy(unit_modules=[Block]), BlockNet(0.1), STEPS, ACCUMULATE)
    blocks = [f"blocks.{i}" for i in range(BLOCKS)]
    assert [counts[b] for b in blocks] == [without[b] for b in blocks], (counts, without)
    assert all(counts[b] <= 2 * micro_batches + 1 for b in blocks), counts
    # Layers made in configure_model: stage 3 creates them already sharded from the meta device (meta_init), and
    # the policy applies to them as to any.
    L.seed_everything(0)
    reference = fit(DDPStrategy(), LateBlockNet(by_hand=True), STEPS)
    L.seed_everything(0)
    got = fit(ZeRO3Strategy(unit_modules=[Block], activation_checkpointing_policy={Block}), LateBlockNet(), STEPS)
    assert_same(got, reference, "zero3, layers made in configure_model: against DDP with them checkpointed by hand")
    # Hugging Face decoder layers with their models' cache default (config.use_cache=True): the cache is off in the
    # training forwards (see [Note: key/value caches under recomputation]), else the recomputation would fill it a
    # second time and fail in backward. Against DDP with transformers' own checkpointing, which turns it off too.
    for name, layer in (("llama", "LlamaDecoderLayer"), ("gpt2", "GPT2Block")):
        L.seed_everything(0)
        reference = fit(DDPStrategy(), RealModelNet(name, checkpointing="non-reentrant"), STEPS)
        L.seed_everything(0)
        net = RealModelNet(name)
        got = fit(ZeRO3Strategy(activation_checkpointing_policy={layer}), net, STEPS)
        assert_same(got, reference, f"zero3, {name} with its cache default: against DDP with gradient checkpointing")
        assert net.model.config.use_cache is True, name  # unchanged: config.json is written as without the policy
        x = torch.randint(0, 64, (2, 8))
        with pytest.warns(UserWarning, match=r"use_cache=True is incompatible with activation_checkpointing_policy"):
            out = net.model(input_ids=x, use_cache=True)  # asked for: off, with a warning, as in transformers
        out.logits.sum().backward()
        assert out.past_key_values is None, name
        net.model.eval()
        with torch.no_grad():  # nothing is recomputed: the cache stays on
            assert net.model(input_ids=x).past_key_values is not None, name
    # Class names (YAML configs) and FSDP's policy callables select the same modules.
    names = [name for name, _ in selected_modules(BlockNet(), {"Block"})]
    assert names == ["blocks.0", "blocks.1", "blocks.2"], names
    assert [n for n, _ in selected_modules(BlockNet(), ModuleWrapPolicy({Block}))] == names
    assert [n for n, _ in selected_modules(BlockNet(), lambda m: isinstance(m, Block))] == names
    # A model that checkpoints already keeps what it has, with a warning (as Lightning's FSDPStrategy).
    with pytest.warns(UserWarning, match="already checkpoints activations"):
        assert apply_activation_checkpointing(BlockNet(by_hand=True), {nn.Linear}) == []


def _fabric_case(rank: int, world_size: int) -> None:
    reference = fabric_run(FabricDDP(), lambda: BlockNet(0.1, by_hand=True), STEPS)
    built: dict[str, BlockNet] = {}

    def make() -> BlockNet:
        built["model"] = BlockNet(0.1)
        return built["model"]

    got = fabric_run(ZeRO3FabricStrategy(activation_checkpointing_policy={"Block"}), make, STEPS)
    assert_same(got, reference, "Fabric zero3 against Fabric DDP with the blocks checkpointed by hand")
    assert [b.calls for b in built["model"].blocks] == [2 * STEPS] * BLOCKS


def _cases(rank: int, world_size: int) -> None:
    _trainer_cases(rank, world_size)
    _fabric_case(rank, world_size)


def test_activation_checkpointing_policy_matches_ddp_with_the_same_checkpoints_by_hand() -> None:
    spawn(_cases, world_size=2)


def test_a_policy_that_is_not_one_is_refused_at_construction() -> None:
    with pytest.raises(TypeError, match=r"activation_checkpointing_policy=\{Block\}"):
        ZeRO3Strategy(activation_checkpointing_policy=Block)
    with pytest.raises(TypeError, match=r"entries must be nn\.Module subclasses or class names"):
        ZeRO2Strategy(activation_checkpointing_policy={3})
