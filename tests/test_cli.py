"""``LightningCLI`` (``examples/cli/train_cli.py``): strategies configured from YAML and the command line.

The fits run for real on two gloo processes; parsing errors and ``--help`` need one process only.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy, ZeROStrategy
from tests.distributed import spawn

# litgpt 0.5.13 asks for jsonargparse<=4.41, whose messages say less than 4.53's: a value outside a Literal is
# "Cannot take a Union of no types" (not the allowed values), a misspelt key "Key '...' is not expected", and
# --help shows no docstring descriptions. Both are checked: the test extra installs the first (beside litgpt), a
# Lightning CLI user without litgpt gets the newest.
_JSONARGPARSE = tuple(int(part) for part in importlib.metadata.version("jsonargparse").split(".")[:2])
_DETAILED = _JSONARGPARSE >= (4, 53)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "examples" / "cli" / "configs"
# The configs' model and schedule, shrunk so that a fit takes seconds; everything else comes from the YAML.
TINY = [
    "--trainer.max_steps=4",
    "--trainer.val_check_interval=2",
    "--trainer.limit_val_batches=1",
    "--trainer.logger=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--model.config.n_embd=32",
    "--model.warmup_steps=1",
    "--data.block_size=16",
    "--data.batch_size=4",
]


def _main(args: list[str], run: bool = True) -> Any:
    """``main(args)`` of ``examples/cli/train_cli.py`` (loaded as a module: ``examples/`` is not a package),
    with ``sys.argv`` holding the script name alone, as it would when run as ``train_cli.py ARGS``."""
    if "train_cli" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_cli", REPO / "examples" / "cli" / "train_cli.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["train_cli"] = module
        spec.loader.exec_module(module)
    with mock.patch.object(sys, "argv", ["train_cli.py"]):
        return sys.modules["train_cli"].main(args, run=run)


class RecordUnits(Callback):
    """Given on the command line (``--trainer.callbacks+=tests.test_cli.RecordUnits``): the names of the
    units the strategy formed, read while the model is still sharded."""

    def __init__(self) -> None:
        self.units: list[str] = []

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert isinstance(trainer.strategy, ZeROStrategy)
        self.units = [unit.name for unit in trainer.strategy.sharded_model.units]


def _fit(rank: int, world_size: int, root: str) -> dict[str, dict[str, Any]]:
    """Three fits from ``zero3.yaml``: as written, with ``--trainer.strategy=zero2`` (a registered name:
    the YAML's init_args are dropped) and with ``--trainer.strategy.class_path`` (they are kept)."""
    runs = {
        "config": [],
        "name_flag": ["--trainer.strategy=zero2"],
        "class_path_flag": ["--trainer.strategy.class_path=lightning_zero.ZeRO2Strategy"],
        "bf16_flags": ["--trainer.precision=bf16-mixed", "--trainer.strategy.init_args.reduce_dtype=bfloat16"],
    }
    results = {}
    for name, extra in runs.items():
        cli = _main(
            [
                "fit",
                "--config",
                str(CONFIGS / "zero3.yaml"),
                *TINY,
                f"--trainer.default_root_dir={root}/{name}",
                "--trainer.callbacks+=tests.test_cli.RecordUnits",
                *extra,
            ]
        )
        trainer, strategy = cli.trainer, cli.trainer.strategy
        [record] = [c for c in trainer.callbacks if isinstance(c, RecordUnits)]
        results[name] = {
            "strategy": type(strategy),
            "unit_modules": strategy.unit_modules,
            "checkpoint_format": strategy.checkpoint_format,
            "broadcast_buffers": strategy.broadcast_buffers,
            "timeout": strategy.timeout,
            "precision": strategy.precision_plugin.precision,
            "reduce_dtype": strategy.reduce_dtype,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "validated": "val_loss" in trainer.callback_metrics,
            "units": record.units,
            "vocab_size": cli.model.config.vocab_size,
            "data_vocab_size": cli.datamodule.vocab_size,
            "block_size": cli.model.config.block_size,
            "schedule_steps": cli.model.hparams.max_steps,
            "checkpoints": sorted(p.name for p in Path(trainer.checkpoint_callback.dirpath).iterdir()),
            "checkpoint_is_dir": Path(trainer.checkpoint_callback.best_model_path).is_dir(),
        }
    return results


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    return spawn(_fit, world_size=2, timeout=180, root=str(tmp_path_factory.mktemp("cli")))


def test_fit_from_yaml_with_class_path_and_init_args(fits: list[dict[str, dict[str, Any]]]) -> None:
    for rank_result in fits:
        run = rank_result["config"]
        assert run["strategy"] is ZeRO3Strategy
        assert run["unit_modules"] == ["Block"]
        assert run["checkpoint_format"] == "sharded"
        assert run["broadcast_buffers"] is True
        assert run["timeout"] == timedelta(minutes=5)
        assert run["world_size"] == 2
        assert run["global_step"] == 4
        assert run["validated"]
        # unit_modules took effect: one unit per transformer block, nothing finer inside them.
        assert {"model.h.0", "model.h.1"} <= set(run["units"])
        assert not [u for u in run["units"] if u.startswith(("model.h.0.", "model.h.1."))]
        # The CLI's links: vocabulary from the tokenizer, block size from the data, schedule from max_steps.
        assert run["vocab_size"] == run["data_vocab_size"] > 0
        assert run["block_size"] == 16
        assert run["schedule_steps"] == 4
        assert run["checkpoints"] == ["epoch=0-step=4.ckpt"] and run["checkpoint_is_dir"]  # sharded: a directory


def test_precision_and_dtype_options_from_the_command_line(fits: list[dict[str, dict[str, Any]]]) -> None:
    for rank_result in fits:
        assert rank_result["config"]["precision"] == "32-true"
        run = rank_result["bf16_flags"]
        assert (run["precision"], run["reduce_dtype"]) == ("bf16-mixed", torch.bfloat16)
        assert run["global_step"] == 4


def test_strategy_flag_overrides_the_config(fits: list[dict[str, dict[str, Any]]]) -> None:
    for rank_result in fits:
        by_name = rank_result["name_flag"]  # --trainer.strategy=zero2 replaces the YAML's strategy whole
        assert by_name["strategy"] is ZeRO2Strategy
        assert by_name["unit_modules"] is None
        assert by_name["timeout"] == timedelta(minutes=30)
        assert by_name["global_step"] == 4 and by_name["world_size"] == 2 and by_name["validated"]
        # --trainer.strategy.class_path=... changes the class and keeps the YAML's init_args.
        by_class = rank_result["class_path_flag"]
        assert by_class["strategy"] is ZeRO2Strategy
        assert by_class["unit_modules"] == ["Block"]
        assert by_class["timeout"] == timedelta(minutes=5)
        assert {"model.h.0", "model.h.1"} <= set(by_class["units"])
        assert by_class["global_step"] == 4 and by_class["world_size"] == 2


def _config_with(tmp_path: Path, old: str, new: str) -> Path:
    text = (CONFIGS / "zero3.yaml").read_text()
    assert old in text
    path = tmp_path / "config.yaml"
    path.write_text(text.replace(old, new))
    return path


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            "checkpoint_format: sharded",
            "checkpoint_format: zip",
            ('Parser key "checkpoint_format"', "'full'" if _DETAILED else "zip", "zip"),
        ),
        (
            "checkpoint_format: sharded",
            "chekpoint_format: full",
            ("Option 'chekpoint_format' is not accepted" if _DETAILED else "Key 'chekpoint_format' is not expected",),
        ),
        ("broadcast_buffers: true", "broadcast_buffers: maybe", ('Parser key "broadcast_buffers"', "maybe")),
        ('timeout: "0:05:00"', "timeout: five minutes", ('Parser key "timeout"', "h:m:s", "five minutes")),
    ],
)
def test_invalid_init_arg_fails_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], old: str, new: str, expected: tuple[str, ...]
) -> None:
    config = _config_with(tmp_path, old, new)
    with pytest.raises(SystemExit) as exit_info:
        _main(["fit", "--config", str(config), f"--trainer.default_root_dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "lightning_zero.ZeRO3Strategy" in err
    for text in expected:
        assert text in err, text
    assert not (tmp_path / "run").exists()  # no Trainer, no processes, no files


def test_value_the_constructor_refuses_fails_before_training(tmp_path: Path) -> None:
    """A value of the right type that the strategy itself rejects: its own message, at instantiation."""
    config = _config_with(tmp_path, "broadcast_buffers: true", "process_group_backend: glooo")
    with pytest.raises(ValueError, match=r"process_group_backend='glooo' is not a torch\.distributed backend"):
        _main(["fit", "--config", str(config), f"--trainer.default_root_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()


def test_strategy_help_lists_its_documented_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _main(["fit", "--trainer.strategy.help", "lightning_zero.ZeRO3Strategy"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for name in inspect.signature(ZeRO3Strategy.__init__).parameters:
        if name != "self":
            assert f"--trainer.strategy.{name}" in out, name
    # The types and defaults, not just the names; and the docstring's descriptions where jsonargparse shows them.
    descriptions = (
        "Which modules form a *unit*",
        "How long a collective may wait for the other ranks before failing.",
        "How Lightning starts processes when it launches them itself",
        "Copy rank 0's buffers",
    )
    for text in (
        "type: Optional[Sequence[type[Module] | str]], default: null",
        "--trainer.strategy.checkpoint_format {full,sharded}",
        "type: Literal['full', 'sharded'], default: full",
        "default: 0:30:00",
        "--trainer.strategy.start_method {popen,spawn,fork,forkserver}",
        *(descriptions if _DETAILED else ()),
    ):
        assert text in out, text


def test_zero1_config_names_the_strategy_by_its_registered_string() -> None:
    """``strategy: zero1`` resolves through the registry; ``run=False`` builds everything without fitting."""
    cli = _main(["--config", str(CONFIGS / "zero1.yaml"), "--trainer.logger=false"], run=False)
    assert type(cli.trainer.strategy) is ZeRO1Strategy
    assert cli.trainer.strategy.checkpoint_format == "full" and cli.trainer.strategy.unit_modules is None
    assert cli.trainer.max_steps == 60 and cli.model.hparams.max_steps == 60
    assert cli.model.config.vocab_size == cli.datamodule.vocab_size
