"""What loading a pretrained model costs each rank: bytes read from disk and memory during setup, under DDP
(transformers' ``from_pretrained`` on every rank) and under stage 3 (``lightning_zero.from_pretrained``, each rank
reading its shards), side by side (see "Pretrained weights" in docs/memory.md).

    python -m benchmarks.pretrained_reads --out benchmarks/results/pretrained_reads.json

The model is a Llama of about 150M parameters (``--hidden 768 --layers 12``, vocabulary 32000, fp32), saved once
with ``save_pretrained`` (safetensors) into ``--dir``. Each system runs ``trainer.fit`` for one step of a
``LightningModule`` that loads the model in ``configure_model``; the figures are read at ``on_fit_start`` (setup
done). Before each system the page cache is dropped (``/proc/sys/vm/drop_caches``, which needs root; without it
``read_bytes`` counts only what was not cached, and the JSON says so), so ``read_bytes`` of ``/proc/self/io`` is
what the rank read from disk. Linux only.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch

import lightning_zero
from benchmarks.results import report_json
from benchmarks.trainer_mode import BARE_TRAINER
from lightning_zero.tools.processes import run_on_cpu_ranks

MIB = 2**20


def _status() -> dict[str, float]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmHWM", "RssAnon", "RssFile")}


def _read_bytes() -> int:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"])


class Load(L.LightningModule):
    def __init__(self, path: str, sharded: bool) -> None:
        super().__init__()
        self.path, self.sharded = path, sharded
        self.reading: dict[str, float] = {}

    def configure_model(self) -> None:
        from transformers import AutoModelForCausalLM

        self.before = (_read_bytes(), _status())
        Path("/proc/self/clear_refs").write_text("5")  # the peak from here on is the setup's
        if self.sharded:
            self.model = lightning_zero.from_pretrained(AutoModelForCausalLM, self.path)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(self.path)

    def on_fit_start(self) -> None:
        read, status = _read_bytes() - self.before[0], _status()
        self.reading = {
            "read_mib": read / MIB,
            "setup_peak_mib": status["VmHWM"],
            "anon_mib": status["RssAnon"] - self.before[1]["RssAnon"],
            "file_mib": status["RssFile"] - self.before[1]["RssFile"],
        }

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0]).logits.float().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(2, 8, dtype=torch.long)))


def _measure(rank: int, world_size: int, strategy: str, path: str) -> dict[str, float]:
    module = Load(path, sharded=strategy != "ddp")
    L.Trainer(strategy=strategy, devices=world_size, max_steps=1, **BARE_TRAINER).fit(module)
    return module.reading


def _save(path: Path, hidden: int, layers: int) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        intermediate_size=hidden * 8 // 3,
        vocab_size=32000,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if not (path / "model.safetensors").exists():
        model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _drop_page_cache() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1")
    except OSError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/lightning_zero_pretrained_bench"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    params = _save(args.dir, args.hidden, args.layers)
    file_mib = sum(f.stat().st_size for f in args.dir.glob("*.safetensors")) / MIB
    result: dict[str, Any] = {"parameters": params, "file_mib": file_mib, "ranks": args.ranks, "systems": {}}
    for strategy in ("ddp", "zero3"):
        dropped = _drop_page_cache()
        ranks = run_on_cpu_ranks(_measure, args.ranks, timeout=1800, strategy=strategy, path=str(args.dir))
        result["systems"][strategy] = {"page_cache_dropped": dropped, "ranks": ranks}
    report_json(result, args.out)


if __name__ == "__main__":
    main()
