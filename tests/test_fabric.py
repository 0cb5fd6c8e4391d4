"""The Fabric strategies (``lightning_zero.fabric``): the loop of ``examples/fabric_train_gpt.py`` under Fabric's
``DDPStrategy`` and under each stage, compared step by step; options; checkpoints; precisions.

One process group per test runs every strategy in turn (Fabric joins the group the harness made, as under
torchrun). The bounds are the Trainer strategies' (``docs/parity.md``, "The real bounds"): without accumulation and
without clipping by norm every stage is bitwise equal to DDP at two ranks; accumulation under stages 2 and 3
(every micro-batch reduced into the sharded gradient) and clipping by norm (the global norm summed in another
order) are checked at 1e-6 relative.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.utilities.load import _lazy_load as lazy_load
from torch import nn

import lightning_zero  # registers the strategy names with Fabric
from lightning_zero.engine.errors import NonFiniteGradientError
from lightning_zero.fabric import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy
from tests.distributed import spawn

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STAGES = ("zero1", "zero2", "zero3")


def _example() -> Any:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import fabric_train_gpt

    return fabric_train_gpt


def _fabric(strategy: Any, world_size: int, precision: Any = "32-true") -> Fabric:
    if isinstance(precision, str):
        fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size, precision=precision)
    else:  # a plugin, e.g. "16-mixed" on the CPU, which Fabric otherwise turns into "bf16-mixed"
        fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size, plugins=[precision])
    fabric.launch()
    return fabric


def _parity(rank: int, world_size: int) -> dict[str, Any]:
    example = _example()
    cases = {
        "norm": example.LoopArgs(steps=4, max_norm=1.0),
        "value": example.LoopArgs(steps=4, max_norm=None, clip_val=0.02),
        "plain": example.LoopArgs(steps=4, micro_batches=1, max_norm=None),
        "plain-value": example.LoopArgs(steps=4, micro_batches=1, max_norm=None, clip_val=0.02),
    }
    results: dict[str, Any] = {}
    for case, args in cases.items():
        for strategy in ("ddp", *STAGES):
            fabric = _fabric(strategy, world_size)
            results[f"{case}/{strategy}"] = example.train(fabric, args, *example.corpus_tokens())
            fabric.strategy.teardown()
    return results


def _assert_same_run(got: dict[str, Any], ddp: dict[str, Any], exact: bool, where: str) -> None:
    if exact:
        assert got["losses"] == ddp["losses"], where
        for key, value in ddp["state"].items():
            assert torch.equal(got["state"][key], value), f"{where}: {key}"
        return
    torch.testing.assert_close(got["losses"], ddp["losses"], rtol=1e-6, atol=0, msg=where)
    for key, value in ddp["state"].items():
        # Attention key biases have an exactly-zero true gradient: Adam normalizes the rounding noise of the
        # micro-batches, which stages 2 and 3 reduce one by one (see docs/parity.md).
        atol = 1e-6 if key.endswith("c_attn.bias") else 1e-7
        torch.testing.assert_close(got["state"][key], value, rtol=1e-6, atol=atol, msg=f"{where}: {key}")


def test_gpt_loop_matches_fabric_ddp() -> None:
    """Accumulation (2 micro-batches) or none, clipping by norm and by value, two param groups, a scheduler, the model
    built under fabric.init_module (stage 3: on the meta device, created sharded at setup)."""
    results = spawn(_parity, world_size=2)
    for rank_results in results:
        for case in ("norm", "value", "plain", "plain-value"):
            ddp = rank_results[f"{case}/ddp"]
            assert case != "norm" or ddp["losses"][-1] < ddp["losses"][0]  # it trains
            for stage in STAGES:
                got = rank_results[f"{case}/{stage}"]
                # Bitwise where the Trainer strategies are: no accumulation (or stage 1, which accumulates locally)
                # and no clipping by norm. Stages 2 and 3 reduce each micro-batch (rounding), and clipping by norm
                # sums the norm in another order (rounding).
                exact = case.startswith("plain") or (case == "value" and stage == "zero1")
                _assert_same_run(got, ddp, exact=exact, where=f"{case}/{stage}")


def _resume(rank: int, world_size: int, root: str) -> dict[str, Any]:
    example = _example()
    tokens = example.corpus_tokens()
    results: dict[str, Any] = {}
    runs = {"zero1": "zero1", "zero3": "zero3", "zero2_full": "zero2_full_checkpoint", "ddp": "ddp"}
    for name, strategy in runs.items():
        path = f"{root}/{name}"
        fabric = _fabric(strategy, world_size)
        whole = example.train(fabric, example.LoopArgs(steps=4, save_at=2, checkpoint=path), *tokens)
        fabric.strategy.teardown()
        fabric = _fabric(strategy, world_size)
        resumed = example.train(fabric, example.LoopArgs(steps=4, resume=path), *tokens)
        fabric.strategy.teardown()
        results[name] = {"whole": whole, "resumed": resumed}
    # Across strategies: Fabric DDP's file under stage 3, stage 3's sharded directory under stage 1.
    for name, (strategy, source) in {"ddp->zero3": ("zero3", "ddp"), "zero3->zero1": ("zero1", "zero3")}.items():
        fabric = _fabric(strategy, world_size)
        results[name] = example.train(fabric, example.LoopArgs(steps=4, resume=f"{root}/{source}"), *tokens)
        fabric.strategy.teardown()
    results["sharded_is_dir"] = Path(f"{root}/zero3").is_dir() and Path(f"{root}/zero2_full").is_file()
    return results


def _load_at_one_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Checkpoints written by 2 ranks, loaded by 1 under another stage: what the files hold, in the shards."""
    example = _example()
    vocab_size, _ = example.corpus_tokens()
    out = {}
    for source, strategy in (("zero3", "zero2"), ("zero1", "zero3"), ("zero2_full", "zero1")):
        fabric = _fabric(strategy, world_size)
        state = example.setup(fabric, example.LoopArgs(steps=4), vocab_size)
        rest = fabric.load(f"{root}/{source}", state)
        if source.endswith("_full"):  # Fabric's own file (the user's keys), as Fabric's DDP writes it
            expected = torch.load(f"{root}/{source}", weights_only=True)
        else:  # consolidated into the same layout
            expected = lightning_zero.consolidate_checkpoint(f"{root}/{source}")
        expected = {"state_dict": expected["model"], "optimizer_states": [expected["optimizer"]]}
        model_sd = state["model"].state_dict()
        optimizer_sd = state["optimizer"].state_dict()
        out[source] = {
            "step": state["step"],
            "rest": sorted(rest),
            "model": all(torch.equal(model_sd[k], v) for k, v in expected["state_dict"].items()),
            "optimizer": all(
                torch.equal(optimizer_sd["state"][i][key], value)
                for i, entry in expected["optimizer_states"][0]["state"].items()
                for key, value in entry.items()
            ),
            "lr": state["scheduler"].get_last_lr() == [g["lr"] for g in optimizer_sd["param_groups"]],
        }
        fabric.strategy.teardown()
    return out


def test_save_load_resumes_exactly(tmp_path: Path) -> None:
    """fabric.save / fabric.load with model, optimizer, scheduler and a step counter: sharded by default, full
    as an option; the resumed run continues as the uninterrupted one; Fabric DDP's file loads under a stage and
    the other way round; 2 ranks' checkpoints load at 1 rank under another stage."""
    results = spawn(_resume, world_size=2, root=str(tmp_path))[0]
    at_one_rank = spawn(_load_at_one_rank, world_size=1, root=str(tmp_path))[0]
    for source, loaded in at_one_rank.items():
        assert loaded == {"step": 2, "rest": [], "model": True, "optimizer": True, "lr": True}, source
    assert results["sharded_is_dir"]
    for name in ("zero1", "zero3", "zero2_full", "ddp"):
        whole, resumed = results[name]["whole"], results[name]["resumed"]
        assert resumed["losses"] == whole["losses"][2:], name
        for key, value in whole["state"].items():
            assert torch.equal(resumed["state"][key], value), f"{name}: {key}"
    ddp = results["ddp"]["whole"]
    _assert_same_run(results["ddp->zero3"], {"losses": ddp["losses"][2:], "state": ddp["state"]}, False, "ddp->zero3")
    zero3 = results["zero3"]["whole"]
    _assert_same_run(
        results["zero3->zero1"], {"losses": zero3["losses"][2:], "state": zero3["state"]}, False, "zero3->zero1"
    )


def _features(rank: int, world_size: int) -> dict[str, Any]:
    example = _example()
    from train_gpt import GPT, GPTConfig

    out: dict[str, Any] = {}
    config = GPTConfig(vocab_size=32, n_layer=2, n_head=2, n_embd=16, block_size=8)
    torch.manual_seed(1)
    pretrained = GPT(config).state_dict()
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(rank))
    reference = GPT(config)
    reference.load_state_dict(pretrained)

    # init_module: stage 3 builds on meta and creates the model sharded; pretrained weights load into the shards.
    fabric = _fabric("zero3", world_size)
    with fabric.init_module():
        model = GPT(config)
    out["built_on_meta"] = all(p.is_meta for p in model.parameters())
    model = fabric.setup_module(model)
    full_bytes = sum(p.numel() * 4 for p in reference.parameters())
    out["param_bytes_fraction"] = fabric.strategy.sharded_model.memory_stats()["params"] / full_bytes
    model.load_state_dict(pretrained)
    out["pretrained_loaded"] = all(torch.equal(v, pretrained[k]) for k, v in model.state_dict().items())
    # As LitGPT loads a checkpoint after setup: model.load_state_dict(lazy_load(path)), tensors read on use.
    torch.manual_seed(2)
    other = GPT(config).state_dict()
    with tempfile.TemporaryDirectory() as folder:
        torch.save(other, Path(folder) / "lit_model.pth")
        model.load_state_dict(lazy_load(Path(folder) / "lit_model.pth"))
    out["lazy_loaded"] = all(torch.equal(v, other[k]) for k, v in model.state_dict().items())
    model.load_state_dict(pretrained)
    with torch.no_grad():
        out["eval_matches"] = torch.equal(model(x), reference(x))
    # User collectives next to the engine's.
    out["all_reduce"] = fabric.all_reduce(torch.tensor(float(rank)), reduce_op="sum").item()
    out["all_gather"] = fabric.all_gather(torch.tensor([rank])).flatten().tolist()
    fabric.barrier()
    try:
        fabric.strategy._backward_sync_control.no_backward_sync(reference, True)
        out["no_sync_error"] = None
    except TypeError as error:
        out["no_sync_error"] = str(error)
    fabric.strategy.teardown()
    out["released"] = all(p.numel() == pretrained[n].numel() for n, p in model.module.named_parameters())

    # Non-finite gradients: every rank raises, or every rank skips the step (nonfinite_grads="skip").
    for policy in ("raise", "skip"):
        fabric = _fabric(ZeRO2Strategy(nonfinite_grads=policy), world_size)
        plain = GPT(config)
        model, optimizer = fabric.setup(plain, torch.optim.AdamW(plain.parameters()))  # joint setup
        before = {k: v.clone() for k, v in model.state_dict().items()}
        fabric.backward(model(x).sum() * (float("inf") if rank == 1 else 1.0))
        try:
            optimizer.step()
            out[policy] = fabric.strategy.skipped_steps
        except NonFiniteGradientError as error:
            out[policy] = type(error).__name__
        out[f"{policy} unchanged"] = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        fabric.strategy.teardown()

    # Precisions: the same loop under Fabric DDP and stage 3.
    args = example.LoopArgs(steps=3)
    tokens = example.corpus_tokens()
    runs = {
        "bf16-mixed/ddp": ("ddp", "bf16-mixed"),
        "bf16-mixed/zero3": ("zero3", "bf16-mixed"),
        "bf16-mixed/zero3-fp32-params": (ZeRO3Strategy(param_dtype=torch.float32), "bf16-mixed"),
        "bf16-true/ddp": ("ddp", "bf16-true"),
        "bf16-true/zero2": ("zero2", "bf16-true"),
        "bf16-true/zero3": ("zero3", "bf16-true"),  # built on meta in bf16 by init_module, created sharded
        "16-mixed/zero1": (ZeRO1Strategy(), MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))),
    }
    for name, (strategy, precision) in runs.items():
        fabric = _fabric(strategy, world_size, precision)
        out[name] = example.train(fabric, args, *tokens)["losses"]
        if name == "16-mixed/zero1":
            out["scaler"] = type(fabric.strategy.precision.scaler).__name__
        fabric.strategy.teardown()
    out["example_main"] = example.main(["--strategy", "zero2", "--devices", str(world_size), "--steps", "3"])["losses"]
    return out


def test_init_module_precisions_collectives_and_example() -> None:
    out = spawn(_features, world_size=2)[0]
    assert out["built_on_meta"]
    assert out["param_bytes_fraction"] < 0.75  # half the parameters per rank, plus padding
    assert out["pretrained_loaded"] and out["lazy_loaded"] and out["eval_matches"]
    assert out["all_reduce"] == 1.0 and out["all_gather"] == [0, 1]
    assert "fabric.setup" in out["no_sync_error"]
    assert out["released"]
    assert out["raise"] == "NonFiniteGradientError" and out["skip"] == 1
    assert out["raise unchanged"] and out["skip unchanged"]
    # fp32 parameters under autocast: Fabric DDP's own mixed precision, up to stage 3's rounding (accumulation,
    # norm clipping) carried through bf16 autocast.
    torch.testing.assert_close(out["bf16-mixed/zero3-fp32-params"], out["bf16-mixed/ddp"], rtol=1e-5, atol=0)
    # bf16 compute copies of fp32 master shards (the default): the same run within bf16 rounding.
    torch.testing.assert_close(out["bf16-mixed/zero3"], out["bf16-mixed/ddp"], rtol=1e-2, atol=0)
    torch.testing.assert_close(out["bf16-true/zero2"], out["bf16-true/ddp"], rtol=1e-2, atol=0)
    torch.testing.assert_close(out["bf16-true/zero3"], out["bf16-true/ddp"], rtol=1e-2, atol=0)
    assert out["scaler"] == "ShardedGradScaler"
    for name in ("16-mixed/zero1", "example_main"):
        assert all(torch.isfinite(torch.tensor(out[name]))), name
        assert out[name][-1] < out[name][0], name


def test_options_and_errors_match_the_trainer_strategies() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    for name in ("zero1", "zero2", "zero3", "zero3_spawn", "zero2_full_checkpoint"):
        assert name in STRATEGY_REGISTRY
    assert isinstance(Fabric(strategy="zero3", accelerator="cpu", devices=2).strategy, ZeRO3Strategy)
    assert Fabric(strategy="zero1_full_checkpoint", accelerator="cpu").strategy.checkpoint_format == "full"
    with pytest.raises(TypeError, match="did you mean 'bucket_size_mb'"):
        ZeRO2Strategy(bucket_sise_mb=2)
    with pytest.raises(ValueError, match="apply to stage 3"):
        ZeRO1Strategy(prefetch=2)
    with pytest.raises(ValueError, match="checkpoint_format"):
        ZeRO3Strategy(checkpoint_format="zip")
    assert ZeRO2Strategy().bucket_size_mb == 25.0 and ZeRO3Strategy().meta_init


def _trainer_and_fabric(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A Trainer's checkpoints (sharded and full) resumed by Fabric, and Fabric's loaded by a Trainer, for the same
    LightningModule (Fabric sets it up as a plain module: the parameter names match)."""
    _example()
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset
    from train_gpt import GPTConfig, GPTLightning

    from tests.models import quiet_trainer

    config = GPTConfig(vocab_size=32, n_layer=2, n_head=2, n_embd=16, block_size=8)
    tokens = torch.randint(0, 32, (16, 9), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    torch.manual_seed(0)
    trained = GPTLightning(config, max_steps=2)
    every_step = ModelCheckpoint(dirpath=root, filename="trainer", every_n_train_steps=2)
    trainer = quiet_trainer(
        strategy="zero3", devices=world_size, max_steps=2, callbacks=[every_step], enable_checkpointing=True
    )
    trainer.fit(trained, data)  # a sharded checkpoint at step 2
    trainer.save_checkpoint(f"{root}/trainer-full.ckpt")  # after fit, the full (released) model: one file
    saved_model = {k: v.clone() for k, v in trained.state_dict().items()}
    saved_optimizer = trainer.optimizers[0].state_dict()  # full, per-parameter: the strategy released the shards

    out: dict[str, Any] = {}
    for source in ("trainer.ckpt", "trainer-full.ckpt"):
        fabric = _fabric("zero1", world_size)
        module = GPTLightning(config, max_steps=2)
        with fabric.init_module():
            module.configure_model()
        model = fabric.setup_module(module)
        optimizer = fabric.setup_optimizers(module.configure_optimizers()["optimizer"])
        rest = fabric.load(f"{root}/{source}", {"model": model, "optimizer": optimizer})
        loaded = optimizer.state_dict()["state"]
        out[source] = {
            "model": all(torch.equal(v, saved_model[k]) for k, v in model.state_dict().items()),
            "optimizer": all(
                torch.equal(loaded[i][key], value)
                for i, entry in saved_optimizer["state"].items()
                for key, value in entry.items()
            ),
            "global_step": rest["global_step"],
        }
        if source == "trainer.ckpt":
            fabric.save(f"{root}/fabric", {"model": model, "optimizer": optimizer})
        fabric.strategy.teardown()

    validated = GPTLightning(config, max_steps=2)
    trainer = quiet_trainer(strategy="zero2", devices=world_size)
    trainer.validate(validated, data, ckpt_path=f"{root}/fabric")
    out["fabric->trainer"] = all(torch.equal(v, saved_model[k]) for k, v in validated.state_dict().items())
    return out


def test_checkpoints_move_between_trainer_and_fabric(tmp_path: Path) -> None:
    out = spawn(_trainer_and_fabric, world_size=2, root=str(tmp_path))[0]
    expected = {"model": True, "optimizer": True, "global_step": 2}
    assert out == {"trainer.ckpt": expected, "trainer-full.ckpt": expected, "fabric->trainer": True}


def _optimizer_made_before_setup(rank: int, world_size: int) -> dict[str, dict[str, torch.Tensor]]:
    results = {}
    for strategy in ("ddp", "zero3"):
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
        fabric.launch()
        torch.manual_seed(0)
        with fabric.init_module():  # under zero3: on the meta device, materialized sharded at setup
            model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # over the parameters before setup
        model, optimizer = fabric.setup(model, optimizer)
        assert all(a is b for a, b in zip(params, model.parameters())), strategy  # the same objects, now real
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            fabric.backward(model(x).square().mean())
            optimizer.step()
            optimizer.zero_grad()
        results[strategy] = {k: v.clone() for k, v in model.state_dict().items()}
        # A parameter read between steps, on every rank: under zero3 gathered for the read, DDP's values.
        results[strategy]["<read>"] = params[0].detach().clone()
    return results


def test_an_optimizer_made_before_setup_over_init_module_parameters_trains_as_ddp() -> None:
    """``fabric.init_module()`` under zero3 builds on meta; the parameters keep their identity when they are made
    real at setup, so an optimizer built over them before ``fabric.setup`` trains them, bitwise as under DDP."""
    for result in spawn(_optimizer_made_before_setup, world_size=2, timeout=300):
        assert all(torch.equal(result["ddp"][k], v) for k, v in result["zero3"].items())


def _reads_between_steps(rank: int, world_size: int) -> dict[str, Any]:
    """A Fabric loop that reads every weight right after ``optimizer.step()`` (as code logging or saving weights
    does), and on rank 0 alone one weight's norm: stages 1 and 2 leave the post-step all-gather in flight, and
    those reads must wait for it and see DDP's values (see [Note: parameters whose values are on their way])."""
    example = _example()
    args = example.LoopArgs(steps=3, micro_batches=1, max_norm=None)
    vocab_size, tokens = example.corpus_tokens()
    results: dict[str, Any] = {}
    for strategy in ("ddp", "zero1", "zero2"):
        fabric = _fabric(strategy, world_size)
        state = example.setup(fabric, args, vocab_size)
        model, optimizer = state["model"], state["optimizer"]
        data = example.batches(args, fabric, vocab_size, tokens)
        sums, in_flight, norms = [], [], []
        for step in range(args.steps):
            chunk = fabric.to_device(data[step])
            logits = model(chunk[:, :-1])
            fabric.backward(nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten()))
            optimizer.step()
            if strategy != "ddp":
                in_flight.append(all(u.arriving for u in fabric.strategy.sharded_model.units))
            if rank == 0:  # on one rank only: local, no collective to pair with
                norms.append(float(next(model.parameters()).detach().norm()))
            sums.append([float(v.double().sum()) for v in model.state_dict().values()])
            optimizer.zero_grad()
        results[strategy] = {"sums": sums, "in_flight": in_flight, "norms": norms}
        fabric.strategy.teardown()
    return results


def test_reads_right_after_the_optimizer_step_wait_for_the_gathered_weights() -> None:
    for rank, results in enumerate(spawn(_reads_between_steps, world_size=2)):
        for strategy in ("zero1", "zero2"):
            assert results[strategy]["in_flight"] == [True] * 3, (rank, strategy)
            assert results[strategy]["sums"] == results["ddp"]["sums"], (rank, strategy)
            assert results[strategy]["norms"] == results["ddp"]["norms"], (rank, strategy)
