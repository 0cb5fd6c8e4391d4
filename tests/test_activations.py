"""``profile_activations`` and the estimator's activation column: the profile taken on the meta device equals the
one taken on a real model, equals what a real forward keeps alive for backward (with and without activation
checkpointing applied the way the strategies apply it), and moves every row's peak and the recommendation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.model import BenchConfig, BenchGPT, Block
from lightning_zero.engine.core.ledger import GatherLedger
from lightning_zero.engine.schedule.recompute import apply_activation_checkpointing
from lightning_zero.planning.activations import ActivationProfile, profile_activations
from lightning_zero.planning.estimate import estimate_memory
from lightning_zero.tools.step_memory import StepMemory

CONFIG = BenchConfig(n_layer=3, n_head=4, n_embd=64, block_size=32, vocab_size=50, batch_size=4)
UNITS = [Block]  # below the default units' minimum size, the whole model would be one unit


def _gpt(device: str = "cpu") -> BenchGPT:
    torch.manual_seed(0)
    with torch.device(device):
        return BenchGPT(CONFIG)


def _batch(size: int = CONFIG.batch_size) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CONFIG.vocab_size, (size, CONFIG.block_size))
    return tokens, tokens.roll(1, dims=1)


def _alive_after_forward(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Bytes of every tensor the forward made and still holds (what backward will read), counted per storage."""
    with StepMemory(GatherLedger()) as tracked:
        loss = model(*batch)
        alive = tracked.allocated
    loss.backward()
    return alive - loss.untyped_storage().nbytes()


@pytest.mark.parametrize("policy", [None, {Block}], ids=["plain", "checkpointed"])
def test_the_profile_counts_what_a_real_forward_keeps_for_backward(policy: set[type[nn.Module]] | None) -> None:
    batch = _batch()
    on_meta = profile_activations(_gpt("meta"), batch, UNITS, activation_checkpointing_policy=policy)
    real = profile_activations(_gpt(), batch, UNITS, activation_checkpointing_policy=policy)
    # Meta runs attention as the fused kernel CPU and CUDA pick, not its math fallback: the same saved tensors.
    assert on_meta == real
    assert [u.name for u in real.units] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    blocks = real.units[1:]
    assert len({u.saved_bytes for u in blocks}) == 1 and blocks[0].saved_bytes > 0
    model = _gpt()
    apply_activation_checkpointing(model, policy)  # as ZeRODriver.shard applies the policy
    # The profile counts the batch too where autograd saves it (the token ids for the embedding's gradient, the
    # targets for the loss's), which existed before the forward and so is not among what it made.
    alive = _alive_after_forward(model, batch) + sum(t.untyped_storage().nbytes() for t in batch)
    if policy is None:
        assert real.checkpointed_modules == 0 and real.held_bytes == real.saved_bytes == real.peak_bytes
        assert alive == real.saved_bytes
    else:
        # Each block keeps only its input, (B, T, C) in fp32; its saved tensors come back for its own backward.
        width = CONFIG.batch_size * CONFIG.block_size * CONFIG.n_embd * 4
        assert all(u.checkpointed and u.held_bytes == width for u in blocks)
        assert real.recompute_bytes == blocks[0].saved_bytes and real.checkpointed_modules == 3
        assert alive == real.held_bytes < real.saved_bytes


def test_a_model_checkpointed_already_is_refused_and_inputs_must_meet_the_model() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    apply_activation_checkpointing(model, {nn.Linear})  # torch's composable checkpoint on each Linear
    with pytest.raises(ValueError, match=r"checkpoints activations already \(0 has torch's composable checkpoint\)"):
        profile_activations(model, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="example_input is on the meta device but the model is on cpu"):
        profile_activations(nn.Linear(4, 4), torch.zeros(2, 4, device="meta"))
    # A function of the model runs the forward itself (a LightningModule's training_step, a loss outside).
    profile = profile_activations(nn.Linear(4, 4), lambda m: m(torch.zeros(2, 4)).sum())
    assert profile.saved_bytes == 2 * 4 * 4  # the input, saved for the weight's gradient


def test_the_estimator_adds_the_activations_to_every_row_and_recommends_by_them() -> None:
    model = _gpt("meta")
    batch = _batch(16)  # activations larger than the model states
    plain = profile_activations(model, batch, UNITS)
    checkpointed = profile_activations(model, batch, UNITS, activation_checkpointing_policy={Block})
    without = estimate_memory(model, devices=2, unit_modules=UNITS)
    with_plain = estimate_memory(model, devices=2, unit_modules=UNITS, activations=plain)
    for before, after in zip(without.rows, with_plain.rows):
        assert before.activations == 0.0 and after.activations == plain.peak_bytes
        assert after.device_peak == before.device_peak + plain.peak_bytes
        assert after.device == before.device and after.comm_bytes == before.comm_bytes
    assert "activations" in with_plain.table() and "activations" not in without.table().split("\n")[2]
    assert with_plain.as_dict()["activations"]["peak_bytes"] == plain.peak_bytes
    # A budget the activations alone fill: nothing fits, not even with offload, and the recommendation says
    # to recompute them; with checkpointing, stage 3 fits without offloading anything.
    budget = plain.peak_bytes
    assert without.row("zero3").device_peak + checkpointed.peak_bytes < budget
    refused = estimate_memory(model, devices=2, unit_modules=UNITS, activations=plain, memory_per_device=budget)
    assert refused.recommended is None and "checkpoint activations (activation_checkpointing_policy)" in (
        refused.recommendation
    )
    fits = estimate_memory(
        model, devices=2, unit_modules=UNITS, activations=checkpointed, memory_per_device=budget
    ).recommended
    assert fits is not None and not fits.offload_optimizer and fits.device_peak <= budget
    with pytest.raises(TypeError, match="activations must be an ActivationProfile"):
        estimate_memory(model, devices=2, activations=plain.peak_bytes)  # type: ignore[arg-type]
    assert isinstance(plain, ActivationProfile)
