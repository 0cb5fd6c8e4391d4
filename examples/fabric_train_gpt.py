"""Train the small character-level GPT of ``train_gpt.py`` with Lightning Fabric: your own loop, ZeRO underneath.

The loop is the one LitGPT-style scripts write: ``fabric.launch()``, the model built under
``fabric.init_module()`` (stage 3 creates it already sharded), ``fabric.setup``, micro-batches under
``fabric.no_backward_sync``, ``fabric.clip_gradients``, a warm-up + cosine schedule, and
``fabric.save`` / ``fabric.load`` to resume:

    python examples/fabric_train_gpt.py                         # ZeRO-3 on 2 CPU processes
    python examples/fabric_train_gpt.py --strategy ddp          # the baseline to compare with
    python examples/fabric_train_gpt.py --strategy zero2 --accelerator gpu --devices 4 --precision bf16-mixed
    python examples/fabric_train_gpt.py --resume runs/fabric/ckpt   # continue a saved run

``train(fabric, args)`` is the whole loop; the tests run it under Fabric's ``DDPStrategy`` and each stage
and compare losses and parameters step by step.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

sys.path.insert(0, str(Path(__file__).parent))  # the model and data of train_gpt.py, next to this file
from train_gpt import GPT, CharTokenizer, GPTConfig

import lightning_zero  # noqa: F401  registers "zero1", "zero2" and "zero3" with Fabric

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


@dataclass
class LoopArgs:
    steps: int = 30
    micro_batches: int = 2  # gradient accumulation
    batch_size: int = 8
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup: int = 5
    max_norm: float | None = 1.0  # clip by norm (None: no clipping by norm)
    clip_val: float | None = None  # clip by value
    save_at: int | None = None  # save a checkpoint after this many steps
    checkpoint: str | None = None
    resume: str | None = None
    seed: int = 0
    model: dict[str, Any] = field(default_factory=lambda: {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32})


def corpus_tokens() -> tuple[int, torch.Tensor]:
    """The vocabulary size and the training tokens of ``train_gpt.py``'s corpus (its first 90%: the rest is
    validation there)."""
    text = CORPUS.read_text()
    tokenizer = CharTokenizer(text)
    return tokenizer.vocab_size, tokenizer.encode(text[: int(0.9 * len(text))])


def batches(args: LoopArgs, fabric: Fabric, vocab_size: int, tokens: torch.Tensor | None = None) -> list[torch.Tensor]:
    """This rank's micro-batches for every step: blocks of the corpus (or random tokens), each rank its own."""
    block = args.model["block_size"]
    gen = torch.Generator().manual_seed(args.seed * 1000 + fabric.global_rank)
    count = args.steps * args.micro_batches
    if tokens is None:
        return list(torch.randint(0, vocab_size, (count, args.batch_size, block + 1), generator=gen))
    offsets = torch.randint(0, len(tokens) - block - 1, (count, args.batch_size), generator=gen)
    return [torch.stack([tokens[o : o + block + 1] for o in row.tolist()]) for row in offsets]


def setup(fabric: Fabric, args: LoopArgs, vocab_size: int) -> dict[str, Any]:
    """The model, optimizer and scheduler, set up with ``fabric``: the state that ``fabric.save`` writes."""
    fabric.seed_everything(args.seed)
    with fabric.init_module():
        model = GPT(GPTConfig(vocab_size=vocab_size, **args.model))
    model = fabric.setup_module(model)
    # Two param groups as in nanoGPT: weight decay on matrices only (taken after setup, which creates a model
    # built on the meta device).
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr
    )
    optimizer = fabric.setup_optimizers(optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * s / args.steps))
    )
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}


def train(fabric: Fabric, args: LoopArgs, vocab_size: int = 64, tokens: torch.Tensor | None = None) -> dict[str, Any]:
    """The training loop; returns the losses of every step and the final full state dict (on every rank)."""
    state = setup(fabric, args, vocab_size)
    model, optimizer, scheduler = state["model"], state["optimizer"], state["scheduler"]
    if args.resume:
        fabric.load(args.resume, state)
    data = batches(args, fabric, vocab_size, tokens)
    losses: list[float] = []
    while state["step"] < args.steps:
        step = state["step"]
        total = 0.0
        for micro in range(args.micro_batches):
            chunk = fabric.to_device(data[step * args.micro_batches + micro])
            last = micro == args.micro_batches - 1
            with fabric.no_backward_sync(model, enabled=not last):
                logits = model(chunk[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten()) / args.micro_batches
                fabric.backward(loss)
            total += loss.item()
        if args.max_norm is not None:
            fabric.clip_gradients(model, optimizer, max_norm=args.max_norm)
        if args.clip_val is not None:
            fabric.clip_gradients(model, optimizer, clip_val=args.clip_val)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state["step"] += 1
        losses.append(total)
        if args.save_at is not None and state["step"] == args.save_at:
            fabric.save(args.checkpoint, state)
    return {"losses": losses, "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-at", type=int, default=None)
    parser.add_argument("--checkpoint", default="runs/fabric/ckpt")
    parser.add_argument("--resume", default=None)
    cli = parser.parse_args(argv)
    fabric = Fabric(strategy=cli.strategy, accelerator=cli.accelerator, devices=cli.devices, precision=cli.precision)
    fabric.launch()
    vocab_size, train_tokens = corpus_tokens()
    args = LoopArgs(steps=cli.steps, save_at=cli.save_at, checkpoint=cli.checkpoint, resume=cli.resume)
    result = train(fabric, args, vocab_size, train_tokens)
    fabric.print(f"loss: first {result['losses'][0]:.4f}, last {result['losses'][-1]:.4f}")
    return result


if __name__ == "__main__":
    main()
