"""``check_parity``: train your own module under ``DDPStrategy`` and under a ZeRO stage, and compare.

A few optimizer steps of the same ``LightningModule``, from the same weights, seed and data, once
under ``DDPStrategy(find_unused_parameters=True)`` and once under ``ZeRO1Strategy``,
``ZeRO2Strategy`` or ``ZeRO3Strategy``, on ``world_size`` CPU processes over gloo. The report
compares, step by step, the training losses and the global gradient norm before clipping, then
every entry of the final state dict, so you can see for yourself that sharding changed nothing.

Example (save as a script and run it; the checker starts its processes with ``spawn``, which
imports the script again, hence the ``__main__`` guard)::

    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zero import check_parity


    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)


    if __name__ == "__main__":
        data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
        report = check_parity(Regression(), DataLoader(data, batch_size=8), stage=3, steps=5)
        print(report)  # a table of losses and gradient norms, then the largest parameter difference
        assert report.ok

From the command line, for a module class (or a zero-argument factory) whose own
``train_dataloader`` provides the data::

    python -m lightning_zero check-parity my_package.models:MyModule --stage 3 --steps 5

With a quantized configuration (``strategy_kwargs={"quantize_weights": "int8"}``, or ``--quantize-weights int8``)
the same comparison is a drift report: how far the quantized run moves from the exact one, per step, and its
final loss and parameters, before a long run pays for it.
"""

from __future__ import annotations

import logging
import math
import pickle
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.environments import ClusterEnvironment, LightningEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_zero.strategies import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy, ZeROStrategy
from lightning_zero.tools.parity_report import FROM_STEP, NO_LOSS, ParityReport, Run, compare_runs
from lightning_zero.tools.processes import run_on_cpu_ranks

__all__ = ["check_parity"]

_STRATEGIES: dict[int, type[ZeROStrategy]] = {1: ZeRO1Strategy, 2: ZeRO2Strategy, 3: ZeRO3Strategy}
# Trainer arguments the checker sets itself: the comparison is only meaningful with these.
_RESERVED_TRAINER_ARGS = ("accelerator", "devices", "num_nodes", "strategy", "max_steps")


def check_parity(
    model: L.LightningModule,
    dataloader: DataLoader | None = None,
    stage: int = 3,
    steps: int = 5,
    world_size: int = 2,
    seed: int = 0,
    strategy_kwargs: dict[str, Any] | None = None,
    trainer_kwargs: dict[str, Any] | None = None,
    rtol: float = 1e-5,
    timeout: float = 600,
) -> ParityReport:
    """Train ``model`` for ``steps`` optimizer steps under ``DDPStrategy`` and under ZeRO ``stage``; compare.

    Starts ``world_size`` CPU processes (``spawn``; gloo; ``OMP_NUM_THREADS=1``). In each, both runs
    start from a fresh copy of ``model`` (so from the same weights) after ``seed_everything(seed)``, and
    run ``Trainer(accelerator="cpu", devices=world_size, max_steps=steps, logger=False, ...)`` with no
    checkpointing, validation or progress bar. The model, the dataloader and both keyword dicts are sent
    to the processes by pickling: define your module in an importable file (or a script with an
    ``if __name__ == "__main__":`` guard), not in a notebook cell.

    Losses are read from what ``training_step`` returns (a tensor or a dict with ``"loss"``); when it
    returns nothing (manual optimization), from a logged metric whose name contains ``"loss"``
    (``self.log("train_loss", loss)``); otherwise they are NaN and not compared (``notes`` says so).
    Gradient norms: ``strategy.grad_norm(optimizer)`` under ZeRO, ``torch.nn.utils.get_total_norm`` of the
    optimizer's gradients under DDP, in ``on_before_optimizer_step`` (before clipping).

    Args:
        model: Your ``LightningModule``, not yet sharded; it is copied, never modified.
        dataloader: The training data; ``None`` uses the module's own ``train_dataloader``. Lightning
            gives each rank its part (a ``DistributedSampler``) in both runs.
        stage: The ZeRO stage to check: 1, 2 or 3.
        steps: Optimizer steps per run.
        world_size: Number of processes (CPU devices).
        seed: Passed to ``lightning.seed_everything`` before each run.
        strategy_kwargs: Arguments for the ZeRO strategy (e.g. ``{"unit_modules": ["Block"]}``).
        trainer_kwargs: More ``Trainer`` arguments for both runs (e.g. ``{"gradient_clip_val": 1.0,
            "accumulate_grad_batches": 2}``); they may override the quiet defaults above, but not
            ``accelerator``, ``devices``, ``num_nodes``, ``strategy`` or ``max_steps``.
        rtol: The largest relative difference that still counts as equal (see ``ParityReport``).
        timeout: Seconds both runs together may take before ``TimeoutError`` (a deadlock, say).

    Returns:
        A ``ParityReport``; ``print`` it for a table, test ``report.ok``.

    Raises:
        ValueError: For an invalid ``stage``, ``steps``, ``world_size`` or a reserved ``trainer_kwargs`` key.
        TypeError: If ``model`` is not a ``LightningModule``, cannot be pickled or is defined in a notebook.
        Exception: Whatever the ZeRO strategy raises for invalid ``strategy_kwargs``, before any process starts.
        RuntimeError: If a run fails on any rank: the first failing rank's traceback is in the message.
        TimeoutError: If the processes do not finish within ``timeout`` seconds.
    """
    if stage not in _STRATEGIES:
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size!r}")
    if not isinstance(model, L.LightningModule):
        raise TypeError(f"check_parity needs a lightning.LightningModule, got {type(model).__name__}")
    trainer_kwargs = dict(trainer_kwargs or {})
    reserved = sorted(set(trainer_kwargs) & set(_RESERVED_TRAINER_ARGS))
    if reserved:
        raise ValueError(
            f"trainer_kwargs may not set {', '.join(reserved)}: check_parity sets "
            f"{', '.join(_RESERVED_TRAINER_ARGS)} itself (use stage=, steps= and world_size=)"
        )
    _STRATEGIES[stage](**(strategy_kwargs or {}))  # a misspelt or invalid option fails here, not on every rank
    main = sys.modules.get("__main__")
    if type(model).__module__ == "__main__" and not getattr(main, "__file__", None):
        raise TypeError(
            f"{type(model).__name__} is defined in an interactive session (a notebook or a REPL), which the "
            "processes check_parity starts cannot import: move the class into a .py file and import it from there"
        )
    try:
        payload = pickle.dumps((model, dataloader, dict(strategy_kwargs or {}), trainer_kwargs))
    except Exception as error:
        raise TypeError(
            "check_parity sends the model, the dataloader and the keyword arguments to new processes, so they "
            "must be picklable: define the LightningModule in an importable module (not a notebook cell or a "
            f"local scope) and avoid lambdas in them ({type(error).__name__}: {error})"
        ) from error
    initial = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, Tensor)}
    job = _Job(payload=payload, stage=stage, steps=steps, seed=seed)
    results = _spawn(job, world_size, timeout)
    report = compare_runs(
        stage, world_size, steps, rtol, [r["ddp"] for r in results], [r["zero"] for r in results], initial
    )
    quantized = {k: v for k, v in (strategy_kwargs or {}).items() if k.startswith("quantize_") and v is not None}
    if quantized:  # DDP is the exact run (every exact stage equals it bit for bit): what differs is quantization's
        report.quantized = ", ".join(f"{k}={v!r}" for k, v in sorted(quantized.items()))
        report.notes.append(
            f"{report.quantized} moves quantized values on purpose: the differences above are its drift from the "
            "exact run (DDP, which every exact stage equals bit for bit), not a fault"
        )
    return report


# ---------------------------------------------------------------------- inside the processes
@dataclass
class _Job:
    payload: bytes  # pickled (model, dataloader, strategy_kwargs, trainer_kwargs): unpickled afresh per run
    stage: int
    steps: int
    seed: int


class _Recorder(Callback):
    """Per-batch losses and the global gradient norm before clipping."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.sources: list[str] = []
        self.grad_norms: list[float] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        value, source = _loss_from(outputs, trainer.callback_metrics)
        self.losses.append(value)
        if source not in self.sources:
            self.sources.append(source)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Optimizer) -> None:
        if isinstance(trainer.strategy, ZeROStrategy):
            norm = trainer.strategy.grad_norm(optimizer)  # a collective: every rank gets here
        else:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
        self.grad_norms.append(float(norm))


def _scalar(value: Any) -> float | None:
    if isinstance(value, Tensor) and value.numel() == 1:
        return float(value.detach().float().cpu())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _loss_from(outputs: Any, metrics: Mapping[str, Any]) -> tuple[float, str]:
    """The batch's loss and where it came from: ``training_step``'s output, else a logged metric, else NaN."""
    if (value := _scalar(outputs)) is not None:
        return value, FROM_STEP
    if isinstance(outputs, Mapping) and (value := _scalar(outputs.get("loss"))) is not None:
        return value, FROM_STEP  # Lightning turns a returned tensor into {"loss": tensor}
    names = [name for name in metrics if "loss" in name.lower() and _scalar(metrics[name]) is not None]
    # The per-step value of a metric logged with on_step=True and on_epoch=True first, then the usual names.
    preferred = ("train_loss_step", "loss_step", "train_loss", "loss")
    names.sort(key=lambda name: (not name.endswith("_step"), name not in preferred, name))
    if names:
        value = _scalar(metrics[names[0]])
        assert value is not None
        return value, f"the logged metric {names[0]!r}"
    return math.nan, NO_LOSS


def _quiet_lightning() -> None:
    """Keep the two runs' output to warnings that matter: no banner, no hints about workers or logging."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*smaller than the logging interval.*")


def _fit(job: _Job, stage: int | None, world_size: int, rank: int) -> Run:
    model, dataloader, strategy_kwargs, trainer_kwargs = pickle.loads(job.payload)  # a fresh copy per run
    L.seed_everything(job.seed, verbose=False)
    strategy = DDPStrategy(find_unused_parameters=True) if stage is None else _STRATEGIES[stage](**strategy_kwargs)
    recorder = _Recorder()
    kwargs: dict[str, Any] = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        **trainer_kwargs,
    }
    callbacks = kwargs.get("callbacks") or []
    kwargs["callbacks"] = [*(callbacks if isinstance(callbacks, Sequence) else [callbacks]), recorder]
    plugins = kwargs.get("plugins") or []
    plugins = list(plugins) if isinstance(plugins, Sequence) and not isinstance(plugins, str) else [plugins]
    if not any(isinstance(p, ClusterEnvironment) for p in plugins):
        # The ranks come from the variables _worker set, even inside a SLURM or torchelastic job.
        plugins.append(LightningEnvironment())
    kwargs["plugins"] = plugins
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=job.steps, **kwargs)
    trainer.fit(model, train_dataloaders=dataloader)
    # After fit the strategy has torn down: under ZeRO the module holds its full parameters again.
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, Tensor)}
    return Run(
        losses=recorder.losses,
        loss_sources=recorder.sources,
        grad_norms=recorder.grad_norms,
        global_step=trainer.global_step,
        state=state if rank == 0 else None,
    )


def _run_both(rank: int, world_size: int, job: _Job) -> bytes:
    """In each process: the DDP reference, then the stage (results pickled for the caller)."""
    rank_zero_only.rank = utils_rank_zero_only.rank = rank  # Lightning read it at import, before RANK was set
    _quiet_lightning()
    return pickle.dumps({"ddp": _fit(job, None, world_size, rank), "zero": _fit(job, job.stage, world_size, rank)})


def _spawn(job: _Job, world_size: int, timeout: float) -> list[dict[str, Run]]:
    """Run both fits on ``world_size`` processes; every rank's results, by rank."""
    pickled = run_on_cpu_ranks(_run_both, world_size, timeout=timeout, name="check_parity", job=job)
    return [pickle.loads(p) for p in pickled]
