"""Train a small character-level GPT with Lightning, on any strategy, ZeRO included.

This is the job the README's quick start runs. The defaults finish in a minute or
two on a 2-core CPU with 2 processes, which is enough for the loss to fall clearly:

    python examples/train_gpt.py                      # ZeRO-3 on 2 CPU processes
    python examples/train_gpt.py --strategy ddp       # the baseline to compare with
    python examples/train_gpt.py --strategy zero2 --accelerator gpu --devices 4

The model follows the shape of GPT-2 (learned position embeddings, pre-LayerNorm
blocks, GELU MLP) at toy size. Its output projection shares its weight with the
token embedding on purpose: tied weights are the case a sharding strategy most
easily gets wrong, so the example keeps them in the path of every run.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_zero import ZeROStrategy  # importing lightning_zero registers "zero1"/"zero2"/"zero3"

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "corpus.txt"


# --------------------------------------------------------------------------- model


@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True


class GPTLinear(nn.Linear):
    """``nn.Linear`` with GPT-2's init, N(0, std) weights and zero bias, in ``reset_parameters``, where torch's
    own layers keep theirs (stage 3 creates the model directly sharded whichever way it is initialized)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, std: float = 0.02) -> None:
        self.std = std
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class GPTEmbedding(nn.Embedding):
    """``nn.Embedding`` with GPT-2's N(0, 0.02) init."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


def residual_std(config: GPTConfig) -> float:
    # GPT-2's scaled init: each block adds to the residual stream twice, so shrink the projections
    # that write into it to keep the stream's variance flat with depth.
    return 0.02 / math.sqrt(2 * config.n_layer)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"n_embd ({config.n_embd}) must be divisible by n_head ({config.n_head})")
        self.n_head = config.n_head
        # One fused projection for q, k and v: fewer, larger matmuls, and fewer parameters to shard.
        self.c_attn = GPTLinear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = GPTLinear(config.n_embd, config.n_embd, bias=config.bias, std=residual_std(config))
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim), the layout scaled_dot_product_attention expects.
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = GPTLinear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = GPTLinear(4 * config.n_embd, config.n_embd, bias=config.bias, std=residual_std(config))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Pre-LN residual blocks train stably without a warmup-sensitive post-LN stack.
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = GPTEmbedding(config.vocab_size, config.n_embd)
        self.wpe = GPTEmbedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = GPTLinear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: one Parameter reachable under two names. Deliberate, see the module docstring.
        # Every init lives in a module's reset_parameters (none runs after construction); the tie
        # keeps wte's values.
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Map token ids of shape (B, T) to next-token logits of shape (B, T, vocab_size)."""
        _, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Extend ``idx`` (B, T) by ``max_new_tokens`` sampled tokens; temperature 0 means greedy."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size :])[:, -1, :]
            if temperature == 0.0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = F.softmax(logits / temperature, dim=-1)
                # Sample on the CPU so a fixed-seed generator gives the same text on any accelerator.
                nxt = torch.multinomial(probs.float().cpu(), 1, generator=generator).to(idx.device)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


# ---------------------------------------------------------------------------- data


class CharTokenizer:
    """Character-level tokenizer; the vocabulary is the sorted set of characters, so it is
    the same on every rank and every run without having to be saved or broadcast."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in ids)


class CharBlockDataset(Dataset):
    """Fixed-length blocks at random offsets, drawn once from a seeded generator.

    The offsets are fixed at construction, not drawn in ``__getitem__``, so the data
    does not depend on which process or worker asks for an item: every rank sees the
    same dataset and the distributed sampler alone decides who trains on what.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, num_samples: int, seed: int) -> None:
        if len(tokens) <= block_size:
            raise ValueError(f"need more than block_size={block_size} tokens, got {len(tokens)}")
        self.tokens = tokens
        self.block_size = block_size
        gen = torch.Generator().manual_seed(seed)
        self.offsets = torch.randint(0, len(tokens) - block_size, (num_samples,), generator=gen)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.offsets[i])
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def build_datasets(
    text: str, tokenizer: CharTokenizer, block_size: int, seed: int
) -> tuple[CharBlockDataset, CharBlockDataset]:
    """Split the corpus 90/10 by position (not by block) so no validation text is trained on."""
    tokens = tokenizer.encode(text)
    n_train = int(0.9 * len(tokens))
    train_tokens, val_tokens = tokens[:n_train], tokens[n_train:]
    # As many blocks per epoch as the split would give if cut end to end: one "epoch" then
    # covers about as many characters as the split holds.
    train = CharBlockDataset(train_tokens, block_size, max(1, len(train_tokens) // block_size), seed)
    val = CharBlockDataset(val_tokens, block_size, max(1, len(val_tokens) // block_size), seed + 1)
    return train, val


# ------------------------------------------------------------------------ lightning


class GPTLightning(L.LightningModule):
    def __init__(
        self,
        config: GPTConfig,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        max_steps: int = 200,
        betas: tuple[float, float] = (0.9, 0.95),
    ) -> None:
        super().__init__()
        if isinstance(config, dict):  # load_from_checkpoint passes the saved hyper-parameters (a dict)
            config = GPTConfig(**config)
        self.save_hyperparameters(
            {
                "config": asdict(config),
                "lr": lr,
                "weight_decay": weight_decay,
                "warmup_steps": warmup_steps,
                "max_steps": max_steps,
                "betas": list(betas),
            }
        )
        self.config = config
        self.model: GPT | None = None

    def configure_model(self) -> None:
        # Built here, not in __init__: Lightning calls this hook once the strategy is set up, inside
        # its model-creation context, which is where a large model should come into existence.
        # It may be called again (fit, then validate): keep the model already built.
        if self.model is None:
            self.model = GPT(self.config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        assert self.model is not None, "the model is built in configure_model(), called by the Trainer"
        return self.model(idx)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss = self._loss(batch)
        # sync_dist: each rank validates a different shard of the val set; average them.
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        # Parameters are read here, not cached in __init__, because a strategy may have
        # replaced or wrapped them by the time the optimizer is built.
        # named_parameters() yields the tied wte/lm_head weight once, so it is not counted twice.
        params = [p for _, p in self.named_parameters() if p.requires_grad]
        # Decay matmul and embedding weights only; decaying biases and LayerNorm gains
        # just pulls them toward zero without regularizing anything useful.
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": hp.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=hp.lr,
            betas=tuple(hp.betas),
        )

        warmup, total = max(1, hp.warmup_steps), max(1, hp.max_steps)

        def lr_lambda(step: int) -> float:
            # Linear warmup, then cosine decay to 10% of the peak by the last step.
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class TrainMonitor(Callback):
    """Records the first step's loss, so the summary can show how far it fell, and tokens per
    second over the training loop, all ranks together. Validation time is excluded: it runs at
    a different pace and would make the number depend on how often it runs."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self.first_loss = float("nan")
        self.train_seconds = 0.0
        self._start: float | None = None
        self._val_start: float | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.current_epoch == 0 and batch_idx == 0 and isinstance(outputs, dict) and "loss" in outputs:
            self.first_loss = float(outputs["loss"])

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A sanity check would run before on_train_start, when there is nothing to subtract yet.
        if self._start is not None and self._val_start is not None:
            self._start += time.perf_counter() - self._val_start
        self._val_start = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._start is not None:
            self.train_seconds = time.perf_counter() - self._start

    def tokens_per_second(self, steps: int, world_size: int) -> float:
        return steps * world_size * self.tokens_per_step / max(self.train_seconds, 1e-9)


class ShardingSummary(Callback):
    """Under a ZeRO strategy: the model state this rank holds and what communication cost per step,
    read from the strategy's engine while it is still sharded (it is released when fit ends)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.train_bytes = 0
        self.train_comm_seconds = 0.0

    # A training step's communication is counted from the end of the step before it (or of validation): stage 3
    # issues a step's first gathers when the batch starts, before on_train_batch_start runs.
    def _mark(self, trainer: L.Trainer) -> None:
        if isinstance(trainer.strategy, ZeROStrategy):
            self._before = trainer.strategy.sharded_model.comm.stats.snapshot()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mark(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mark(trainer)  # validation during fit is not a training step's

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if isinstance(trainer.strategy, ZeROStrategy):
            step = trainer.strategy.sharded_model.comm.stats.since(self._before)
            self.train_bytes += step.bytes_sent
            self.train_comm_seconds += sum(s.seconds for s in step.by_kind.values())
        self._mark(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not isinstance(trainer.strategy, ZeROStrategy) or trainer.global_step == 0:
            return
        # The prediction comes from lightning_zero.estimate_memory, run on this model with this run's world
        # size, precision and options (strategy.memory_report()); MB here are 2^20 bytes.
        report = trainer.strategy.memory_report()
        memory = report.measured
        held = memory["params"] + memory["master_params"] + memory["grads"] + memory["optimizer_states"]
        predicted = report.row.device.total + report.row.cpu.total
        mb = 1 / 2**20
        master = f", master {memory['master_params'] * mb:.2f}" if memory["master_params"] else ""
        self.lines = [
            f"model state:     {held * mb:.2f} MB per rank (params {memory['params'] * mb:.2f}{master}, grads "
            f"{memory['grads'] * mb:.2f}, optimizer {memory['optimizer_states'] * mb:.2f}); predicted "
            f"{predicted * mb:.2f}, DDP {report.estimate.row('ddp').device.total * mb:.2f}",
            f"communication:   {self.train_bytes / trainer.global_step * mb:.2f} MB sent per rank per step "
            f"(predicted {report.row.comm_bytes * mb:.2f}), "
            f"{self.train_comm_seconds:.1f} s in collectives",
        ]


@torch.no_grad()
def evaluate(model: GPT, dataset: CharBlockDataset, batch_size: int) -> float:
    """Mean loss of ``model`` over ``dataset``, computed in this process alone."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for x, y in DataLoader(dataset, batch_size=batch_size):
        x, y = x.to(device), y.to(device)
        logits = model(x)
        total += F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), reduction="sum").item()
        count += y.numel()
    model.train(was_training)
    return total / max(count, 1)


# ----------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="zero3", help="any strategy Trainer accepts: ddp, zero1, zero2, zero3, ...")
    p.add_argument("--devices", default="2", help="number of devices/processes, or 'auto'")
    p.add_argument("--num-nodes", type=int, default=1, help="machines in the job (torchrun --nnodes, SLURM nodes)")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32, help="per device")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 10%% of --max-steps")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--val-check-interval", type=int, default=50, help="validate every N training steps")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="plain-text training corpus")
    p.add_argument("--output", type=Path, default=Path("runs/train_gpt"), help="Trainer default_root_dir")
    p.add_argument(
        "--checkpoint", action="store_true", help="save OUTPUT/checkpoints/final.ckpt after the last step (printed)"
    )
    p.add_argument("--sample-chars", type=int, default=100)
    p.add_argument("--prompt", default="The Fiend ")
    args = p.parse_args(argv)
    args.devices = int(args.devices) if str(args.devices).isdigit() else args.devices
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.max_steps // 10)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """Train, then on global rank 0 print and return a summary; other ranks return None."""
    args = parse_args(argv)
    L.seed_everything(args.seed, verbose=False)
    # Batches are slices of an in-memory tensor; worker processes would only compete for the CPUs.
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")

    text = args.data.read_text(encoding="utf-8")
    tokenizer = CharTokenizer(text)
    train_set, val_set = build_datasets(text, tokenizer, args.block_size, args.seed)
    config = GPTConfig(
        block_size=args.block_size,
        vocab_size=tokenizer.vocab_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=args.dropout,
    )
    module = GPTLightning(
        config, lr=args.lr, weight_decay=args.weight_decay, warmup_steps=args.warmup_steps, max_steps=args.max_steps
    )

    monitor = TrainMonitor(tokens_per_step=args.batch_size * args.block_size)
    sharding = ShardingSummary()
    callbacks: list[Callback] = [monitor, sharding]
    if args.checkpoint:
        # A fixed place and name, printed at the end (Lightning would add "-v1" if it exists already).
        # Under the ZeRO strategies it is one ordinary .ckpt file, written by every rank in parallel.
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.output / "checkpoints", filename="final", every_n_train_steps=args.max_steps, save_top_k=-1
            )
        )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=args.strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        # Count validation intervals in global steps across epoch boundaries; epochs here
        # are an artifact of the dataset length, not a meaningful unit.
        val_check_interval=min(args.val_check_interval, args.max_steps),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=10,
        default_root_dir=args.output,
        logger=CSVLogger(args.output, name="logs"),
        enable_checkpointing=args.checkpoint,
        callbacks=callbacks,
    )
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size)
    trainer.fit(module, train_dataloaders=train_loader, val_dataloaders=val_loader)

    if not trainer.is_global_zero:
        return None

    # Everything below runs on the plain module in this process only. Recomputing the
    # validation loss here, rather than only reporting the logged one, checks that the
    # weights the strategy hands back after fit are the weights it trained.
    model = module.model
    metrics = trainer.callback_metrics
    train_loss = float(metrics["train_loss"]) if "train_loss" in metrics else float("nan")
    logged_val = float(metrics["val_loss"]) if "val_loss" in metrics else float("nan")
    val_loss = evaluate(model, val_set, args.batch_size)
    tokens_per_s = monitor.tokens_per_second(trainer.global_step, trainer.world_size)

    prompt = args.prompt if all(c in tokenizer.stoi for c in args.prompt) else text[0]
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(args.seed)
    model.eval()
    out = model.generate(tokenizer.encode(prompt)[None].to(device), args.sample_chars, temperature=0.8, generator=gen)
    sample = tokenizer.decode(out[0].tolist())

    n_params = sum(p.numel() for p in model.parameters())
    print(f"\n=== train_gpt summary ({args.strategy}, {trainer.world_size} x {args.accelerator}, {args.precision})")
    print(f"params:          {n_params:,} (lm_head tied to wte)")
    print(f"steps:           {trainer.global_step}")
    print(f"train_loss:      {monitor.first_loss:.4f} (first step) -> {train_loss:.4f} (last step), rank 0")
    print(f"val_loss:        {val_loss:.4f} (after fit, rank 0; last logged: {logged_val:.4f})")
    print(f"tokens/s:        {tokens_per_s:,.0f} (training, all ranks)")
    print(f"train time:      {monitor.train_seconds:.1f} s")
    for line in sharding.lines:
        print(line)
    print(f"sample:\n{sample}\n")
    checkpoint = trainer.checkpoint_callback.best_model_path if args.checkpoint else None  # type: ignore[union-attr]
    if checkpoint:
        print(f"checkpoint:      {checkpoint}")
        print(f"                 (load it with GPTLightning.load_from_checkpoint({checkpoint!r}),")
        print(f"                 or fine-tune: python examples/finetune_gpt.py --pretrained {checkpoint})")

    return {
        "first_train_loss": monitor.first_loss,
        "train_loss": train_loss,
        "val_loss": val_loss,
        "logged_val_loss": logged_val,
        "tokens_per_s": tokens_per_s,
        "steps": trainer.global_step,
        "sample": sample,
        "checkpoint": checkpoint,
    }


if __name__ == "__main__":
    main()
