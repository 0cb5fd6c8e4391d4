"""Third-party models under every stage: GPT-2, Llama, BERT, OPT, ResNet, ViT (transformers) and LitGPT.

Tiny configurations, random init, random data, 2 gloo ranks; see ``tests/real_models.py`` for the
models and for why ResNet and ViT are transformers' (torchvision and timm cannot be installed beside the
CPU build of torch). Needs the ``models`` extra (part of ``test``); skipped without it.

- Meta init (stage 3's default for layers built in ``configure_model``): every parameter and buffer
  (non-persistent ones included) equals an ordinary construction with the same seed, and the random
  generator is left where an ordinary construction leaves it. transformers >= 5 skips its own
  ``_init_weights`` on meta and ViT's ``trunc_normal_`` draws by rejection: both are caught here.
- Pretrained weights load into a model built on meta: ``load_state_dict`` after setup streams them into
  the shards.
- Setup memory of a transformers GPT-2 built on meta with one unit per block: every shard plus the root
  unit and one block (transformers initializes the embeddings first and the final norm last, so the root
  unit is open throughout), never the full model.
- A ``Trainer`` on 2 ranks, 3 steps, fp32 AdamW, per model: ``zero1``, ``zero2``, ``zero3`` with the model
  built ordinarily (``meta_init=False``) and ``zero3`` with its defaults (built on meta) give DDP's losses
  and final parameters and buffers, bitwise at 2 ranks (no clipping; see ``docs/parity.md``). Also Llama
  in ``bf16-true`` under ``zero3`` defaults (the setup cast of meta layers is replayed), and GPT-2 and Llama
  with transformers' activation checkpointing (``gradient_checkpointing_enable``, reentrant and not) under
  ``zero3`` with one unit per block.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy

from lightning_zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy, ZeROStrategy
from lightning_zero.engine import Comm, module_class_policy, record_meta_init, shard_model
from tests.distributed import spawn
from tests.memory_tracker import LiveStorageBytes
from tests.models import quiet_trainer

pytest.importorskip("transformers")
pytest.importorskip("litgpt")

from tests.real_models import NAMES, RealModelNet, build


def _everything(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones too), by name."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _meta_init_equals_ordinary(rank: int, world_size: int) -> dict[str, Any]:
    comm = Comm()
    for name in NAMES:
        torch.manual_seed(0)
        expected = {k: v.detach().clone() for k, v in _everything(build(name)).items()}
        generator_after = torch.get_rng_state()
        torch.manual_seed(0)
        with record_meta_init() as trace:
            model = build(name)
        torch.manual_seed(1)  # draws between building and setup do not change the values
        sharded = shard_model(model, stage=3, comm=comm, meta_init=trace)
        assert torch.equal(torch.get_rng_state(), generator_after), f"{name}: random generator left elsewhere"
        full = sharded.full_state_dict()
        buffers = dict(model.named_buffers())
        assert set(expected) == set(dict(model.named_parameters())) | set(buffers), name
        for key, value in expected.items():
            got = full[key] if key in full else buffers[key]
            assert got.dtype == value.dtype and torch.equal(got, value), f"{name}: {key} differs"
        if name == "gpt2":  # pretrained weights streamed into the shards of a model built on meta
            torch.manual_seed(2)
            pretrained = {k: v.detach().clone() for k, v in build(name).state_dict().items()}
            model.load_state_dict(pretrained)
            full = sharded.full_state_dict()
            assert all(torch.equal(full[k], v) for k, v in pretrained.items())
        sharded.release()

    # Setup memory: a deeper GPT-2, one unit per block.
    torch.manual_seed(0)
    with record_meta_init() as trace:
        model = build("gpt2", layers=6, width=64)
    numels = {
        "root": sum(p.numel() for n, p in model.named_parameters() if ".h." not in n),
        "block": sum(p.numel() for p in model.transformer.h[0].parameters()),
    }
    with LiveStorageBytes() as tracker:
        sharded = shard_model(model, stage=3, comm=comm, units=module_class_policy(["GPT2Block"]), meta_init=trace)
    shards = 4 * sum(u.layout.shard_numel for u in sharded.units)
    predicted = shards + 4 * (numels["root"] + numels["block"])
    full_model = 4 * (numels["root"] + 6 * numels["block"])
    assert tracker.peak < full_model, (tracker.peak, full_model)
    assert abs(tracker.peak - predicted) <= 0.1 * predicted, (tracker.peak, predicted)
    sharded.release()
    return {"peak": tracker.peak, "predicted": predicted, "shards": shards, "full": full_model}


def test_meta_init_equals_an_ordinary_construction() -> None:
    spawn(_meta_init_equals_ordinary, world_size=2, timeout=300)


class Snapshot(Callback):
    """The full parameters and buffers after training (on every rank)."""

    def __init__(self) -> None:
        self.final: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        state = strategy.full_state_dict() if isinstance(strategy, ZeROStrategy) else pl_module.state_dict()
        buffers = {f"{k}": v for k, v in pl_module.named_buffers()}
        self.final = {k: v.detach().clone() for k, v in {**state, **buffers}.items()}


STRATEGIES = {
    "zero1": ZeRO1Strategy,
    "zero2": ZeRO2Strategy,
    "zero3 built ordinarily": lambda: ZeRO3Strategy(meta_init=False),
    "zero3 defaults (meta init)": ZeRO3Strategy,
}


def _fit(
    name: str, strategy: Any, checkpointing: str | None = None, **trainer_kwargs: Any
) -> tuple[list[float], dict[str, torch.Tensor]]:
    L.seed_everything(0)
    model = RealModelNet(name, checkpointing=checkpointing)
    snapshot = Snapshot()
    quiet_trainer(strategy=strategy, devices=2, max_steps=3, callbacks=[snapshot], **trainer_kwargs).fit(model)
    return model.losses, snapshot.final


def _check(where: str, got: tuple[list[float], dict[str, torch.Tensor]], ddp: tuple[list[float], dict]) -> None:
    (got_losses, got_final), (losses, final) = got, ddp
    assert got_losses == losses, f"{where}: losses {got_losses} != DDP's {losses}"
    assert set(got_final) == set(final), where
    for key, value in final.items():
        assert got_final[key].dtype == value.dtype and torch.equal(got_final[key], value), f"{where}: {key}"


def _trainer_parity(rank: int, world_size: int) -> dict[str, list[str]]:
    results: dict[str, list[str]] = {}
    for name in NAMES:
        ddp = _fit(name, DDPStrategy())
        results[name] = []
        for label, strategy in STRATEGIES.items():
            _check(f"{name} under {label}, rank {rank}", _fit(name, strategy()), ddp)
            results[name].append(label)
    # bf16-true casts the layers at setup, after configure_model: the cast of the meta layers (Llama's rotary
    # buffers are made in fp32) is replayed too.
    ddp = _fit("llama", DDPStrategy(), precision="bf16-true")
    _check(
        f"llama bf16-true under zero3 defaults, rank {rank}", _fit("llama", ZeRO3Strategy(), precision="bf16-true"), ddp
    )
    results["llama bf16-true"] = ["zero3 defaults (meta init)"]
    # transformers' activation checkpointing, both kinds, with one unit per block: each block's forward runs
    # again in backward, where stage 3 gathers its unit once more.
    for name in ("gpt2", "llama"):
        for checkpointing in ("reentrant", "non-reentrant"):
            ddp = _fit(name, DDPStrategy(), checkpointing)
            blocks = ZeRO3Strategy(unit_modules=["GPT2Block", "LlamaDecoderLayer"])
            got = _fit(name, blocks, checkpointing)
            _check(f"{name} with {checkpointing} checkpointing under zero3 blocks, rank {rank}", got, ddp)
            results[f"{name} {checkpointing} checkpointing"] = ["zero3 blocks"]
    return results


def test_trainer_parity_with_ddp() -> None:
    spawn(_trainer_parity, world_size=2, timeout=600)
