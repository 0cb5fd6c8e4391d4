"""Train the small GPT of ``examples/train_gpt.py`` through ``LightningCLI``, configured by YAML.

Every ``Trainer`` argument, the strategy's own arguments included, comes from a config file or the
command line; see ``examples/cli/README.md``:

    python examples/cli/train_cli.py fit --config examples/cli/configs/zero3.yaml
    python examples/cli/train_cli.py fit --config examples/cli/configs/zero3.yaml --trainer.strategy=zero2
    python examples/cli/train_cli.py fit --trainer.strategy.help lightning_zero.ZeRO3Strategy

The model and the data come from ``train_gpt.py`` unchanged; this file adds only a
``LightningDataModule`` around its datasets and the links that keep the two consistent: the
model's ``vocab_size`` is the tokenizer's, its ``block_size`` the data's, and its learning-rate
schedule ends at ``trainer.max_steps``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning as L
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from torch.utils.data import DataLoader

import lightning_zero  # noqa: F401  registers "zero1", "zero2", "zero3", so `strategy: zero3` resolves

EXAMPLES = Path(__file__).resolve().parents[1]
if str(EXAMPLES) not in sys.path:  # train_gpt.py lives one level up; examples/ is not a package
    sys.path.insert(0, str(EXAMPLES))

from train_gpt import DEFAULT_DATA, CharBlockDataset, CharTokenizer, GPTLightning, build_datasets  # noqa: E402


class CharDataModule(L.LightningDataModule):
    """Character blocks of a plain-text corpus, split 90/10 into training and validation.

    Args:
        data: Path of a UTF-8 text file. ``None`` (default): the corpus shipped in ``examples/data``.
        block_size: Characters per training sequence; the model's ``block_size`` follows it.
        batch_size: Sequences per batch, per device.
        seed: Seed of the block offsets (the same on every rank, so the sampler alone splits the data).
    """

    def __init__(self, data: str | None = None, block_size: int = 64, batch_size: int = 32, seed: int = 1234) -> None:
        super().__init__()
        self.save_hyperparameters()
        # Read now, not in setup(): the CLI links vocab_size into the model before the model is built.
        self.text = Path(data or DEFAULT_DATA).read_text(encoding="utf-8")
        self.tokenizer = CharTokenizer(self.text)
        self.block_size = block_size
        self.batch_size = batch_size
        self.seed = seed
        self.train_set: CharBlockDataset | None = None
        self.val_set: CharBlockDataset | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def setup(self, stage: str) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = build_datasets(self.text, self.tokenizer, self.block_size, self.seed)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.batch_size)


class GPTCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.block_size", "model.config.block_size")
        parser.link_arguments("data.vocab_size", "model.config.vocab_size", apply_on="instantiate")
        parser.link_arguments("trainer.max_steps", "model.max_steps")


def main(args: ArgsType = None, run: bool = True) -> GPTCLI:
    """Parse ``args`` (default: ``sys.argv[1:]``), build model, data and Trainer, and with ``run=True``
    run the subcommand (``fit``, ``validate``, ``test``, ``predict``). Returns the CLI object, whose
    ``trainer``, ``model`` and ``datamodule`` stay available afterwards."""
    # Batches are slices of an in-memory tensor; worker processes would only compete for the CPUs.
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    return GPTCLI(
        GPTLightning,
        CharDataModule,
        args=args,
        run=run,
        seed_everything_default=1234,
        # Re-running into the same directory replaces the saved config.yaml instead of failing.
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
