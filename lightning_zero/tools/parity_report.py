"""What ``check_parity`` measured and how it reads (``ParityReport``), from the runs each rank recorded (``Run``):
the comparison of the DDP reference with the ZeRO run, step by step and entry by entry (see ``parity.py``).

Example::

    report = compare_runs(3, 2, 5, 1e-5, ddp_runs, zero_runs, initial_state)
    print(report)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

# A relative difference divides by the reference; this keeps an exact zero from dividing by zero.
_TINY = torch.finfo(torch.float32).tiny
FROM_STEP = "training_step's output"  # where a loss came from, in words
NO_LOSS = "nowhere"


@dataclass
class Run:
    """What one rank recorded of one fit (``check_parity`` runs two per rank), sent back to the caller pickled."""

    losses: list[float]  # per training batch, this rank's own
    loss_sources: list[str]  # where the losses came from, in words
    grad_norms: list[float]  # per optimizer step
    global_step: int
    state: dict[str, Tensor] | None  # the final full state dict, rank 0 only


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
        return scalar_diff(*self.losses[-1])[1]

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


def scalar_diff(reference: float, value: float) -> tuple[float, float]:
    """``(abs, rel)`` difference of two scalars; two NaNs (or equal infinities) count as equal."""
    if reference == value or (math.isnan(reference) and math.isnan(value)):
        return 0.0, 0.0
    delta = abs(value - reference)
    if math.isnan(delta):  # one NaN, or infinities of opposite sign
        return math.inf, math.inf
    return delta, delta / max(abs(reference), _TINY)


def tensor_diff(reference: Tensor, value: Tensor) -> tuple[float, float]:
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


def compare_runs(
    stage: int,
    world_size: int,
    steps: int,
    rtol: float,
    ddp: Sequence[Run],
    zero: Sequence[Run],
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
            abs_diff, rel_diff = scalar_diff(a, b)
            max_abs_loss, max_rel_loss = max(max_abs_loss, abs_diff), max(max_rel_loss, rel_diff)
    count = min(len(run.losses) for run in (*ddp, *zero))
    losses = [
        (sum(run.losses[i] for run in ddp) / len(ddp), sum(run.losses[i] for run in zero) / len(zero))
        for i in range(count)
    ]
    for label, run in (("ddp", ddp[0]), (name, zero[0])):
        if run.loss_sources and run.loss_sources not in ([FROM_STEP], [NO_LOSS]):
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
        max_rel_norm = max([max_rel_norm, *(scalar_diff(a, b)[1] for a, b in zip(ref.grad_norms, got.grad_norms))])
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
        abs_diff, rel_diff = tensor_diff(ref, got)
        max_abs_param = max(max_abs_param, abs_diff)
        if abs_diff > 0 and (worst is None or rel_diff > max_rel_param):
            worst, max_rel_param = key, rel_diff
    if ref_state.keys() == initial.keys() and all(
        ref_state[k].shape == v.shape and tensor_diff(v, ref_state[k])[0] == 0 for k, v in initial.items()
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
    return f"{a:.6g}", f"{b:.6g}", f"{scalar_diff(a, b)[1]:.2g}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    return ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in (header, *rows)]
