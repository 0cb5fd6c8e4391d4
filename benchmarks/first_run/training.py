"""The variants of the first GPU run, the plain training each is compared with, and the bound it is held to.

[Note: what each variant is held to]
A variant trains the benchmark GPT (``benchmarks.model``) from the same weights on the same batches as plain
single-device training (the model and ``torch.optim.AdamW``, nothing else), in a one-rank process group whose
collectives run for real (``Comm(run_alone=True)``: NCCL on a GPU, gloo on a CPU). With one rank nothing is
sharded and every sum is over one value, so where the arithmetic is the same the result must be too, bit for bit:
the losses of every step and every final parameter (``bitwise``). That covers stages 1-3, the collective checks,
``prefetch=2``, ``"bf16-mixed"`` with ``param_dtype=torch.float32`` (Lightning's own mixed precision, bitwise
equal to DDP in ``docs/precision.md``) and compiled blocks (the same graphs: ``docs/options.md``, "Parity with
inductor"). Under ``offload_optimizer`` / ``offload_params`` the optimizer steps on the host, so the reference
does too (``host_optimizer``: the same AdamW on host copies of the parameters): the same arithmetic again, so
bitwise, on a CPU as on a GPU (``docs/options.md``: "Results are the same as without offload").

Two variants change the arithmetic on purpose, and are held to the bounds the docs state:

- ``"bf16-mixed"`` with the default ``param_dtype`` (the half type: forward and backward on a bf16 compute copy
  over fp32 master shards) against plain training under bf16 autocast: the losses of every step within 1e-2
  relative (``docs/precision.md``, "Measured parity with DDP": each difference is a bf16 rounding, at most 2^-8
  relative). The final parameters within ``2 * lr * steps`` absolute, not the ``0.5 * lr * steps`` of that page:
  Adam moves a parameter by about ``lr`` per step whatever its gradient's size, and the benchmark GPT has
  parameters whose true gradient is exactly zero (the attention key biases, ``docs/parity.md``), whose gradient
  is rounding noise of either sign, so two runs may move them in opposite directions at every step (measured on
  the tiny config: 0.0069 after 4 steps at ``lr=1e-3``). They must also *differ* from plain training, which shows
  the compute copy really is bf16.
- ``quantize_weights="int8"``: the loss of every step within 2% relative of plain training
  (``docs/performance.md``, "Quantized collectives": the test suite holds the final loss to 2%; measured under
  1e-3 over 100 steps), and again not bitwise (every rank dequantizes every shard, its own included).
  ``quantize_grads="int8"`` alone is bitwise here: a rank's own chunk of a reduction never goes through the
  codec (``engine/comm/quantized.py``), and with one rank there is no other.

Each step is the Fabric door's, at the engine level: the step agreement (with collective checks), the step
context around forward and backward, the check for non-finite gradients (``nonfinite_grads="raise"``, whose
flags travel inside the reduce-scatter), the optimizer step on the shards, the post-step all-gathers left in
flight and the next step's first gathers issued (``gather_for_next_step``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from benchmarks.model import BenchConfig, BenchData, BenchGPT, build_model, reference_state_dict

if TYPE_CHECKING:
    from lightning_zero.engine import Comm

LR = 1e-3
OPTIMIZER = {"lr": LR, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
BF16_LOSS_RTOL = 1e-2  # docs/precision.md, "Measured parity with DDP"
BF16_PARAM_STEPS = 2.0  # |dparam| <= 2 * lr * steps: two Adam steps of opposite sign per step (see the Note)
INT8_LOSS_RTOL = 0.02  # docs/performance.md, "Quantized collectives"


@dataclass(frozen=True)
class Variant:
    """One configuration of the engine, and the bound it is held to (see [Note: what each variant is held to])."""

    name: str
    stage: int
    precision: str = "32-true"  # or "bf16-mixed" (autocast)
    param_dtype: torch.dtype | None = None  # under "bf16-mixed": torch.bfloat16 is the strategies' default
    prefetch: int = 1
    offload_optimizer: bool = False
    offload_params: bool = False
    quantize_weights: str | None = None
    quantize_grads: str | None = None
    compiled: bool = False  # each Block compiled, as docs/options.md advises under stage 3
    checks: bool = False  # collective checks on a control channel (the strategies' default)
    bound: str = "bitwise"  # "bitwise", "bf16" or "int8"

    @property
    def reference(self) -> Reference:
        return Reference(self.precision, self.offload_optimizer or self.offload_params, self.compiled)


class Reference(NamedTuple):
    """Plain training: its precision, whether AdamW steps on the host, whether its blocks are compiled."""

    precision: str = "32-true"
    host_optimizer: bool = False
    compiled: bool = False

    def on(self, device: torch.device) -> Reference:
        """The same reference, with what makes no difference on ``device`` dropped (a CPU's host is its device)."""
        return self._replace(host_optimizer=self.host_optimizer and device.type != "cpu")


BF16 = {"precision": "bf16-mixed", "param_dtype": torch.bfloat16, "bound": "bf16"}
VARIANTS = (
    Variant("zero1", 1),
    Variant("zero2", 2),
    Variant("zero3", 3),
    Variant("zero3-checks", 3, checks=True),
    Variant("zero3-prefetch2", 3, prefetch=2),
    Variant("zero2-bf16", 2, **BF16),
    Variant("zero3-bf16", 3, **BF16),
    Variant("zero3-bf16-fp32params", 3, precision="bf16-mixed"),
    Variant("zero2-offload", 2, offload_optimizer=True),
    Variant("zero3-offload", 3, offload_optimizer=True),
    Variant("zero3-offload-params", 3, offload_params=True),
    Variant("zero2-int8-grads", 2, quantize_grads="int8"),  # bitwise at one rank: see the Note
    Variant("zero3-int8", 3, quantize_weights="int8", quantize_grads="int8", bound="int8"),
    Variant("zero3-compile", 3, compiled=True),
)
BY_NAME = {v.name: v for v in VARIANTS}


class Trained(NamedTuple):
    """What a run produced: the loss of every step and the final full state dict (on the CPU)."""

    losses: list[float]
    state: dict[str, torch.Tensor]


def compile_backend(device: torch.device) -> str:
    """inductor on a GPU; on a CPU ``aot_eager`` (Dynamo and AOT autograd without inductor's C++ builds, which take
    minutes on two cores; the graphs, and so the comparison, are the same: docs/options.md)."""
    return "inductor" if device.type == "cuda" else "aot_eager"


def autocast(precision: str, device: torch.device) -> Any:
    return torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16-mixed" else nullcontext()


def fresh_model(config: BenchConfig, device: torch.device, compiled: bool) -> BenchGPT:
    """The benchmark GPT with the reference weights on ``device``, each block compiled if ``compiled``."""
    model = build_model(config, reference_state_dict(config, seed=0), device)
    if compiled:
        torch._dynamo.reset()  # each run compiles its own graphs, whatever ran before
        for block in model.blocks:
            block.compile(backend=compile_backend(device))
    return model


Batch = tuple[torch.Tensor, torch.Tensor]
Forward = Callable[[BenchGPT, torch.Tensor, torch.Tensor], torch.Tensor]


class PlainRun:
    """Plain single-device training: the model and AdamW (on host copies of the parameters with
    ``host_optimizer``, as offload steps), nothing else."""

    def __init__(self, reference: Reference, config: BenchConfig, device: torch.device) -> None:
        self.reference, self.device = reference, device
        self.data = BenchData(config, seed=0)
        self.model = fresh_model(config, device, reference.compiled)
        self.params = list(self.model.parameters())
        self.host: list[nn.Parameter] | None = None
        if reference.host_optimizer:
            self.host = [nn.Parameter(p.detach().to("cpu", copy=True)) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.host or self.params, **OPTIMIZER)

    def batch(self, index: int) -> Batch:
        return self.data.batch(index, 0, self.device)

    def step(self, index: int, batch: Batch | None = None) -> torch.Tensor:
        x, y = batch or self.batch(index)
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        with autocast(self.reference.precision, self.device):
            loss = self.model(x, y)
        loss.backward()
        if self.host is not None:
            for host, param in zip(self.host, self.params):
                host.grad = param.grad.to("cpu")
            self.optimizer.step()
            with torch.no_grad():
                for host, param in zip(self.host, self.params):
                    param.copy_(host)
        else:
            self.optimizer.step()
        return loss.detach()

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def close(self) -> None:
        """Nothing to release (``ShardedRun``'s counterpart)."""


class ShardedRun:
    """``variant`` through ``lightning_zero.engine.ShardedModel`` (one unit per ``Block``) over ``comm`` (default:
    a one-rank ``Comm`` whose collectives run), stepped as the Fabric door steps (see the module's docstring)."""

    def __init__(
        self,
        variant: Variant,
        config: BenchConfig,
        device: torch.device,
        comm: Comm | None = None,
        forward: Forward | None = None,
        rank: int = 0,
    ) -> None:
        from lightning_zero.engine import module_class_policy, shard_model

        self.variant, self.device, self.rank = variant, device, rank
        self.data = BenchData(config, seed=0)
        self.model = fresh_model(config, device, variant.compiled)
        self.forward: Forward = forward or (lambda model, x, y: model(x, y))
        self.comm = comm if comm is not None else one_rank_comm(variant)
        self.sharded = shard_model(
            self.model,
            stage=variant.stage,
            comm=self.comm,
            units=module_class_policy(["Block"]),
            param_dtype=variant.param_dtype,
            offload_optimizer=variant.offload_optimizer,
            offload_params=variant.offload_params,
            prefetch=variant.prefetch,
            quantize_weights=variant.quantize_weights,
            quantize_grads=variant.quantize_grads,
        )
        self.sharded.reducer.check_finite = True  # what the Fabric door sets for nonfinite_grads="raise"
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **OPTIMIZER)
        self.sharded.bind_optimizer(self.optimizer)

    def batch(self, index: int) -> Batch:
        return self.data.batch(index, self.rank, self.device)

    def step(self, index: int, batch: Batch | None = None) -> torch.Tensor:
        x, y = batch or self.batch(index)
        sharded, comm = self.sharded, self.sharded.comm
        self.optimizer.zero_grad(set_to_none=True)
        if comm.control is not None:
            comm.begin_sequence("training", [0, index], lambda: f"training step {index}")
        sharded.begin_step()
        try:
            with autocast(self.variant.precision, self.device):
                loss = self.forward(self.model, x, y)
            loss.backward()
        finally:
            sharded.end_step()
        ranks, names = sharded.nonfinite_grads(self.optimizer)
        if ranks:
            raise FloatingPointError(f"non-finite gradients on rank(s) {ranks}: {names}")
        with sharded.on_shards(self.optimizer):
            self.optimizer.step()
        sharded.after_optimizer_step(self.optimizer)
        sharded.gather_for_next_step()
        return loss.detach()

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.sharded.full_state_dict().items()}

    def close(self) -> None:
        """Free the units gathered ahead for a next step and close the control channel, if any (the process group
        stays for the next run)."""
        self.sharded.free_unused_units()
        if self.comm.control is not None:
            self.comm.control.close()


def one_rank_comm(variant: Variant, comm_class: type[Comm] | None = None, **kwargs: Any) -> Comm:
    """A ``Comm`` over the one-rank process group whose collectives run (``run_alone``), with the collective checks
    on a control channel of their own if ``variant.checks``."""
    from lightning_zero.engine import Comm
    from lightning_zero.engine.comm.control import ControlChannel

    cls = comm_class or Comm
    if variant.checks:
        control = ControlChannel.create(run_alone=True)
        return cls(checks="auto", control=control, run_alone=True, stage=variant.stage, **kwargs)
    return cls(checks="off", run_alone=True, stage=variant.stage, **kwargs)


def train(run: PlainRun | ShardedRun, steps: int, on_step: Callable[[int], Any] | None = None) -> Trained:
    """``steps`` steps of ``run`` (``on_step(index)`` may wrap one: it returns a context manager or ``None``; the
    batch is on the device before it is entered); the losses are read on the host only at the end."""
    losses = []
    for index in range(steps):
        batch = run.batch(index)
        around = on_step(index) if on_step is not None else None
        with around if around is not None else nullcontext():
            losses.append(run.step(index, batch))
    trained = Trained([float(v) for v in torch.stack(losses).tolist()], run.state())
    run.close()
    return trained


def compare(reference: Trained, trained: Trained, bound: str, steps: int) -> tuple[bool, str]:
    """Whether ``trained`` is within ``bound`` of ``reference`` (see [Note: what each variant is held to]), and the
    figures that say so."""
    pairs = list(zip(reference.losses, trained.losses))
    loss_diff = max(abs(a - b) for a, b in pairs)
    loss_rel = max(abs(a - b) / abs(a) for a, b in pairs)
    keys = sorted(set(reference.state) | set(trained.state))
    missing = [k for k in keys if k not in reference.state or k not in trained.state]
    if missing or len(pairs) != len(reference.losses):
        return False, f"state dict keys differ: {missing[:5]}" if missing else "fewer losses than steps"
    param_diffs = {k: _max_diff(reference.state[k], trained.state[k]) for k in keys}
    worst = max(param_diffs, key=param_diffs.__getitem__)
    equal = loss_diff == 0 and all(torch.equal(reference.state[k], trained.state[k]) for k in keys)
    figures = f"max |dloss| {loss_diff:.3g} (rel {loss_rel:.3g}), max |dparam| {param_diffs[worst]:.3g} ({worst})"
    if bound == "bitwise":
        return equal, ("bitwise: every loss and parameter equal" if equal else figures)
    if equal:
        return False, f"bitwise equal to plain training: the {bound} path did not run ({figures})"
    if bound == "bf16":
        param_bound = BF16_PARAM_STEPS * LR * steps
        ok = loss_rel <= BF16_LOSS_RTOL and param_diffs[worst] <= param_bound
        return ok, f"{figures}; bounds: rel {BF16_LOSS_RTOL:g}, |dparam| {param_bound:.3g}"
    if bound == "int8":
        return loss_rel <= INT8_LOSS_RTOL, f"{figures}; bound: rel {INT8_LOSS_RTOL:g}"
    raise ValueError(f"unknown bound {bound!r}")


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else float("inf")
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
