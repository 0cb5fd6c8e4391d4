"""The examples run for real (tiny settings) and agree with DDP."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.distributed import spawn

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "8"]


def load_example(name: str) -> Any:
    """Import ``examples/<name>.py`` as a module (examples are scripts, not a package)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it is executing
    spec.loader.exec_module(module)
    return module


def _finetune(rank: int, world_size: int, root: str) -> dict[str, Any] | None:
    example = load_example("finetune_gpt")
    train_gpt = sys.modules["train_gpt"]
    pretrained = Path(root, "pretrained.pt")
    if rank == 0:
        text = train_gpt.DEFAULT_DATA.read_text(encoding="utf-8")
        config = train_gpt.GPTConfig(
            block_size=16, vocab_size=train_gpt.CharTokenizer(text).vocab_size, n_layer=2, n_head=2, n_embd=32
        )
        torch.manual_seed(7)
        torch.save(train_gpt.GPT(config).state_dict(), pretrained)
    dist.barrier()
    common = [*TINY, "--max-steps", "6", "--freeze-layers", "1", "--pretrained", str(pretrained)]
    common += ["--devices", str(world_size)]
    runs = {s: example.main([*common, "--strategy", s, "--output", f"{root}/{s}"]) for s in ("ddp", "zero3")}
    if rank != 0:
        return None
    initial = torch.load(pretrained, weights_only=True)
    ddp, zero3 = runs["ddp"], runs["zero3"]
    assert zero3["val_loss"] == ddp["val_loss"]
    assert zero3["trainable"] < zero3["total"]
    for key, value in ddp["state"].items():
        assert torch.equal(zero3["state"][key], value), key
        frozen = key.startswith(("wte.", "wpe.", "lm_head.", "h.0."))
        assert torch.equal(value, initial[key]) == frozen, key  # frozen stay put, the rest trained
    return {"val_loss": zero3["val_loss"]}


def test_finetune_example_freezes_under_zero3_like_ddp() -> None:
    with tempfile.TemporaryDirectory() as root:
        results = spawn(_finetune, world_size=2, root=root)
    assert results[0]["val_loss"] > 0


def _train_gpt(rank: int, world_size: int, output: str) -> dict[str, dict[str, Any] | None]:
    example = load_example("train_gpt")
    args = [
        *TINY,
        "--max-steps",
        "8",
        "--val-check-interval",
        "4",
        "--sample-chars",
        "20",
        "--devices",
        str(world_size),
    ]
    return {s: example.main([*args, "--strategy", s, "--output", f"{output}/{s}"]) for s in ("ddp", "zero3")}


def test_train_gpt_example_runs_and_matches_ddp() -> None:
    with tempfile.TemporaryDirectory() as output:
        summaries = spawn(_train_gpt, world_size=2, output=output)
    ddp, zero3 = summaries[0]["ddp"], summaries[0]["zero3"]
    assert summaries[1] == {"ddp": None, "zero3": None}
    assert zero3["steps"] == 8
    assert zero3["train_loss"] < zero3["first_train_loss"]
    for key in ("first_train_loss", "train_loss", "val_loss", "sample"):
        assert zero3[key] == ddp[key], key


def _pretrain_then_finetune(rank: int, world_size: int, root: str) -> str | None:
    """``train_gpt.py --checkpoint`` under zero3 prints where it saved; ``finetune_gpt.py --pretrained`` takes
    that path as printed (the two commands of finetune_gpt.py's docstring)."""
    train_gpt = load_example("train_gpt")
    printed = io.StringIO()
    args = [*TINY, "--max-steps", "4", "--val-check-interval", "4", "--sample-chars", "5", "--devices", str(world_size)]
    with contextlib.redirect_stdout(printed):
        summary = train_gpt.main([*args, "--strategy", "zero3", "--checkpoint", "--output", f"{root}/pretrain"])
    path = f"{root}/pretrain/checkpoints/final.ckpt"
    if rank == 0:
        assert summary is not None and summary["checkpoint"] == path
        assert f"checkpoint:      {path}\n" in printed.getvalue(), printed.getvalue()[-500:]
    finetune = load_example("finetune_gpt")
    common = [*TINY, "--max-steps", "2", "--freeze-layers", "1", "--devices", str(world_size), "--strategy", "zero3"]
    result = finetune.main([*common, "--pretrained", path, "--output", f"{root}/finetune"])
    if rank != 0:
        return None
    pretrained = torch.load(path, weights_only=True)["state_dict"]
    assert result is not None and all(
        torch.equal(result["state"][key], pretrained[f"model.{key}"])
        for key in result["state"]
        if key.startswith(("wte.", "wpe.", "h.0."))  # frozen: still the pretrained weights
    )
    return path


def test_train_gpt_says_where_it_saved_and_finetune_and_load_from_checkpoint_read_it() -> None:
    with tempfile.TemporaryDirectory() as root:
        path = spawn(_pretrain_then_finetune, world_size=2, root=root)[0]
        code = (
            "import sys, torch; sys.path.insert(0, sys.argv[1]); from train_gpt import GPTLightning; "
            "module = GPTLightning.load_from_checkpoint(sys.argv[2]); "
            "saved = torch.load(sys.argv[2], weights_only=True)['state_dict']; "
            "assert all(torch.equal(v, saved[k]) for k, v in module.state_dict().items()); print(len(saved))"
        )
        fresh = subprocess.run(
            [sys.executable, "-c", code, str(EXAMPLES), path], capture_output=True, text=True, timeout=120
        )
    assert fresh.returncode == 0 and int(fresh.stdout) > 0, fresh.stderr[-3000:]
