"""GPT shapes for ``python -m lightning_zero dry-run``: the example GPT of ``train_gpt.py`` at the sizes ZeRO-3 is
for, each a ``LightningModule`` built with no arguments (the model is made in ``configure_model``).

Rank 0 of a 512-rank ZeRO-3 job of the 1.3B shape, on this machine, in one process (see ``docs/memory.md``)::

    python -m lightning_zero dry-run examples/dry_run_gpt.py:GPT1B --world-size 512 --batch-shape 1,128
    python -m lightning_zero dry-run examples/dry_run_gpt.py:GPT1B --world-size 512 --shard-size 8 --batch-shape 1,128
    python -m lightning_zero dry-run examples/dry_run_gpt.py:GPTSmall --world-size 8 --strategy zero2 --batch-shape 2,64

The shapes follow GPT-3's table (Brown et al., 2020) with a 50,304-token vocabulary and the sequence length of
the batch: 1.3B is 24 blocks of width 2048, 7B 32 blocks of 4096, 70B 80 blocks of 8192.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the GPT lives in train_gpt.py

from train_gpt import GPTConfig, GPTLightning

VOCAB = 50_304


class GPTSmall(GPTLightning):
    """2 blocks of width 64 (about 0.1M parameters with its 128-token vocabulary): for tests."""

    def __init__(self) -> None:
        super().__init__(GPTConfig(block_size=64, vocab_size=128, n_layer=2, n_head=2, n_embd=64))


class GPT1B(GPTLightning):
    """1.3B parameters: 24 blocks of width 2048, 16 heads."""

    def __init__(self) -> None:
        super().__init__(GPTConfig(block_size=128, vocab_size=VOCAB, n_layer=24, n_head=16, n_embd=2048))


class GPT7B(GPTLightning):
    """6.5B parameters: 32 blocks of width 4096, 32 heads."""

    def __init__(self) -> None:
        super().__init__(GPTConfig(block_size=128, vocab_size=VOCAB, n_layer=32, n_head=32, n_embd=4096))


class GPT70B(GPTLightning):
    """65B parameters: 80 blocks of width 8192, 64 heads."""

    def __init__(self) -> None:
        super().__init__(GPTConfig(block_size=128, vocab_size=VOCAB, n_layer=80, n_head=64, n_embd=8192))
