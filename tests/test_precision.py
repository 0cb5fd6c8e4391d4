"""Every Lightning precision under every stage, against ``DDPStrategy`` at the same precision.

Tolerances, and why they hold:

- ``param_dtype=torch.float32`` with ``"bf16-mixed"`` / ``"16-mixed"`` is Lightning's own mixed
  precision (fp32 parameters under autocast): bitwise equal to DDP, loss-scaler decisions included.
- ``"bf16-true"``: both sides step bf16 parameters with bf16 gradients. We reduce in fp32 and round
  once; DDP sums two bf16 values, which at two ranks is the same correctly rounded sum: bitwise equal.
- ``"16-true"``: the same, but gloo's fp16 all-reduce rounds some sums differently from a correctly
  rounded fp32 sum, by one fp16 ulp: losses agree to 1e-2 relative, parameters to 4 ulps (4e-3).
- The default mixed precision keeps the *compute* copy in the half type (half the gather bytes).
  DDP's autocast casts the same fp32 values to the same half values for matmuls, so forward differs
  only where autocast would have used fp32 (embeddings, elementwise products with parameters), and
  gradients are rounded to the half type once before the fp32 reduction. Each is a relative rounding
  of at most 2^-8 (bf16), so the losses agree to 1e-2 relative over a few steps; Adam normalises each
  update to about ``lr``, so a rounding can move a parameter by a fraction of ``lr`` per step: final
  parameters agree to ``0.5 * lr * steps`` absolute.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy, ZeROPrecision, ZeROStrategy
from lightning_zero.engine.core.scaler import ShardedGradScaler
from tests.distributed import spawn
from tests.models import ParityNet, quiet_trainer

STAGES = (ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy)
STEPS = 6
LR = 1e-2


class OverflowNet(ParityNet):
    """Its loss is multiplied by 1e8 at step 2, so that the fp16 gradients overflow there."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        loss = super().training_step(batch, batch_idx)
        return loss * 1e8 if self.global_step == 2 else loss


def _train(strategy: Any, precision: str | None, model_cls: type = ParityNet, optimizer: str = "adamw", **kwargs: Any):
    L.seed_everything(0)
    model = model_cls(optimizer=optimizer)
    trainer = quiet_trainer(strategy=strategy, devices=2, max_steps=STEPS, precision=precision, **kwargs)
    trainer.fit(model)
    result = {
        "losses": model.losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "scale": getattr(getattr(trainer.precision_plugin, "scaler", None), "get_scale", lambda: None)(),
    }
    if isinstance(trainer.strategy, ZeROStrategy):
        result["skipped"] = trainer.strategy.skipped_steps
    return result


def _assert_equal(got: dict, ref: dict, where: str) -> None:
    assert got["losses"] == ref["losses"], where
    for key, value in ref["state"].items():
        assert got["state"][key].dtype == value.dtype, f"{where}: {key}"
        assert torch.equal(got["state"][key], value), f"{where}: {key}"


def _assert_close(got: dict, ref: dict, where: str) -> None:
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-2, atol=0, msg=where)
    for key, value in ref["state"].items():
        assert got["state"][key].dtype == value.dtype, f"{where}: {key}"
        torch.testing.assert_close(got["state"][key], value, rtol=0, atol=0.5 * LR * STEPS, msg=f"{where}: {key}")


def _bf16(rank: int, world_size: int) -> None:
    ddp = _train(DDPStrategy(), "bf16-mixed")
    for stage in STAGES:
        _assert_equal(_train(stage(param_dtype=torch.float32), "bf16-mixed"), ddp, f"{stage.__name__} fp32 params")
        got = _train(stage(), "bf16-mixed")
        assert got["losses"] != ddp["losses"], "bf16 parameters should not be exactly DDP's fp32 ones"
        _assert_close(got, ddp, f"{stage.__name__} bf16 params")
    ddp = _train(DDPStrategy(), "bf16-true")
    for stage in STAGES:
        _assert_equal(_train(stage(), "bf16-true"), ddp, f"{stage.__name__} bf16-true")


def test_bf16_precisions_match_ddp() -> None:
    spawn(_bf16, world_size=2, timeout=400)


def _fp16(rank: int, world_size: int) -> None:
    # Pure fp16 with Adam divides by an eps that fp16 rounds to 0; SGD is what people run in 16-true.
    ddp = _train(DDPStrategy(), "16-true", optimizer="sgd")
    for stage in STAGES:
        got = _train(stage(), "16-true", optimizer="sgd")
        torch.testing.assert_close(got["losses"], ddp["losses"], rtol=1e-2, atol=0)
        for key, value in ddp["state"].items():
            assert got["state"][key].dtype == torch.float16
            torch.testing.assert_close(got["state"][key], value, rtol=0, atol=4e-3, msg=f"{stage.__name__}: {key}")

    # 16-mixed on CPU needs the plugin (the Trainer turns precision="16-mixed" into bf16 on CPU).
    def scaler() -> torch.amp.GradScaler:
        return torch.amp.GradScaler("cpu", init_scale=2.0**10)

    ddp = _train(DDPStrategy(), None, OverflowNet, plugins=[MixedPrecision("16-mixed", "cpu", scaler())])
    assert ddp["scale"] == 2.0**9, "the reference should have skipped exactly one step"
    # The loss scale is a device value: the plugin reads it only for the warning of a skipped step.
    original, reads = ShardedGradScaler.get_scale, []

    def get_scale(self: ShardedGradScaler) -> float:
        reads.append(self)
        return original(self)

    for stage in STAGES:
        plugin = ZeROPrecision("16-mixed", "cpu", scaler())
        ShardedGradScaler.get_scale = get_scale  # type: ignore[method-assign]
        try:
            got = _train(stage(param_dtype=torch.float32), None, OverflowNet, plugins=[plugin])
        finally:
            ShardedGradScaler.get_scale = original  # type: ignore[method-assign]
        _assert_equal(got, ddp, f"{stage.__name__} 16-mixed fp32 params")
        assert (got["scale"], got["skipped"]) == (2.0**9, 1)
        # Two for the skipped step's warning (the scale before and after), one by _train: none on the other steps.
        assert len(reads) == 3, f"{stage.__name__}: {len(reads)} reads of the scale"
        reads.clear()
        plugin = ZeROPrecision("16-mixed", "cpu", scaler())
        got = _train(stage(), None, OverflowNet, plugins=[plugin])
        assert (got["scale"], got["skipped"]) == (2.0**9, 1), "fp16 parameters: the same step is skipped"
        _assert_close(got, ddp, f"{stage.__name__} 16-mixed fp16 params")


def test_fp16_precisions_match_ddp_and_skip_overflowing_steps_together() -> None:
    spawn(_fp16, world_size=2, timeout=400)
