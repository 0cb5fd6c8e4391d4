"""Nothing of a run outlives its teardown: no thread, no process group (see [Note: nothing outlives teardown] in
``lightning_zero/engine/comm/control.py``), and a script that trains exits 0 every time, through Lightning's own
launcher."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric import Fabric

from tests.distributed import spawn
from tests.models import ParityNet, quiet_trainer

REPO = Path(__file__).resolve().parents[1]
MONITOR = "lightning_zero stall monitor"


def _ours() -> tuple[list[str], int]:
    """The threads and process groups beside the default one that are alive now."""
    threads = [t.name for t in threading.enumerate() if t.name == MONITOR]
    return threads, len(dist.distributed_c10d._world.pg_map) - 1


def _runs(rank: int, world_size: int) -> dict[str, tuple[list[str], int]]:
    found = {"before": _ours()}
    for name in ("zero1", "zero2", "zero3"):
        trainer = quiet_trainer(strategy=name, devices=world_size, max_steps=2, limit_val_batches=2)
        model = ParityNet()
        trainer.fit(model)
        found[f"{name} fit"] = _ours()
        trainer.validate(model)
        trainer.predict(model)
        found[f"{name} validate, predict"] = _ours()
    fabric = Fabric(strategy="zero3", accelerator="cpu", devices=world_size)
    fabric.launch()
    layer = torch.nn.Linear(4, 4)
    fabric.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    fabric.strategy.teardown()
    found["fabric"] = _ours()
    return found


def test_no_thread_or_process_group_outlives_a_run() -> None:
    for found in spawn(_runs, world_size=2, timeout=300):
        for when, ours in found.items():
            assert ours == ([], 0), (when, ours)


SCRIPT = textwrap.dedent(
    """
    import lightning as L
    import torch

    import lightning_zero  # noqa: F401 (registers the strategies)
    from tests.models import ParityNet

    if __name__ == "__main__":
        trainer = L.Trainer(strategy="zero3", accelerator="cpu", devices=2, max_steps=3, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=2)
        model = ParityNet()
        trainer.fit(model)
        trainer.predict(model)
    """
)


# A Fabric script as LitGPT's are written: it never calls fabric.strategy.teardown(), so the run's control channel is
# still open when the interpreter exits (closed by the exit handler of engine/comm/process_exit.py).
FABRIC_SCRIPT = textwrap.dedent(
    """
    import lightning as L
    import torch

    import lightning_zero  # noqa: F401 (registers the strategies)

    if __name__ == "__main__":
        fabric = L.Fabric(strategy="zero3", accelerator="cpu", devices=2)
        fabric.launch()
        with fabric.init_module():
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        model = fabric.setup(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
        for _ in range(3):
            fabric.backward(model(torch.randn(4, 8)).square().mean())
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            model(torch.randn(2, 8))
    """
)


def test_scripts_that_train_exit_cleanly_every_time(tmp_path: Path) -> None:
    """Back-to-back runs of a Trainer script and of a Fabric script that never tears down, each launching its second
    rank through Lightning's launcher: every one exits 0 without ``terminate called without an active exception``
    (before, about one Trainer run in eight, and three Fabric runs of LitGPT's scripts in sixteen, aborted so at
    exit)."""
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "fabric_train.py").write_text(FABRIC_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for run, script in enumerate(["train.py", "fabric_train.py"] * 3):
        result = subprocess.run(
            [sys.executable, script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, (run, result.stderr[-3000:])
        assert "terminate called" not in result.stderr, (run, result.stderr[-3000:])
