"""Backward that frees as it goes, bounded buffers, no host syncs on the step path.

Every check runs the real engine on 2 gloo ranks and compares with DDP on the same seed and data:

- peak units gathered at once during backward (stage 3) and full gradients alive at once (stage 2) on a
  model with an unused unit, one whose modules run in another order than they are registered, and a
  LoRA-style model with frozen weights (see [Note: reduce order] in ``reduce_order.py`` and [Note: frozen
  units] in ``stage3.py``);
- one end-of-backward callback under reentrant activation checkpointing ([Note: one end of backward]);
- host reads (``aten._local_scalar_dense``, which ``item()``, ``bool()`` and ``tolist()`` lower to) on
  the step path: at most one per step;
- live memory just before the optimizer step, every tensor counted, with the strategies' defaults.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy
from lightning_zero.engine import Comm, ShardedModel, shard_model
from lightning_zero.engine.core.grouping import module_class_policy
from tests.distributed import spawn
from tests.memory_tracker import live_bytes_since, live_storages
from tests.models import quiet_trainer

WIDTH, BLOCKS, STEPS = 16, 6, 3


class Block(nn.Module):
    def __init__(self, lora: bool = False, frozen: bool = False) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH)
        self.lora_a = nn.Linear(WIDTH, 4, bias=False) if lora else None
        self.lora_b = nn.Linear(4, WIDTH, bias=False) if lora else None
        if lora or frozen:
            self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.lora_a is not None:
            y = y + self.lora_b(self.lora_a(x))
        return torch.tanh(y)


class Stack(nn.Module):
    """``kind``: "unused" (a block that never runs, registered in the middle), "shuffled" (blocks run in
    another order than registered), "lora" (frozen base weights, trainable adapters; one block wholly frozen)."""

    RUN_ORDER = (3, 5, 1, 0, 4, 2)

    def __init__(self, kind: str, reentrant: bool = False) -> None:
        super().__init__()
        self.kind = kind
        self.reentrant = reentrant
        lora = kind == "lora"
        self.blocks = nn.ModuleList(Block(lora=lora and i != 2, frozen=lora and i == 2) for i in range(BLOCKS))
        self.spare = Block() if kind == "unused" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = self.RUN_ORDER if self.kind == "shuffled" else range(BLOCKS)
        for position, index in enumerate(order):
            block = self.blocks[index]
            # Reentrant checkpointing needs an input that requires a gradient: not the first block's.
            x = checkpoint(block, x, use_reentrant=True) if self.reentrant and position else block(x)
        return x


def _data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))


def _ddp_run(kind: str, reentrant: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Stack(kind)
    ddp = DistributedDataParallel(model, find_unused_parameters=kind == "unused")
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = ddp(_data(dist.get_rank(), step)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


class _Peaks:
    """Samples, from a gradient hook on every parameter (run after the engine's own), how many block units are
    gathered and how many full gradients are alive."""

    def __init__(self, sharded: ShardedModel) -> None:
        self.gathered: list[int] = []  # per step
        self.full_grads: list[int] = []
        self.eval_prefetched: list[int] = []
        units = [u for u in sharded.units if u is not sharded.root_unit]
        params = [p for u in sharded.units for p in u.params]

        def sample(_param: torch.Tensor) -> None:
            self.gathered[-1] = max(self.gathered[-1], sum(u.is_unsharded for u in units))

        def count_grads(grad: torch.Tensor) -> None:  # before this one accumulates: the others alive now
            alive = sum(p.grad is not None and not sharded.reducer.is_marker(p) for p in params)
            self.full_grads[-1] = max(self.full_grads[-1], alive)

        for param in params:
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(sample)
                param.register_hook(count_grads)


def _engine_run(
    kind: str, stage: int, reentrant: bool = False
) -> tuple[list[float], dict[str, torch.Tensor], _Peaks, list[int]]:
    torch.manual_seed(0)
    model = Stack(kind, reentrant)
    sharded = shard_model(model, stage=stage, comm=Comm(), units=module_class_policy([Block]))
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sharded.bind_optimizer(opt)
    peaks = _Peaks(sharded)
    ends: list[int] = []
    finish = sharded.reducer.finish_backward

    def counted_finish() -> None:
        ends[-1] += 1
        finish()

    sharded.reducer.finish_backward = counted_finish  # type: ignore[method-assign]
    losses = []
    for step in range(STEPS):
        ends.append(0)
        peaks.gathered.append(0)
        peaks.full_grads.append(0)
        with sharded.step_context():
            loss = model(_data(dist.get_rank(), step)).square().mean()
            loss.backward()
        opt.step()
        sharded.after_optimizer_step(opt)
        opt.zero_grad()
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in sharded.full_state_dict().items()}
    peaks.eval_prefetched = _eval_prefetched(sharded, model) if stage == 3 else []
    sharded.release()
    return losses, state, peaks, ends


def _eval_prefetched(sharded: ShardedModel, model: Stack) -> list[int]:
    """Per evaluation step (under ``no_grad``): how many blocks found the next block's gather already issued when
    they started (see [Note: prefetch]: the first evaluation step records, the next ones prefetch)."""
    blocks = [model.blocks[i] for i in (Stack.RUN_ORDER if model.kind == "shuffled" else range(BLOCKS))]
    unit_of = {id(u.module): u for u in sharded.units}
    prefetched: list[int] = []

    def check(module: nn.Module, _args: Any) -> None:  # registered after the engine's own pre-hook
        position = blocks.index(module)
        if position + 1 < len(blocks) and unit_of[id(blocks[position + 1])].is_unsharded:
            prefetched[-1] += 1

    handles = [block.register_forward_pre_hook(check) for block in blocks]
    for step in range(2):
        prefetched.append(0)
        with torch.no_grad():
            sharded.begin_step(training=False)
            try:
                model(_data(dist.get_rank(), step))
            finally:
                sharded.end_step()
    for handle in handles:
        handle.remove()
    return prefetched


def _frees_as_it_goes(rank: int, world_size: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for kind in ("unused", "shuffled", "lora"):
        losses, state = _ddp_run(kind)
        for stage in (2, 3):
            for reentrant in (False, True) if stage == 3 or kind == "lora" else (False,):
                got_losses, got_state, peaks, ends = _engine_run(kind, stage, reentrant)
                where = f"{kind} stage {stage} reentrant={reentrant}"
                assert got_losses == losses, (where, got_losses, losses)
                for name, value in state.items():
                    assert torch.equal(got_state[name], value), (where, name)
                assert ends == [1] * STEPS, (where, "one end-of-backward callback per backward", ends)
                found[where] = (peaks.gathered, peaks.full_grads)
                if stage == 3:  # the first evaluation step records the order, the second prefetches along it
                    assert peaks.eval_prefetched == [0, BLOCKS - 1], (where, "evaluation", peaks.eval_prefetched)
    return found


def test_backward_frees_units_and_gradients_as_it_goes_whatever_the_order() -> None:
    per_rank = spawn(_frees_as_it_goes, world_size=2)
    assert per_rank[0] == per_rank[1]
    for where, (per_step_gathered, per_step_full_grads) in per_rank[0].items():
        # From the second step on: the first one reduces in reverse registration order while it records.
        gathered, full_grads = max(per_step_gathered[1:]), max(per_step_full_grads[1:])
        if "stage 3" in where:
            # The unit in backward, the one prefetched (prefetch=1), one not freed yet: prefetch + 2 at most.
            assert gathered <= 1 + 2, (where, per_step_gathered)
        # Full gradients of at most two units (two Linear layers each, or two adapters under LoRA) alive at once.
        assert full_grads <= 2 * 2, (where, per_step_full_grads)


# ---------------------------------------------------------------------------------------------- host syncs


class HostReads(TorchDispatchMode):
    """Counts reads of tensor values on the host: ``aten._local_scalar_dense`` (what ``item()``, ``bool()`` and
    ``tolist()`` lower to) and copies from a non-CPU tensor to the CPU. On a CUDA device each is a wait for the
    device; on CPU runs the first kind still shows where the code would wait."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __enter__(self) -> HostReads:
        # ``tolist()`` of a CPU tensor reads memory without an aten op (of a device tensor it copies to the CPU
        # first, which is counted below): counted here.
        tolist = self._tolist = torch.Tensor.tolist

        def counted(tensor: torch.Tensor) -> Any:
            self.reads += 1
            return tolist(tensor)

        torch.Tensor.tolist = counted  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            target = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device")
            if isinstance(source, torch.Tensor) and source.device.type != "cpu" and str(target) == "cpu":
                self.reads += 1
        return func(*args, **kwargs)


class EngineHostReads(TorchDispatchMode):
    """The host reads (as ``HostReads`` counts them) that this library's code makes, each named by the nearest
    frame of ``lightning_zero`` past the helper that waits for the device (``device_wait.py``): Lightning's and the
    test's own reads are not the engine's. Reads in ``control.py`` are left out: its agreement rows live in host
    memory (a CPU gloo group) on every machine, never on a device."""

    def __init__(self) -> None:
        super().__init__()
        self.where: list[str] = []

    def _record(self) -> None:
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename
            if f"{os.sep}lightning_zero{os.sep}" in path and not path.endswith("device_wait.py"):
                if not path.endswith("control.py"):
                    self.where.append(f"{os.path.basename(path)}:{frame.f_code.co_name}")
                return
            frame = frame.f_back

    def __enter__(self) -> EngineHostReads:
        tolist = self._tolist = torch.Tensor.tolist

        def recorded(tensor: torch.Tensor) -> Any:
            self._record()
            return tolist(tensor)

        torch.Tensor.tolist = recorded  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self._record()
        return func(*args, **(kwargs or {}))


class HostReadsPerBatch(Callback):
    """The engine's host reads (``EngineHostReads``) in each training batch from the third on: those inside the
    backward pass, and the others (the optimizer step's, for the batch that ends an accumulation)."""

    def __init__(self) -> None:
        self.batches: list[tuple[list[str], list[str]]] = []
        self._mode: EngineHostReads | None = None
        self._backward: list[str] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, index: int) -> None:
        if index >= 2:
            self._mode = EngineHostReads().__enter__()
            self._backward = []

    def on_before_backward(self, *_: Any) -> None:
        if self._mode is not None:
            self._mark = len(self._mode.where)

    def on_after_backward(self, *_: Any) -> None:
        if self._mode is not None:
            self._backward += self._mode.where[self._mark :]
            del self._mode.where[self._mark :]

    def on_train_batch_end(self, *_: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.batches.append((self._backward, self._mode.where))
            self._mode = None


class BlockNet(L.LightningModule):
    """Six blocks (a unit each under every stage: ``unit_modules``), SGD with momentum."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block() for _ in range(BLOCKS)))

    def training_step(self, batch: Any, _index: int) -> torch.Tensor:
        return self.blocks(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(0))), 4)


def _trainer_host_reads() -> dict[str, list[tuple[list[str], list[str]]]]:
    """Through a real Trainer, ``accumulate_grad_batches=2``: the engine's host reads in each steady batch."""
    found = {}
    for name, strategy in (("zero1", ZeRO1Strategy), ("zero2", ZeRO2Strategy), ("zero3", ZeRO3Strategy)):
        probe = HostReadsPerBatch()
        L.seed_everything(0)
        trainer = quiet_trainer(
            strategy=strategy(unit_modules=[Block]),
            devices=2,
            max_steps=4,
            accumulate_grad_batches=2,
            callbacks=[probe],
        )
        trainer.fit(BlockNet())
        found[name] = probe.batches
    return found


def _host_reads(rank: int, world_size: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    found = {}
    for kind, check_finite in (("lora", True), ("lora", False)):
        for stage in (1, 2, 3):
            torch.manual_seed(0)
            model = Stack(kind)
            # Stage 3's collective checks (comm.py) are outside this count: "off" leaves only the step's own reads.
            sharded = shard_model(model, stage=stage, comm=Comm(checks="off"), units=module_class_policy([Block]))
            # As under Fabric's nonfinite_grads policy (True) or the Trainer (False: the flags ride in the reductions).
            sharded.reducer.check_finite = check_finite
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2, momentum=0.9)
            sharded.bind_optimizer(opt)
            per_step = []
            for step in range(STEPS):
                # Forward and backward (two micro-batches from the second step on: gradient accumulation), then the
                # check for inf/NaN that the strategies run (known from the flags), optimizer step, parameters spread
                # again. The flags of every backward pass are read once, at the step (see [Note: flags read at the
                # step] in grad_flags.py).
                micro_batches = 2 if step else 1
                backward = []
                for micro in range(micro_batches):
                    with HostReads() as counter, sharded.step_context():
                        model(_data(rank, 10 * step + micro)).square().mean().backward()
                    backward.append(counter.reads)
                with HostReads() as counter:
                    if check_finite:
                        assert sharded.nonfinite_grads(opt) == ([], [])
                    opt.step()
                    sharded.after_optimizer_step(opt)
                    opt.zero_grad()
                per_step.append((backward, counter.reads))
            found[f"{kind} stage {stage}{' checking inf/NaN' if check_finite else ''}"] = per_step
            sharded.release()
    return found, _slots_catch_nonfinite(rank), _trainer_host_reads()


def _slots_catch_nonfinite(rank: int) -> dict[str, Any]:
    """A NaN on rank 1 only is known on both ranks from the reductions' slots; finite gradients whose reduction
    overflows are caught by the ranks whose shards hold the inf (both here: each holds one overflowed element)."""
    torch.manual_seed(0)
    net = nn.Linear(2, 1, bias=False)
    sharded = shard_model(net, stage=2, comm=Comm(checks="off"))
    sharded.reducer.check_finite = True
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sharded.bind_optimizer(opt)
    seen: dict[str, Any] = {}
    # Overflow: each rank's gradients are finite and so is their sum (2e38 - 2e38), but the reduction's 2 x 2e38 is not.
    overflow = torch.tensor([[2e38, -2e38]])
    for case, scale in (("first", 1.0), ("nan on rank 1", float("nan") if rank == 1 else 1.0), ("overflow", overflow)):
        opt.zero_grad()
        try:
            with HostReads() as counter:
                with sharded.step_context():
                    (net.weight * scale).sum().backward()
                sharded.settle_grads()
            seen[case] = ([u.grads_finite for u in sharded.units], counter.reads, sharded.nonfinite_grads(opt)[0])
        except Exception as error:  # what each rank sees
            seen[case] = f"{type(error).__name__}: {error}"
    sharded.release(gather=False)
    return seen


def test_at_most_one_host_read_per_step() -> None:
    for found, slots, trainer in spawn(_host_reads, world_size=2):
        # A NaN on one rank: every rank knows (grads_finite False) from one read, and the check names rank 1.
        assert slots["nan on rank 1"] == ([False], 2, [0, 1]), slots  # the slots' read, then the exact path's (shards)
        assert "FloatingPointError" in slots["overflow"] and "overflowed on this rank" in slots["overflow"], slots
        for where, per_step in found.items():
            # The first backward pass settles the reduce order (one read there, none at its step); from then on no
            # backward pass reads anything, and each optimizer step reads the flags of its micro-batches once,
            # whether or not it checks for inf/NaN (an accumulated gradient's sum rides in the same read).
            assert per_step[0] == ([1], 0), (where, per_step)
            assert per_step[1:] == [([0, 0], 1)] * (STEPS - 1), (where, per_step)
        # Through the Trainer, under every stage: nothing read inside any micro-batch's backward pass, nothing in
        # a micro-batch that does not step, and one read per optimizer step, of its micro-batches' flags (the
        # default nonfinite_grads="raise" decides from it).
        for name, batches in trainer.items():
            assert len(batches) == 6, (name, batches)
            for index, (backward, rest) in enumerate(batches, start=2):
                assert backward == [], (name, index, backward)
                assert rest == (["grads.py:settle"] if index % 2 else []), (name, index, rest)


# ---------------------------------------------------------------------------------- the placeholders' cost


class PlaceholderCalls(Callback):
    """Calls of the stage-3 placeholder and the arriving classes' ``__torch_function__`` (see ``placeholder.py`` and
    ``arriving.py``) made by the engine's code, from the end of the first training batch to the end of the last: the
    step path, agreements included. (The user's own reads, such as ``optimizer.zero_grad()`` clearing the ``.grad``
    of a stage-3 parameter whose unit is sharded, go through the class as any read by user code does.)"""

    def __init__(self, counter: list[int]) -> None:
        self.counter = counter
        self.start = self.end = -1

    def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        if trainer.global_step == 1:
            self.start = self.counter[0]
        self.end = self.counter[0]


def _placeholder_calls(rank: int, world_size: int) -> dict[str, int]:
    from lightning_zero.engine.core import arriving, placeholder

    counter = [0]
    for cls in (placeholder._Hidden, arriving._Arriving):
        original = cls.__dict__["__torch_function__"].__func__

        def counting(klass: type, func: Any, types: Any, args: tuple = (), kwargs: Any = None, _o: Any = original):
            caller = sys._getframe(1)  # the Python code whose torch call this is
            while caller is not None and caller.f_code.co_filename.endswith(("placeholder.py", "arriving.py")):
                caller = caller.f_back
            if caller is not None and f"{os.sep}lightning_zero{os.sep}" in caller.f_code.co_filename:
                counter[0] += 1
            return _o(klass, func, types, args, kwargs)

        cls.__torch_function__ = classmethod(counting)
    found = {}
    for name, strategy in (("zero1", ZeRO1Strategy()), ("zero2", ZeRO2Strategy()), ("zero3", ZeRO3Strategy())):
        probe = PlaceholderCalls(counter)
        L.seed_everything(0)
        quiet_trainer(strategy=strategy, devices=2, max_steps=4, callbacks=[probe]).fit(MLP())
        found[name] = probe.end - probe.start
    return found


def test_the_step_path_reads_no_parameter_through_its_placeholder_class() -> None:
    # Between steps, stage-3 parameters are placeholders and those of stages 1 and 2 wait for their post-step
    # gather, both behind a ``__torch_function__`` that costs microseconds per call. The engine's own reads (the
    # trainable set each step agreement hashes, the version counters of hidden parameters) go past it: on a small
    # model a call per parameter per read was a few percent of the step.
    for found in spawn(_placeholder_calls, world_size=2):
        assert found == {"zero1": 0, "zero2": 0, "zero3": 0}, found


# ---------------------------------------------------------------------------------------------- live memory


class MLP(L.LightningModule):
    """About 2.1M parameters, fp32 Adam."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 768), nn.ReLU()
        )
        self.head = nn.Linear(768, 16)

    def training_step(self, batch: Any, _batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.layers(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(32, 256, generator=g), torch.randint(0, 16, (32,), generator=g)), 8)


class LiveBeforeStep(Callback):
    """Live bytes just before the optimizer steps of the third and fourth steps (Adam's states exist since the first),
    the smaller of the two."""

    def __init__(self) -> None:
        self.bytes = 0
        self.before = live_storages()  # what earlier runs in this process left alive is not this run's
        self._seen: list[int] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step in (2, 3):
            # gloo's worker thread may still hold a finished collective's tensors for a moment after ``wait()``
            # returned (a loaded machine deschedules it): the least of a few looks 10 ms apart is what we keep. Two
            # steps, the less of the two: one tensor more is often alive at one of them, nearly always the later,
            # the size of the parameters under DDP and of a gradient shard under ZeRO (30 of 64 readings on
            # 2026-12-01, 26 of them at the later step, DDP's included: not the engine's; not explained). A
            # retention that lasts shows at both steps and still fails here.
            samples = []
            for _ in range(5):
                samples.append(live_bytes_since(self.before))
                time.sleep(0.01)
            self._seen.append(min(samples))
            self.bytes = min(self._seen)


def _live_memory(rank: int, world_size: int) -> dict[str, float]:
    found = {}
    for name, strategy in (
        ("ddp", DDPStrategy()),
        ("zero1", ZeRO1Strategy()),
        ("zero2", ZeRO2Strategy()),
        ("zero3", ZeRO3Strategy()),
    ):
        probe = LiveBeforeStep()
        L.seed_everything(0)
        trainer = quiet_trainer(strategy=strategy, devices=2, max_steps=4, callbacks=[probe])
        trainer.fit(MLP())
        found[name] = probe.bytes
        del trainer
    return {name: value / found["ddp"] for name, value in found.items()}


def test_live_memory_before_the_optimizer_step_with_the_defaults() -> None:
    for ratios in spawn(_live_memory, world_size=2):
        assert ratios["zero1"] <= 0.79, ratios
        assert ratios["zero2"] <= 0.66, ratios
        assert ratios["zero3"] <= 0.53, ratios
