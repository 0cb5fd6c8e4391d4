"""``lightning_zero.check_parity`` and ``python -m lightning_zero check-parity``: the user-facing parity checker.

Each ``check_parity`` call starts its own two gloo processes and trains ``ParityNet`` under DDP and under
one stage. The checker must pass for every stage, fail for a module that behaves differently under ZeRO
(so a pass means something), and work from the command line. The report's arithmetic is tested on
made-up runs, without processes.
"""

from __future__ import annotations

import math
import subprocess
import sys
import types
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from lightning_zero import ParityReport, ZeROStrategy, check_parity
from lightning_zero.__main__ import main
from lightning_zero.tools.parity import _loss_from
from lightning_zero.tools.parity_report import Run, compare_runs
from tests.models import ParityNet

REPO = Path(__file__).resolve().parents[1]


class LouderUnderZeRO(ParityNet):
    """Multiplies its loss by 1.01 under any ZeRO strategy: a module the checker must catch."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        loss = super().training_step(batch, batch_idx)
        if loss is not None and isinstance(self.trainer.strategy, ZeROStrategy):
            loss = loss * 1.01
        return loss


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_stage_passes_on_parity_net(stage: int) -> None:
    report = check_parity(ParityNet(), stage=stage, steps=4)
    assert isinstance(report, ParityReport)
    assert report.ok, str(report)
    assert (report.stage, report.world_size, report.steps) == (stage, 2, 4)
    assert len(report.losses) == len(report.grad_norms) == 4
    assert all(math.isfinite(a) and a > 0 for pair in report.losses for a in pair)
    assert all(math.isfinite(a) and a > 0 for pair in report.grad_norms for a in pair)
    assert report.max_rel_loss_diff <= 1e-5 and report.max_rel_grad_norm_diff <= 1e-5
    assert report.max_rel_param_diff <= 1e-5
    assert not any("unchanged" in note for note in report.notes)  # the reference did train
    text = str(report)
    assert f"zero{stage} vs ddp" in text and ": OK" in text and "grad norm" in text


def test_a_module_that_differs_under_zero_fails() -> None:
    report = check_parity(LouderUnderZeRO(), stage=1, steps=4)
    assert not report.ok
    assert report.max_abs_loss_diff > 0
    assert report.max_rel_loss_diff == pytest.approx(0.01, rel=1e-3)
    assert report.max_rel_grad_norm_diff == pytest.approx(0.01, rel=1e-3)
    for ddp, zero in report.losses:
        assert zero == pytest.approx(ddp * 1.01, rel=1e-5)
    assert "MISMATCH" in str(report)


def test_cli_checks_a_module_class() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_zero",
            "check-parity",
            "tests.models:ParityNet",
            "--stage",
            "2",
            "--steps",
            "3",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("lightning_zero parity check: zero2 vs ddp, 2 process(es), 3 step(s)")
    assert lines[0].endswith(": OK")
    assert lines[1].split()[:3] == ["step", "loss", "ddp"]
    assert [line.split()[0] for line in lines[2:5]] == ["0", "1", "2"]
    assert any(line.startswith("max param diff:") for line in lines)


def test_cli_rejects_what_is_not_a_lightning_module(capsys: pytest.CaptureFixture[str]) -> None:
    for target, message in (
        ("tests.models", "expected MODULE:ATTR"),
        ("tests.no_such_module:Net", "cannot import 'tests.no_such_module'"),
        ("tests.models:NoSuchNet", "has no attribute 'NoSuchNet'"),
        ("tests.models:token_data", "returned a TensorDataset, not a LightningModule"),
        ("tests.models:VOCAB", "neither a LightningModule class nor a function"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(["check-parity", target])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, target


def test_invalid_arguments_fail_before_starting_processes() -> None:
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        check_parity(ParityNet(), stage=4)
    with pytest.raises(ValueError, match="trainer_kwargs may not set devices, max_steps"):
        check_parity(ParityNet(), trainer_kwargs={"max_steps": 3, "devices": 4})
    with pytest.raises(TypeError, match="did you mean 'unit_modules'"):  # the strategy's own check
        check_parity(ParityNet(), strategy_kwargs={"unit_modul": ["Linear"]})
    with pytest.raises(TypeError, match="LightningModule"):
        check_parity(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    notebook_class = type("NotebookNet", (ParityNet,), {"__module__": "__main__"})
    with mock.patch.dict(sys.modules, {"__main__": types.ModuleType("__main__")}):  # no __file__: a notebook
        with pytest.raises(TypeError, match="NotebookNet is defined in an interactive session"):
            check_parity(notebook_class())
    model = ParityNet()
    model.unpicklable = lambda: None
    with pytest.raises(TypeError, match="must be picklable"):
        check_parity(model)


# ---------------------------------------------------------------------- the report, on made-up runs
def _run(losses: list[float], norms: list[float], state: dict[str, torch.Tensor] | None) -> Run:
    return Run(
        losses=losses, loss_sources=["training_step's output"], grad_norms=norms, global_step=len(norms), state=state
    )


def test_report_compares_every_rank_and_names_the_worst_parameter() -> None:
    initial = {"a": torch.zeros(3), "b": torch.zeros(2)}
    ddp_state = {"a": torch.tensor([1.0, 2.0, 4.0]), "b": torch.tensor([10.0, 0.0])}
    zero_state = {"a": torch.tensor([1.0, 2.0, 4.0 + 8e-4]), "b": torch.tensor([10.0, 1e-3])}
    ddp = [_run([2.0, 1.0], [3.0, 2.0], ddp_state), _run([4.0, 3.0], [3.0, 2.0], None)]
    zero = [_run([2.0, 1.0], [3.0, 2.0], zero_state), _run([4.0, 3.0 + 3e-3], [3.0, 2.0 + 2e-6], None)]
    report = compare_runs(3, 2, 2, 1e-5, ddp, zero, initial)
    assert not report.ok
    assert report.losses == [(3.0, 3.0), (2.0, pytest.approx(2.0015))]  # means over ranks
    assert report.max_abs_loss_diff == pytest.approx(3e-3) and report.max_rel_loss_diff == pytest.approx(1e-3)
    assert report.max_rel_grad_norm_diff == pytest.approx(1e-6)
    assert report.worst_param == "a"  # relative to the tensor's scale: 8e-4 / 4 beats 1e-3 / 10
    assert report.max_abs_param_diff == pytest.approx(1e-3, rel=1e-3)
    assert report.max_rel_param_diff == pytest.approx(2e-4, rel=1e-3)
    assert compare_runs(3, 2, 2, 2e-3, ddp, zero, initial).ok
    only_params = compare_runs(3, 2, 2, 1e-5, ddp, [_run(r.losses, r.grad_norms, zero_state) for r in ddp], initial)
    assert not only_params.ok and any("gradient norms agree but a does not" in n for n in only_params.notes)

    same = compare_runs(1, 2, 2, 0.0, ddp, ddp, initial)
    assert same.ok and same.worst_param is None and same.max_abs_param_diff == 0.0
    assert "(all equal)" in str(same) and ": OK" in str(same)


def test_report_fails_on_structure_and_notes_what_it_could_not_compare() -> None:
    state = {"w": torch.ones(2)}
    nan = math.nan
    ddp = [_run([nan, nan], [1.0, 1.0], state)]
    ddp[0].loss_sources = ["nowhere"]
    report = compare_runs(2, 1, 2, 1e-5, ddp, ddp, {"w": torch.ones(2)})
    assert report.ok  # NaN losses on both sides are not a difference
    assert any("losses were not compared" in note for note in report.notes)
    assert any("left every parameter unchanged" in note for note in report.notes)

    shorter = [_run([1.0], [1.0], {"w": torch.ones(3), "extra": torch.ones(1)})]
    report = compare_runs(2, 1, 2, 1.0, [_run([1.0, 1.0], [1.0, 1.0], state)], shorter, {})
    assert not report.ok
    text = "\n".join(report.notes)
    assert (
        "rank 0: ddp ran 2 training batches, zero2 1" in text and "rank 0: ddp took 2 optimizer steps, zero2 1" in text
    )
    assert "'extra' only under zero2" in text and "shape (2,) under ddp, (3,) under zero2" in text


def test_loss_is_read_from_outputs_then_logged_metrics() -> None:
    assert _loss_from(torch.tensor(2.0), {}) == (2.0, "training_step's output")
    assert _loss_from({"loss": torch.tensor(3.0), "x": 1}, {}) == (3.0, "training_step's output")
    metrics = {"val_acc": torch.tensor(0.5), "train_loss": torch.tensor(4.0), "train_loss_step": torch.tensor(5.0)}
    assert _loss_from(None, metrics) == (5.0, "the logged metric 'train_loss_step'")
    assert _loss_from(None, {"train_loss": torch.tensor(4.0)}) == (4.0, "the logged metric 'train_loss'")
    value, source = _loss_from(None, {"acc": torch.tensor(1.0)})
    assert math.isnan(value) and source == "nowhere"
