"""``accumulate="local"``: under stages 2 and 3 the micro-batches of one optimizer step add up
their full gradients on each rank and reduce-scatter once, at the step's last micro-batch, as DDP and stage 1 do:
a quarter of the reduce-scatter bytes at ``accumulate_grad_batches=4``, DDP's results bit for bit (the same order
of sums), and under stage 3 the parameters still freed after each use. Through the Trainer and Fabric.
"""

from __future__ import annotations

import lightning as L
import pytest
from lightning.fabric.strategies import DDPStrategy as FabricDDP
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy
from lightning_zero.fabric import ZeRO3Strategy as ZeRO3FabricStrategy
from tests.block_net import BLOCKS, Block, BlockNet, assert_same, fabric_run, fit
from tests.distributed import spawn

STEPS, ACCUMULATE = 3, 4


def _trainer_cases(rank: int, world_size: int) -> None:
    L.seed_everything(0)
    ddp = fit(DDPStrategy(), BlockNet(), STEPS, ACCUMULATE)
    for cls, units in ((ZeRO2Strategy, {}), (ZeRO3Strategy, {"unit_modules": [Block]})):
        L.seed_everything(0)
        reducing = BlockNet()
        sharded = fit(cls(**units), reducing, STEPS, ACCUMULATE)
        L.seed_everything(0)
        model = BlockNet()
        local = fit(cls(accumulate="local", **units), model, STEPS, ACCUMULATE)
        where = f"{cls.__name__}(accumulate='local')"
        assert_same(local, ddp, f"{where} against DDP")  # DDP's order of sums: local, then one reduction
        ratio = local[2].reduce_scatter_bytes / sharded[2].reduce_scatter_bytes
        assert 0.2 <= ratio <= 0.3, (where, ratio)  # one reduction per optimizer step instead of four
        if cls is ZeRO3Strategy:  # the parameters are freed after each use, as when every micro-batch reduces
            assert 0 < model.most_gathered == reducing.most_gathered < BLOCKS, (where, model.most_gathered)
    assert ZeRO2Strategy(accumulate="local").accumulate == "local"
    assert ZeRO3Strategy().accumulate == "sharded" and ZeRO1Strategy().accumulate == "local"


def _fabric_case(rank: int, world_size: int) -> None:
    reference = fabric_run(FabricDDP(), lambda: BlockNet(), STEPS, ACCUMULATE)
    strategy = ZeRO3FabricStrategy(accumulate="local", unit_modules=[Block])
    got = fabric_run(strategy, lambda: BlockNet(), STEPS, ACCUMULATE)
    assert_same(got, reference, "Fabric zero3 accumulate='local' against Fabric DDP")


def _cases(rank: int, world_size: int) -> None:
    _trainer_cases(rank, world_size)
    _fabric_case(rank, world_size)


def test_local_accumulation_reduces_once_per_step_and_matches_ddp() -> None:
    spawn(_cases, world_size=2)


def test_stage_one_refuses_sharded_accumulation() -> None:
    with pytest.raises(ValueError, match="accumulate='sharded' needs ZeRO2Strategy or ZeRO3Strategy"):
        ZeRO1Strategy(accumulate="sharded")
    with pytest.raises(ValueError, match="accumulate must be 'sharded' or 'local'"):
        ZeRO3Strategy(accumulate="deferred")
