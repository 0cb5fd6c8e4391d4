"""The benchmark's model and data: a nanoGPT-shaped character model and fixed-seed batches.

Every system under test starts from the same weights (``reference_state_dict``) and trains on
the same batches (``BenchData.batch(step, rank)``): rank-dependent, so each rank has its own
slice as in data-parallel training, but independent of the system, so losses can be compared
step by step.

The default config has about 25M parameters (8 blocks of width 512; the 76-character vocabulary
of ``examples/data/corpus.txt`` adds little) and small batches, sized for 2 CPU cores; ``TINY`` is
for smoke tests; ``GPU`` is the default model with 8,192 tokens per step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CORPUS = Path(__file__).resolve().parent.parent / "examples" / "data" / "corpus.txt"


@dataclass(frozen=True)
class BenchConfig:
    """Model shape and batch shape (per rank, per step)."""

    n_layer: int = 8
    n_head: int = 8
    n_embd: int = 512
    block_size: int = 64
    vocab_size: int = 76  # the distinct characters of the corpus; checked against it in BenchData
    batch_size: int = 2

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if min(self.n_layer, self.n_head, self.block_size, self.vocab_size, self.batch_size) < 1:
            raise ValueError(f"every size must be positive: {self}")

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


DEFAULT = BenchConfig()
TINY = BenchConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=2)
GPU = BenchConfig(block_size=256, batch_size=32)  # the default model, with a batch that keeps a GPU busy
CONFIGS = {"default": DEFAULT, "tiny": TINY, "gpu": GPU}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: BenchConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)  # one matmul for q, k and v
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: the unit every sharded system gathers and reduces together."""

    def __init__(self, config: BenchConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class BenchGPT(nn.Module):
    """Token ids (B, T) -> mean next-token cross-entropy, given targets (B, T).

    Returning the loss from ``forward`` keeps the tied ``wte``/``lm_head`` weight inside one
    ``forward`` call, which is what DeepSpeed ZeRO-3 and FSDP2 need to gather it in time.
    """

    def __init__(self, config: BenchConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2: the case sharding gets wrong most easily
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.blocks:  # GPT-2's scaled init of the projections that write into the residual stream
            for proj in (block.attn.proj, block.proj):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def count_params(model: nn.Module) -> int:
    """Distinct parameters (a tied weight once)."""
    return sum(p.numel() for p in model.parameters())


def reference_state_dict(config: BenchConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """The initial weights every system copies (the same on every rank and every system)."""
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in BenchGPT(config).state_dict().items()}


def build_model(config: BenchConfig, state: dict[str, torch.Tensor], device: torch.device | str = "cpu") -> BenchGPT:
    """A fresh model holding ``state`` (independent storage: systems may shard it in place)."""
    model = BenchGPT(config)
    model.load_state_dict(state)
    return model.to(device)


class BenchData:
    """Fixed-seed (x, y) character blocks of ``examples/data/corpus.txt``.

    Example::

        data = BenchData(TINY, seed=0)
        x, y = data.batch(step=0, rank=1)     # the same tensors for every system
    """

    def __init__(self, config: BenchConfig, seed: int = 0, corpus: Path = CORPUS) -> None:
        text = corpus.read_text(encoding="utf-8")
        chars = sorted(set(text))
        if len(chars) > config.vocab_size:
            raise ValueError(f"{corpus} has {len(chars)} distinct characters, more than vocab_size={config.vocab_size}")
        lookup = {c: i for i, c in enumerate(chars)}
        self.tokens = torch.tensor([lookup[c] for c in text], dtype=torch.long)
        self.config = config
        self.seed = seed

    def batch(self, step: int, rank: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + rank)
        starts = torch.randint(0, len(self.tokens) - cfg.block_size - 1, (cfg.batch_size,), generator=gen)
        rows = torch.stack([self.tokens[s : s + cfg.block_size + 1] for s in starts.tolist()])
        return rows[:, :-1].contiguous().to(device), rows[:, 1:].contiguous().to(device)
