"""LitGPT's own CLI scripts under ZeRO stage 3 and under DDP, with only the strategy replaced.

``litgpt finetune_full``, ``litgpt finetune_lora`` and ``litgpt pretrain`` run as their users run them: LitGPT's
command line, its data modules, its checkpoint layout, its ``generate`` and ``merge_lora`` on what they saved. The
one change is the line of each script that builds its strategy (``FSDPStrategy(...)`` in ``finetune/full.py`` and
``pretrain.py``, ``ModelParallelStrategy(...)`` in ``finetune/lora.py``), which here builds Fabric's
``ZeRO3Strategy(checkpoint_format="full")`` or Lightning's ``DDPStrategy()`` instead, as a user would edit it.
The model is a tiny Llama-shaped LitGPT checkpoint (``lit_model.pth``, ``model_config.yaml``, a word-level
``tokenizer.json``) written into the work directory, on 2 CPU processes; everything else is LitGPT's defaults
except what a 2-core machine needs (few steps, 32-bit precision so the losses compare exactly).

Usage::

    python -m benchmarks.litgpt_cli --out /tmp/litgpt_cli           # every script, both strategies: JSON report
    python -m benchmarks.litgpt_cli --runs 30 --script finetune_full  # back-to-back runs: every exit status

The report gives, per script, the training losses LitGPT logged under each strategy, their largest relative
difference, and whether ``litgpt generate`` (and ``merge_lora``) read the zero3 output and printed the DDP run's
tokens.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from litgpt.data import DataModule

SCRIPTS = ("finetune_full", "finetune_lora", "pretrain")
# Set for a LitGPT run: its processes (Lightning's launcher starts the others with this command line) build it.
STRATEGY_VARIABLE = "LIGHTNING_ZERO_LITGPT_STRATEGY"
WORDS = [f"w{i}" for i in range(60)]


def write_checkpoint(directory: Path) -> None:
    """A tiny LitGPT checkpoint directory, as ``litgpt convert_to_litgpt`` leaves one: weights, config, tokenizer."""
    import torch
    import yaml
    from litgpt import GPT, Config
    from litgpt.utils import save_config
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": True,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    config = Config(
        name="tiny-llama",
        block_size=64,
        vocab_size=len(vocab),
        padded_vocab_size=64,
        n_layer=2,
        n_head=4,
        n_query_groups=2,
        n_embd=32,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=64,
    )
    torch.manual_seed(0)
    torch.save(GPT(config).state_dict(), directory / "lit_model.pth")
    save_config(config, directory)
    # ``litgpt pretrain --config pretrain.yaml``: the same architecture, from scratch.
    model_config = yaml.safe_load((directory / "model_config.yaml").read_text())
    pretrain = {"model_name": "tiny-llama", "model_config": model_config}
    (directory.parent / "pretrain.yaml").write_text(yaml.safe_dump(pretrain))


def write_data(directory: Path) -> Path:
    """An instruction dataset in LitGPT's JSON layout (``--data JSON``)."""
    import random

    rng = random.Random(0)
    rows = [
        {
            "instruction": " ".join(rng.choices(WORDS, k=4)),
            "input": "",
            "output": " ".join(rng.choices(WORDS, k=rng.randint(2, 6))),
        }
        for _ in range(24)
    ]
    path = directory / "data.json"
    path.write_text(json.dumps(rows))
    return path


@dataclass
class TokenStream(DataModule):
    """A pretraining data module in LitGPT's shape (``connect``, ``setup``, ``train_dataloader``): fixed random
    token windows, so a run needs neither the network nor litdata (``--data benchmarks.litgpt_cli.TokenStream``)."""

    windows: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        super().__init__()
        self.batch_size, self.seq_length = 1, 16

    def connect(self, tokenizer: Any = None, batch_size: int = 1, max_seq_length: int | None = -1) -> None:
        self.batch_size, self.seq_length = batch_size, max_seq_length or 16

    def setup(self, stage: str = "") -> None:
        import torch

        generator = torch.Generator().manual_seed(self.seed)
        self.data = torch.randint(3, 63, (self.windows, self.seq_length + 1), generator=generator)

    def train_dataloader(self) -> Any:
        from torch.utils.data import DataLoader

        return DataLoader(self.data, batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> Any:
        from torch.utils.data import DataLoader

        return DataLoader(self.data[:8], batch_size=self.batch_size, shuffle=False)


def _arguments(script: str, work: Path, out: Path) -> list[str]:
    common = ["--devices", "2", "--precision", "32-true", "--out_dir", str(out), "--logger_name", "csv"]
    if script == "pretrain":
        return [
            "pretrain",
            "--config",
            str(work / "pretrain.yaml"),
            "--tokenizer_dir",
            str(work / "checkpoint"),
            "--data",
            "benchmarks.litgpt_cli.TokenStream",
            "--train.max_tokens",
            "1024",
            "--train.global_batch_size",
            "4",
            "--train.micro_batch_size",
            "1",
            "--train.max_seq_length",
            "16",
            "--train.save_interval",
            "4",
            "--train.lr_warmup_steps",
            "1",
            "--eval.interval",
            "4",
            "--eval.max_iters",
            "2",
            *common,
        ]
    return [
        script,
        str(work / "checkpoint"),
        "--data",
        "JSON",
        "--data.json_path",
        str(work / "data.json"),
        "--data.val_split_fraction",
        "0.25",
        "--train.epochs",
        "1",
        "--train.global_batch_size",
        "4",
        "--train.micro_batch_size",
        "1",
        "--train.lr_warmup_steps",
        "1",
        "--train.save_interval",
        "4",
        "--eval.interval",
        "4",
        "--eval.max_iters",
        "2",
        "--eval.max_new_tokens",
        "4",
        *common,
    ]


def run_script(script: str, strategy: str, work: Path, tag: str = "") -> dict[str, Any]:
    """One LitGPT CLI run on 2 processes; its exit status, output tail and logged losses."""
    out = work / f"{script}-{strategy}{tag}"
    command = [sys.executable, "-m", "benchmarks.litgpt_cli", *_arguments(script, work, out)]
    path = os.pathsep.join([str(Path(__file__).resolve().parents[1]), *sys.path])
    env = {**os.environ, "PYTHONPATH": path, STRATEGY_VARIABLE: strategy}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=work, timeout=900)
    return {
        "returncode": result.returncode,
        "tail": (result.stdout + result.stderr)[-3000:],
        "terminate": "terminate called" in result.stderr,
        "losses": _losses(out),
        "out": str(out),
    }


def _losses(out: Path) -> list[float]:
    files = sorted(out.glob("logs/**/metrics.csv"))
    if not files:
        return []
    with files[-1].open() as handle:
        rows = list(csv.DictReader(handle))
    return [float(row["loss"]) for row in rows if row.get("loss")]


def generate(checkpoint: Path, work: Path) -> dict[str, Any]:
    """``litgpt generate`` on a saved ``final`` directory: its exit status and the text it printed."""
    command = ["litgpt", "generate", str(checkpoint), "--prompt", "w1 w2 w3", "--max_new_tokens", "6"]
    command += ["--precision", "32-true", "--top_k", "1"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=work, timeout=600)
    text = result.stdout.strip().splitlines()  # LitGPT prints its arguments first, the generated text last
    return {"returncode": result.returncode, "text": text[-1] if text else "", "tail": result.stderr[-1500:]}


def weight_difference(a: Path, b: Path) -> float | None:
    """The largest absolute difference between the tensors of two saved ``lit_model.pth`` files (LitGPT's layout:
    the weights under ``model``); None if they do not hold the same names."""
    import torch

    first, second = (torch.load(p, weights_only=False) for p in (a, b))  # files this run wrote
    first, second = (d.get("model", d) for d in (first, second))
    if first.keys() != second.keys():
        return None
    return max(float((first[k].double() - second[k].double()).abs().max()) for k in first)


def merge_lora(checkpoint: Path, work: Path) -> dict[str, Any]:
    result = subprocess.run(["litgpt", "merge_lora", str(checkpoint)], capture_output=True, text=True, cwd=work)
    return {"returncode": result.returncode, "tail": result.stderr[-1500:]}


def _relative(a: list[float], b: list[float]) -> float | None:
    if not a or len(a) != len(b):
        return None
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def compare(script: str, work: Path) -> dict[str, Any]:
    runs = {strategy: run_script(script, strategy, work) for strategy in ("ddp", "zero3")}
    report: dict[str, Any] = {
        strategy: {k: v for k, v in run.items() if k != "tail" or run["returncode"] != 0}
        for strategy, run in runs.items()
    }
    report["max_relative_loss_difference"] = _relative(runs["zero3"]["losses"], runs["ddp"]["losses"])
    if all(run["returncode"] == 0 for run in runs.values()):
        finals = {strategy: Path(run["out"]) / "final" for strategy, run in runs.items()}
        if script == "finetune_lora":
            report["merge_lora"] = {s: merge_lora(f, work)["returncode"] for s, f in finals.items()}
        report["max_weight_difference"] = weight_difference(*(f / "lit_model.pth" for f in finals.values()))
        generated = {s: generate(f, work) for s, f in finals.items()}
        report["generate"] = {s: g if g["returncode"] else g["text"] for s, g in generated.items()}
        report["same_tokens"] = generated["ddp"]["text"] == generated["zero3"]["text"] != ""
    return report


def launch(strategy: str) -> None:
    """LitGPT's CLI with the strategy line of its scripts building ``strategy`` instead (what a user edits)."""
    import litgpt.finetune.full
    import litgpt.finetune.lora
    import litgpt.pretrain
    from lightning.fabric.strategies import DDPStrategy
    from litgpt.__main__ import main

    from lightning_zero.fabric import ZeRO3Strategy

    class Replacement:
        """Stands for the class the script names; builds the chosen strategy (and is never an instance's type, so
        LitGPT's ``isinstance(fabric.strategy, FSDPStrategy)`` branches take the non-FSDP path, as under DDP)."""

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            return ZeRO3Strategy(checkpoint_format="full") if strategy == "zero3" else DDPStrategy()

    litgpt.finetune.full.FSDPStrategy = Replacement
    litgpt.pretrain.FSDPStrategy = Replacement
    litgpt.finetune.lora.ModelParallelStrategy = Replacement
    main()  # LitGPT's, on this command line


def main() -> None:
    if STRATEGY_VARIABLE in os.environ:
        launch(os.environ[STRATEGY_VARIABLE])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/litgpt_cli"))
    parser.add_argument("--script", choices=SCRIPTS, action="append")
    parser.add_argument("--runs", type=int, default=0, help="back-to-back zero3 runs of each script: exit statuses")
    args = parser.parse_args()
    work = args.out.resolve()
    write_checkpoint(work / "checkpoint")
    write_data(work)
    scripts = args.script or list(SCRIPTS)
    if args.runs:
        report = {
            script: [
                {k: run[k] for k in ("returncode", "terminate")}
                for run in (run_script(script, "zero3", work, tag=f"-{i}") for i in range(args.runs))
            ]
            for script in scripts
        }
    else:
        report = {script: compare(script, work) for script in scripts}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
