"""Eight ranks on this machine (gloo, 8 processes on 2 cores: time does not matter). The parity model with tied,
frozen and reused layers, gradient accumulation and clipping by norm, under every stage, trains as DDP does at 8
ranks, through the Trainer and through Fabric; and a rank's model-state bytes at 2, 4 and 8 ranks follow 1/N (the
table in ``docs/memory.md``).

At 8 ranks the sums of a reduction run in another order than DDP's (a reduce-scatter's chunks, not one
all-reduce), so the bound is the accumulation-and-clipping one of ``docs/parity.md``, not bitwise.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy
from tests.distributed import spawn
from tests.models import VOCAB, ParityNet, quiet_trainer

MODEL = {"optimizer": "sgd", "frozen": True, "unused": True}
TRAINER = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}


class _Measure(L.Callback):
    """This rank's model-state bytes right after the first optimizer step, its gradients still there (they are
    zeroed at the next step's first backward)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        driver = getattr(trainer.strategy, "driver", None)
        if driver is not None and driver.sharded is not None and trainer.global_step == 1 and not self.bytes:
            self.bytes = driver.sharded.memory_stats()


def _train(strategy: Any, world_size: int) -> dict[str, Any]:
    L.seed_everything(0)
    model = ParityNet(**MODEL)
    params = list(dict.fromkeys(model.parameters()))
    measure = _Measure()
    trainer = quiet_trainer(strategy=strategy, devices=world_size, max_steps=3, callbacks=[measure], **TRAINER)
    trainer.fit(model)
    return {
        "losses": model.losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "bytes": measure.bytes,
        "numel": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
    }


def _fabric_loop(strategy: Any, world_size: int) -> dict[str, Any]:
    """Fabric's door: a hand-written loop over the same model, 2 micro-batches per step, clipping by norm."""
    from lightning.fabric import Fabric

    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size)
    fabric.launch()
    L.seed_everything(0)
    model = ParityNet(**MODEL)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    generator = torch.Generator().manual_seed(fabric.global_rank)
    losses = []
    for _ in range(3):
        for micro in range(2):
            x = torch.randint(0, VOCAB, (4, 8), generator=generator)
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = model(x).float().pow(2).mean()
                fabric.backward(loss / 2)
            losses.append(float(loss))
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fabric.strategy.teardown()
    return {"losses": losses, "state": state}


def _eight(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_zero import fabric as zero_fabric

    reference = _fabric_loop("ddp", world_size)
    for cls in (zero_fabric.ZeRO1Strategy, zero_fabric.ZeRO2Strategy, zero_fabric.ZeRO3Strategy):
        got = _fabric_loop(cls(), world_size)
        torch.testing.assert_close(got["losses"], reference["losses"], rtol=1e-6, atol=0, msg=f"Fabric {cls.stage}")
        for key, value in reference["state"].items():
            torch.testing.assert_close(got["state"][key], value, rtol=1e-6, atol=1e-7, msg=f"Fabric {cls.stage} {key}")
    ddp = _train(DDPStrategy(find_unused_parameters=True), world_size)
    results = {"ddp": ddp}
    for name, cls in (("zero1", ZeRO1Strategy), ("zero2", ZeRO2Strategy), ("zero3", ZeRO3Strategy)):
        got = _train(cls(), world_size)
        assert len(got["losses"]) == len(ddp["losses"]) > 0, name
        torch.testing.assert_close(got["losses"], ddp["losses"], rtol=1e-6, atol=0, msg=f"{name} rank {rank}")
        for key, value in ddp["state"].items():
            torch.testing.assert_close(got["state"][key], value, rtol=1e-6, atol=1e-7, msg=f"{name} {key}")
        results[name] = {"bytes": got["bytes"], "numel": got["numel"], "trainable": got["trainable"]}
    return {k: v for k, v in results.items() if k != "ddp"}


def _zero3_bytes(rank: int, world_size: int) -> dict[str, int]:
    return _train(ZeRO3Strategy(), world_size)["bytes"]


def test_every_stage_at_eight_ranks_trains_as_ddp_and_state_shrinks_as_one_over_n() -> None:
    at_eight = spawn(_eight, world_size=8, timeout=900)
    by_world = {8: [r["zero3"]["bytes"] for r in at_eight]}
    for world in (2, 4):
        by_world[world] = spawn(_zero3_bytes, world_size=world, timeout=300)
    numel, trainable = at_eight[0]["zero3"]["numel"], at_eight[0]["zero3"]["trainable"]
    padding = 4 * 8 * 4  # a unit's padding: fewer than N elements (4 bytes), at most 4 units here
    for world, ranks in by_world.items():
        assert len(ranks) == world
        total = {key: sum(stats[key] for stats in ranks) for key in ("params", "grads", "optimizer_states")}
        # Every rank holds 1/N of the parameters and of the gradients (a flat shard per unit, padding included) ...
        for stats in ranks:
            assert abs(stats["params"] - 4 * numel / world) <= padding, (world, stats["params"], 4 * numel / world)
        # (a gradient shard lives in its reduction's chunk, with the slot and the 16-byte alignment: under 16 bytes
        # more per unit and rank, see [Note: aligned chunks] in core/layout.py)
        chunk_extra = 16 * 4 * world
        assert abs(total["params"] - 4 * numel) <= padding, total
        assert abs(total["grads"] - 4 * numel) <= padding + chunk_extra, total
        # ... and together the ranks hold the optimizer state exactly once (SGD with momentum: one value per
        # trainable element; a rank whose shard holds only frozen elements holds none).
        assert total["optimizer_states"] == 4 * trainable, (world, total)
    for rank, rank_result in enumerate(at_eight):  # stages 1 and 2 shard the optimizer states as stage 3 does
        for stage in ("zero1", "zero2"):
            assert rank_result[stage]["bytes"]["optimizer_states"] == by_world[8][rank]["optimizer_states"], stage
