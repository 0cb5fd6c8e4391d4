"""Fine-tune a pretrained GPT under ZeRO: model built in ``configure_model``, pretrained weights
streamed into the shards when fitting starts, the embeddings and lower blocks frozen, the rest
trained on a new slice of text.

    python examples/train_gpt.py --checkpoint --output runs/pretrain
    # ... prints "checkpoint:      runs/pretrain/checkpoints/final.ckpt"
    python examples/finetune_gpt.py --pretrained runs/pretrain/checkpoints/final.ckpt --freeze-layers 2

``--pretrained`` takes a full Lightning ``.ckpt`` (what the ZeRO strategies and ``DDPStrategy`` write by
default, or ``python -m lightning_zero consolidate`` makes of a sharded checkpoint directory), a
``.safetensors`` file, or a plain ``torch.save``-d state dict of the GPT. The model flags
(``--n-layer``, ``--n-embd``, ``--block-size``, ...) must match the pretrained model's; both scripts
have the same defaults. Without ``--pretrained`` the run starts from a random init, which is still a
valid (if pointless) demonstration of freezing under sharding.

Frozen parameters get neither gradients nor optimizer state under every ZeRO stage, so freezing
most of a large model is also how to fine-tune it in little memory.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the GPT and its data live in train_gpt.py

from train_gpt import DEFAULT_DATA, CharTokenizer, GPTConfig, GPTLightning, build_datasets

import lightning_zero  # noqa: F401  registers "zero1"/"zero2"/"zero3"


def load_pretrained(path: Path) -> dict[str, torch.Tensor]:
    """The GPT's own state dict from a Lightning checkpoint, a .safetensors file or a plain state dict."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        state = state.get("state_dict", state)
    # A LightningModule's keys start with the attribute that holds the GPT ("model.").
    return {k.removeprefix("model."): v for k, v in state.items()}


class FineTuneGPT(GPTLightning):
    """``GPTLightning`` that freezes the lower layers in ``configure_model`` and loads the pretrained weights
    when fitting starts.

    Under stage 3 ``configure_model`` creates the model on the meta device (``meta_init``), already
    sharded at setup, so no rank ever holds all of it. The weights are loaded afterwards, in
    ``on_fit_start``: ``load_state_dict`` then streams them into the shards one unit at a time (loaded in
    ``configure_model`` they would be replayed at setup too, but the whole dict would wait in memory until
    then). The same code runs unchanged under DDP.
    """

    def __init__(self, config: GPTConfig, pretrained: Path | None, freeze_layers: int, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.pretrained = pretrained
        self.freeze_layers = freeze_layers

    def configure_model(self) -> None:
        if self.model is not None:
            return
        super().configure_model()
        assert self.model is not None
        # Freeze before the strategy sets up: ZeRO fixes the trainable set at setup.
        frozen = [self.model.wte, self.model.wpe]  # wte is tied to lm_head: both stay fixed
        frozen += list(self.model.h[: self.freeze_layers])
        for module in frozen:
            module.requires_grad_(False)

    def on_fit_start(self) -> None:
        if self.pretrained is not None:
            assert self.model is not None
            self.model.load_state_dict(load_pretrained(self.pretrained))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pretrained", type=Path, default=None, help=".ckpt, .safetensors or state-dict file")
    p.add_argument("--freeze-layers", type=int, default=2, help="freeze the embeddings and this many blocks")
    p.add_argument("--strategy", default="zero3")
    p.add_argument("--devices", default="2")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--output", type=Path, default=Path("runs/finetune_gpt"))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """Fine-tune, then on rank 0 print and return a summary (other ranks return None)."""
    args = parse_args(argv)
    L.seed_everything(args.seed, verbose=False)
    text = args.data.read_text(encoding="utf-8")
    tokenizer = CharTokenizer(text)
    # Fine-tune on the second half of the corpus: different text from what the first half taught.
    train_set, val_set = build_datasets(text[len(text) // 2 :], tokenizer, args.block_size, args.seed + 1)
    config = GPTConfig(
        block_size=args.block_size,
        vocab_size=tokenizer.vocab_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )
    module = FineTuneGPT(
        config, args.pretrained, args.freeze_layers, lr=args.lr, warmup_steps=0, max_steps=args.max_steps
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        max_steps=args.max_steps,
        val_check_interval=min(20, args.max_steps),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        default_root_dir=args.output,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    trainer.fit(module, train_dataloaders=train_loader, val_dataloaders=DataLoader(val_set, batch_size=args.batch_size))
    if not trainer.is_global_zero:
        return None
    assert module.model is not None
    trainable = sum(p.numel() for p in module.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in module.model.parameters())
    val_loss = float(trainer.callback_metrics["val_loss"])
    print(f"fine-tuned {trainable:,} of {total:,} parameters ({args.strategy}); val_loss {val_loss:.4f}")
    return {"val_loss": val_loss, "trainable": trainable, "total": total, "state": module.model.state_dict()}


if __name__ == "__main__":
    main()
