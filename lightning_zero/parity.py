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
from dataclasses import dataclass, field
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

from lightning_zero.processes import run_on_cpu_ranks
from lightning_zero.strategies import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy, ZeROStrategy

__all__ = ["ParityReport", "check_parity"]

_STRATEGIES: dict[int, type[ZeROStrategy]] = {1: ZeRO1Strategy, 2: ZeRO2Strategy, 3: ZeRO3Strategy}
# Trainer arguments the checker sets itself: the comparison is only meaningful with these.
_RESERVED_TRAINER_ARGS = ("accelerator", "devices", "num_nodes", "strategy", "max_steps")
# A relative difference divides by the reference; this keeps an exact zero from dividing by zero.
_TINY = torch.finfo(torch.float32).tiny
_FROM_STEP = "training_step's output"
_NO_LOSS = "nowhere"


@dataclass
class ParityReport:
    """What ``check_parity`` measured: the ``DDPStrategy`` run is the reference, the ZeRO run is compared to it.

    Relative differences divide by the reference's magnitude: ``|zero - ddp| / |ddp|`` for a loss or a
    gradient norm, ``max|zero - ddp| / max|ddp|`` over the elements of a state-dict tensor (relative to
    the tensor's scale, so elements near zero do not inflate it). Two NaNs count as equal.

    Attributes:
        stage: The ZeRO stage compared with DDP (1, 2 or 3).
        world_size: The number of processes both runs used.
        steps: The number of optimizer steps each run was asked for (``max_steps``).
        losses: ``(ddp, zero)`` per training batch: the loss from ``training_step``, averaged over ranks
            (NaN where no loss could be read; see ``notes``).
        max_abs_loss_diff: The largest ``|zero - ddp|`` over all batches and all ranks' own losses.
        max_rel_loss_diff: The largest relative loss difference, likewise over all batches and ranks.
        grad_norms: ``(ddp, zero)`` per optimizer step (one per optimizer that steps): the global 2-norm
            of the gradients before clipping.
        max_rel_grad_norm_diff: The largest relative gradient-norm difference.
        max_abs_param_diff: The largest element-wise difference over the final state dict (parameters
            and buffers).
        max_rel_param_diff: The largest relative difference of a state-dict tensor.
        worst_param: The state-dict key with the largest relative difference; ``None`` when every entry
            is equal.
        rtol: The tolerance ``ok`` was judged with.
        param_drift: ``||zero - ddp|| / ||ddp||`` over every floating-point entry of the final state dict (one L2
            norm over all of them): how far the ZeRO run's parameters are from the exact run's.
        param_drift_of_update: ``||zero - ddp|| / ||ddp - initial||``: the same against how far the exact run
            moved the parameters from where both started.
        quantized: The ZeRO run's ``quantize_*`` options (``""`` when it is exact): then the report measures the
            drift quantization costs (the verdict reads ``DRIFT`` instead of ``MISMATCH``).
        ok: Whether the runs had the same structure (batches, optimizer steps, state-dict keys and
            shapes) and every relative difference above is at most ``rtol``.
        notes: Anything that limited the comparison or made it fail, in words.
    """

    stage: int
    world_size: int
    steps: int
    losses: list[tuple[float, float]]
    max_abs_loss_diff: float
    max_rel_loss_diff: float
    grad_norms: list[tuple[float, float]]
    max_rel_grad_norm_diff: float
    max_abs_param_diff: float
    max_rel_param_diff: float
    worst_param: str | None
    rtol: float
    ok: bool
    notes: list[str] = field(default_factory=list)
    quantized: str = ""  # the quantize_* options of the ZeRO run ("" for an exact run): its drift is measured
    param_drift: float = 0.0  # ||zero - ddp|| / ||ddp|| over every floating-point state-dict entry (L2)
    param_drift_of_update: float = 0.0  # ||zero - ddp|| / ||ddp - initial||: the drift against what training moved

    @property
    def final_loss_rel_diff(self) -> float:
        """``|zero - ddp| / |ddp|`` of the last batch's loss (averaged over ranks); NaN without losses."""
        if not self.losses:
            return math.nan
        return _diff(*self.losses[-1])[1]

    def __str__(self) -> str:
        name = f"zero{self.stage}"
        verdict = "OK" if self.ok else ("DRIFT" if self.quantized else "MISMATCH")
        configuration = f" ({self.quantized})" if self.quantized else ""
        lines = [
            f"lightning_zero parity check: {name}{configuration} vs ddp, {self.world_size} process(es), "
            f"{self.steps} step(s), rtol {self.rtol:g}: {verdict}"
        ]
        if len(self.losses) == len(self.grad_norms):
            header = ("step", "loss ddp", f"loss {name}", "rel diff", "grad norm ddp", f"grad norm {name}", "rel diff")
            rows = [
                (str(i), *_pair_cells(loss), *_pair_cells(norm))
                for i, (loss, norm) in enumerate(zip(self.losses, self.grad_norms))
            ]
            lines += _table(header, rows)
        else:  # gradient accumulation or several optimizers: batches and optimizer steps do not line up
            lines += _table(
                ("batch", "loss ddp", f"loss {name}", "rel diff"),
                [(str(i), *_pair_cells(p)) for i, p in enumerate(self.losses)],
            )
            lines += _table(
                ("opt step", "grad norm ddp", f"grad norm {name}", "rel diff"),
                [(str(i), *_pair_cells(p)) for i, p in enumerate(self.grad_norms)],
            )
        worst = f" ({self.worst_param})" if self.worst_param is not None else " (all equal)"
        if self.quantized:
            lines += [
                f"final loss diff:    rel {self.final_loss_rel_diff:.3g} (the price of {self.quantized})",
                f"parameter drift:    rel {self.param_drift:.3g} of the parameters (L2), "
                f"{self.param_drift_of_update:.3g} of what training moved them",
            ]
        lines += [
            f"max loss diff:      abs {self.max_abs_loss_diff:.3g}, rel {self.max_rel_loss_diff:.3g} (any rank)",
            f"max grad-norm diff: rel {self.max_rel_grad_norm_diff:.3g}",
            f"max param diff:     abs {self.max_abs_param_diff:.3g}, rel {self.max_rel_param_diff:.3g}{worst}",
        ]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


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
    report = _report(stage, world_size, steps, rtol, [r["ddp"] for r in results], [r["zero"] for r in results], initial)
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


@dataclass
class _Run:
    losses: list[float]  # per training batch, this rank's own
    loss_sources: list[str]  # where the losses came from, in words
    grad_norms: list[float]  # per optimizer step
    global_step: int
    state: dict[str, Tensor] | None  # the final full state dict, rank 0 only


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
        return value, _FROM_STEP
    if isinstance(outputs, Mapping) and (value := _scalar(outputs.get("loss"))) is not None:
        return value, _FROM_STEP  # Lightning turns a returned tensor into {"loss": tensor}
    names = [name for name in metrics if "loss" in name.lower() and _scalar(metrics[name]) is not None]
    # The per-step value of a metric logged with on_step=True and on_epoch=True first, then the usual names.
    preferred = ("train_loss_step", "loss_step", "train_loss", "loss")
    names.sort(key=lambda name: (not name.endswith("_step"), name not in preferred, name))
    if names:
        value = _scalar(metrics[names[0]])
        assert value is not None
        return value, f"the logged metric {names[0]!r}"
    return math.nan, _NO_LOSS


def _quiet_lightning() -> None:
    """Keep the two runs' output to warnings that matter: no banner, no hints about workers or logging."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*smaller than the logging interval.*")


def _fit(job: _Job, stage: int | None, world_size: int, rank: int) -> _Run:
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
    return _Run(
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


def _spawn(job: _Job, world_size: int, timeout: float) -> list[dict[str, _Run]]:
    """Run both fits on ``world_size`` processes; every rank's results, by rank."""
    pickled = run_on_cpu_ranks(_run_both, world_size, timeout=timeout, name="check_parity", job=job)
    return [pickle.loads(p) for p in pickled]


def _diff(reference: float, value: float) -> tuple[float, float]:
    """``(abs, rel)`` difference of two scalars; two NaNs (or equal infinities) count as equal."""
    if reference == value or (math.isnan(reference) and math.isnan(value)):
        return 0.0, 0.0
    delta = abs(value - reference)
    if math.isnan(delta):  # one NaN, or infinities of opposite sign
        return math.inf, math.inf
    return delta, delta / max(abs(reference), _TINY)


def _tensor_diff(reference: Tensor, value: Tensor) -> tuple[float, float]:
    """``(max |value - reference|, that / max |reference|)``; NaNs in the same places count as equal."""
    if reference.numel() == 0:
        return 0.0, 0.0
    ref, val = reference.detach().double(), value.detach().double()
    both_nan = ref.isnan() & val.isnan()
    delta = (val - ref).abs().masked_fill(both_nan | (ref == val), 0.0)
    largest = float(delta.max())
    if math.isnan(largest):
        return math.inf, math.inf
    scale = float(ref.abs().masked_fill(ref.isnan(), 0.0).max())
    return largest, largest / max(scale, _TINY)


def _report(
    stage: int,
    world_size: int,
    steps: int,
    rtol: float,
    ddp: Sequence[_Run],
    zero: Sequence[_Run],
    initial: Mapping[str, Tensor],
) -> ParityReport:
    """Compare the runs: ``ddp`` and ``zero`` hold every rank's results, by rank."""
    name = f"zero{stage}"
    notes: list[str] = []
    structure_ok = True

    # Losses: every rank's own, so that a difference on one rank is not averaged away.
    max_abs_loss = max_rel_loss = 0.0
    for rank, (ref, got) in enumerate(zip(ddp, zero)):
        if len(ref.losses) != len(got.losses):
            structure_ok = False
            notes.append(f"rank {rank}: ddp ran {len(ref.losses)} training batches, {name} {len(got.losses)}")
        for a, b in zip(ref.losses, got.losses):
            abs_diff, rel_diff = _diff(a, b)
            max_abs_loss, max_rel_loss = max(max_abs_loss, abs_diff), max(max_rel_loss, rel_diff)
    count = min(len(run.losses) for run in (*ddp, *zero))
    losses = [
        (sum(run.losses[i] for run in ddp) / len(ddp), sum(run.losses[i] for run in zero) / len(zero))
        for i in range(count)
    ]
    for label, run in (("ddp", ddp[0]), (name, zero[0])):
        if run.loss_sources and run.loss_sources not in ([_FROM_STEP], [_NO_LOSS]):
            notes.append(f"{label}: losses read from {' and '.join(run.loss_sources)}")
    if losses and all(math.isnan(a) and math.isnan(b) for a, b in losses):
        notes.append(
            "no loss could be read (training_step returned none and no metric named '*loss*' was logged), so "
            "losses were not compared; log one with self.log('train_loss', loss) to compare them"
        )

    # Gradient norms: global, so the same on every rank; compared on every rank all the same.
    max_rel_norm = 0.0
    for rank, (ref, got) in enumerate(zip(ddp, zero)):
        if len(ref.grad_norms) != len(got.grad_norms):
            structure_ok = False
            notes.append(f"rank {rank}: ddp took {len(ref.grad_norms)} optimizer steps, {name} {len(got.grad_norms)}")
        max_rel_norm = max([max_rel_norm, *(_diff(a, b)[1] for a, b in zip(ref.grad_norms, got.grad_norms))])
    grad_norms = list(zip(ddp[0].grad_norms, zero[0].grad_norms))
    if ddp[0].global_step != zero[0].global_step:
        structure_ok = False
        notes.append(f"ddp ended at global step {ddp[0].global_step}, {name} at {zero[0].global_step}")

    # The final state dict (rank 0's; parameters are the same on every rank under both strategies).
    ref_state, got_state = ddp[0].state or {}, zero[0].state or {}
    for key in sorted(set(ref_state) ^ set(got_state)):
        structure_ok = False
        notes.append(f"state-dict key {key!r} only under {'ddp' if key in ref_state else name}")
    max_abs_param = max_rel_param = 0.0
    worst: str | None = None
    for key in (k for k in ref_state if k in got_state):
        ref, got = ref_state[key], got_state[key]
        if ref.shape != got.shape:
            structure_ok = False
            notes.append(f"{key}: shape {tuple(ref.shape)} under ddp, {tuple(got.shape)} under {name}")
            continue
        abs_diff, rel_diff = _tensor_diff(ref, got)
        max_abs_param = max(max_abs_param, abs_diff)
        if abs_diff > 0 and (worst is None or rel_diff > max_rel_param):
            worst, max_rel_param = key, rel_diff
    if ref_state.keys() == initial.keys() and all(
        ref_state[k].shape == v.shape and _tensor_diff(v, ref_state[k])[0] == 0 for k, v in initial.items()
    ):
        notes.append("the ddp run left every parameter unchanged: equal parameters prove little here")

    if max_rel_param > rtol and max(max_rel_loss, max_rel_norm) <= rtol:
        notes.append(
            f"losses and gradient norms agree but {worst} does not: typical of a parameter whose gradient is "
            "(close to) zero, e.g. a bias right before a normalization layer, under an adaptive optimizer (Adam, "
            "RMSprop, Adagrad) that turns rounding-level gradients into full-size steps; sums over 2 ranks are "
            "exact, so world_size=2 tells such rounding from a real difference"
        )
    ok = structure_ok and max(max_rel_loss, max_rel_norm, max_rel_param) <= rtol
    drift, moved, size = 0.0, 0.0, 0.0  # squared L2 norms over the floating-point entries both runs have
    for key in (k for k in ref_state if k in got_state and k in initial):
        ref, got, start = ref_state[key], got_state[key], initial[key]
        if ref.is_floating_point() and ref.shape == got.shape == start.shape:
            drift += float((got.double() - ref.double()).square().sum())
            moved += float((ref.double() - start.double()).square().sum())
            size += float(ref.double().square().sum())
    return ParityReport(
        stage=stage,
        world_size=world_size,
        steps=steps,
        losses=losses,
        max_abs_loss_diff=max_abs_loss,
        max_rel_loss_diff=max_rel_loss,
        grad_norms=grad_norms,
        max_rel_grad_norm_diff=max_rel_norm,
        max_abs_param_diff=max_abs_param,
        max_rel_param_diff=max_rel_param,
        worst_param=worst,
        rtol=rtol,
        ok=ok,
        notes=notes,
        param_drift=math.sqrt(drift / size) if size else 0.0,
        param_drift_of_update=math.sqrt(drift / moved) if moved else 0.0,
    )


def _pair_cells(pair: tuple[float, float]) -> tuple[str, str, str]:
    a, b = pair
    return f"{a:.6g}", f"{b:.6g}", f"{_diff(a, b)[1]:.2g}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    return ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in (header, *rows)]
