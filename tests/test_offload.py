"""Parameter offload (``offload_params=True``, stage 3): the shards live in host memory, nothing changes.

- Through a real ``Trainer`` on two CPU processes, ``ZeRO3Strategy(offload_params=True)`` gives bitwise the
  losses and final parameters of ``ZeRO3Strategy()`` (and so of ``DDPStrategy``, which today's stage 3
  matches bitwise at two ranks), in ``"32-true"``, ``"bf16-mixed"`` and ``"bf16-true"``, and under hybrid
  sharding (``shard_size=1``), and for a model created already sharded (``meta_init``); the Fabric
  ``ZeRO3Strategy`` likewise.
- Between steps no unit keeps a piece of its parameters on the compute device: the compute shard is a host
  tensor (the master itself when the dtypes match), the gathered buffer is freed, and ``memory_stats()`` /
  ``memory_report()`` count the parameters on the host (``params`` 0, ``host_params``).
- On CUDA (skipped elsewhere): the host shards are pinned and every host-to-device copy is non-blocking.
- Stages 1 and 2 refuse ``offload_params`` at construction, saying why and what to use instead.
- A checkpoint saved with offload resumes without it, and the reverse (a full file both ways, a sharded
  directory one way), to the losses and parameters of the uninterrupted run.
- A reduction whose shard leaves the reduce-scatter output (copied to the host under ``offload_optimizer`` on
  CUDA, cast to another master dtype anywhere) lets go of that output at ``wait()``: its unused-parameter slot is a
  one-element tensor of its own (see [Note: the slot outlives out] in ``engine/schedule/reduce.py``).
- Pinned host memory is registered at its exact size, once per buffer, and unregistered when the buffer dies; the
  per-step host gradients reuse a buffer once nothing holds it; nothing in the package pins through torch's caching
  host allocator (see [Note: exact pinned memory] in ``engine/core/pinned.py``). CUDA's registration is replaced by
  a recording one: a CPU cannot pin.

On a CPU build "host" and "device" are the same memory: these tests prove the results and where each
tensor is meant to live (see [Note: parameter offload] in ``engine/core/compute_shard.py``), not a saving.
"""

from __future__ import annotations

import gc
import re
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

import lightning_zero.fabric as zero_fabric
from lightning_zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy
from lightning_zero.engine import Comm, shard_model
from lightning_zero.engine.core.grouping import UnitPlan
from lightning_zero.engine.core.pinned import HostRegistration, PinnedPool, pinned_copy, pinned_empty
from lightning_zero.engine.core.policy import EnginePolicy
from lightning_zero.engine.core.unit import ShardedUnit
from lightning_zero.engine.schedule.reduce import reduce_grads
from tests.distributed import spawn
from tests.models import ParityNet, quiet_trainer


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _check_offloaded(unit: ShardedUnit, where: str) -> None:
    """The unit keeps no piece of its parameters on the compute device: only host shards."""
    assert unit.offload_params and unit.offload, where
    assert unit.shard is not None and unit.shard.device == unit.master_device == torch.device("cpu"), where
    assert unit.shard.dtype == unit.dtype, where
    if unit.dtype == unit.master_dtype:
        assert unit.shard is unit.master, f"{where}: in the master dtype the host shard is the master itself"
    else:
        assert _storage(unit.shard) != _storage(unit.master), where
    if not unit.is_unsharded:
        assert unit.flat.untyped_storage().nbytes() == 0, f"{where}: the gathered buffer must be freed"
    assert _storage(unit.shard) != _storage(unit.flat) or unit.flat.untyped_storage().nbytes() == 0, where
    if unit.device.type == "cuda":
        assert unit.shard.is_pinned() and unit.master.is_pinned(), where


class Inspect(Callback):
    """After every training batch (between steps): where each unit's shards are, and the memory accounting."""

    def __init__(self) -> None:
        self.checked = 0
        self.memory: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not getattr(trainer.strategy, "offload_params", False):
            return
        sharded = trainer.strategy.sharded_model
        for unit in sharded.units:
            _check_offloaded(unit, f"unit {unit.name!r} after step {trainer.global_step}")
        self.checked += 1

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not getattr(trainer.strategy, "offload_params", False):
            return
        sharded = trainer.strategy.sharded_model
        self.memory = dict(sharded.memory_stats())
        self.memory["expected_host"] = sum(
            u.layout.shard_numel * u.shard.element_size() for u in sharded.units if u.shard is not u.master
        )
        self.memory["report"] = trainer.strategy.memory_report()


def _parity_net() -> L.LightningModule:
    return ParityNet(optimizer="adamw", param_groups=True)


def _late_net() -> L.LightningModule:  # layers built in configure_model: created already sharded (meta_init)
    from tests.test_big_model import LateNet

    return LateNet()


def _fit(strategy: Any, precision: str, make: Callable[[], Any] = _parity_net) -> tuple[list, dict, Inspect]:
    L.seed_everything(0)
    model = make()
    inspect = Inspect()
    trainer = quiet_trainer(strategy=strategy, devices=2, max_steps=4, precision=precision, callbacks=[inspect])
    trainer.fit(model)
    return model.losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, inspect


def _assert_same(got: tuple, want: tuple, where: str) -> None:
    assert got[0] == want[0], f"{where}: losses {got[0]} != {want[0]}"
    for key, value in want[1].items():
        assert torch.equal(got[1][key], value), f"{where}: {key}"


def _trainer_parity(rank: int, world_size: int) -> None:
    cases: list[tuple[str, str, dict[str, Any], Callable[[], Any]]] = [
        ("32-true", "ddp", {}, _parity_net),
        ("bf16-mixed", "", {}, _parity_net),
        ("bf16-true", "", {}, _parity_net),
        ("32-true", "", {"shard_size": 1}, _parity_net),  # hybrid: shard groups of one rank, replicated across both
        ("bf16-mixed", "", {}, _late_net),  # units created already sharded, from the meta device
    ]
    for precision, reference, options, make in cases:
        where = f"{precision} {options} {make.__name__}"
        plain = _fit(ZeRO3Strategy(**options), precision, make)
        offloaded = _fit(ZeRO3Strategy(offload_params=True, **options), precision, make)
        _assert_same(offloaded, plain, where)
        if reference == "ddp":
            _assert_same(offloaded, _fit(DDPStrategy(), precision, make), f"{where} against DDP")
        inspect = offloaded[2]
        assert inspect.checked == 4, where
        memory = inspect.memory
        assert memory["params"] == 0, f"{where}: no parameter bytes may stay on the device"
        assert memory["gathered_params"] == 0, where
        assert memory["host_params"] == memory["expected_host"], where
        assert (memory["host_params"] > 0) == (precision == "bf16-mixed"), where  # a host shard of its own
        assert memory["master_params"] > 0, where
        report = memory["report"]
        assert report.estimate.offload_params and report.row.device.params == 0, where
        predicted = report.row.cpu.params
        assert abs(memory["host_params"] - predicted) <= 0.03 * max(predicted, 1), where
        assert "host parameters" in report.comparison(), where

    _fabric_parity()


def _fabric_parity() -> None:
    """The loop of ``examples/fabric_train_gpt.py`` (gradient accumulation, clipping by value) under the Fabric
    ``ZeRO3Strategy`` with and without ``offload_params``."""
    from tests.test_fabric import _example, _fabric

    example = _example()
    runs = []
    for offload_params in (False, True):
        fabric = _fabric(zero_fabric.ZeRO3Strategy(offload_params=offload_params), 2)
        result = example.train(
            fabric, example.LoopArgs(steps=3, max_norm=None, clip_val=0.02), *example.corpus_tokens()
        )
        if offload_params:
            for unit in fabric.strategy.sharded_model.units:
                _check_offloaded(unit, f"Fabric: unit {unit.name!r}")
            assert fabric.strategy.sharded_model.memory_stats()["params"] == 0
        fabric.strategy.teardown()
        runs.append(result)
    plain, offloaded = runs
    assert offloaded["losses"] == plain["losses"]
    for key, value in plain["state"].items():
        assert torch.equal(offloaded["state"][key], value), f"Fabric: {key}"


def test_offloaded_parameters_train_exactly_as_without() -> None:
    spawn(_trainer_parity, world_size=2, timeout=300)


def _resume_across_offload(rank: int, world_size: int, root: str) -> None:
    from tests.test_checkpoints import _run

    L.seed_everything(0)
    straight = _run(ZeRO3Strategy(), world_size)
    cases = [(True, False, "full"), (False, True, "full"), (True, False, "sharded")]
    for saved, resumed, checkpoint_format in cases:
        directory = f"{root}/saved-offload-{saved}-{checkpoint_format}"
        save = ZeRO3Strategy(offload_params=saved, checkpoint_format=checkpoint_format)
        _run(save, world_size, directory=directory)
        model = _run(ZeRO3Strategy(offload_params=resumed), world_size, ckpt_path=f"{directory}/epoch0.ckpt")
        where = f"{checkpoint_format} checkpoint saved with offload_params={saved}, resumed with {resumed}"
        assert model.losses == straight.losses[8:], where
        for key, value in straight.state_dict().items():
            assert torch.equal(model.state_dict()[key], value), f"{where}: {key}"


def test_checkpoints_move_between_offloaded_and_device_parameters(tmp_path: Path) -> None:
    spawn(_resume_across_offload, world_size=2, timeout=300, root=str(tmp_path))


@pytest.mark.parametrize(
    "make",
    [ZeRO1Strategy, ZeRO2Strategy, zero_fabric.ZeRO1Strategy, zero_fabric.ZeRO2Strategy],
    ids=["zero1", "zero2", "fabric-zero1", "fabric-zero2"],
)
def test_stages_1_and_2_refuse_offload_params(make: Any) -> None:
    with pytest.raises(ValueError, match="offload_params=True needs stage 3") as error:
        make(offload_params=True)
    assert "offload_optimizer=True" in str(error.value)  # what to use instead


def test_offload_params_implies_offload_optimizer_and_is_a_bool() -> None:
    for make in (ZeRO3Strategy, zero_fabric.ZeRO3Strategy):
        strategy = make(offload_params=True)
        assert strategy.offload_params and strategy.offload_optimizer
        assert not make().offload_params
        with pytest.raises(TypeError, match="offload_params must be True or False"):
            make(offload_params="yes")
    with pytest.raises(ValueError, match="needs stage 3"):
        shard_model(nn.Linear(2, 2), stage=2, comm=Comm(), offload_params=True)


def _one_rank_training(
    device: str, offload_params: bool, watch: Callable[[], AbstractContextManager] = nullcontext, steps: int = 3
) -> tuple[list[float], list[torch.Tensor]]:
    """A world of one (no process group: collectives are copies), on ``device``; ``watch()`` around the steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    sharded = shard_model(model, stage=3, comm=Comm(), device=torch.device(device), offload_params=offload_params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sharded.bind_optimizer(optimizer)
    data = torch.randn(steps, 5, 8, generator=torch.Generator().manual_seed(1)).to(device)
    losses = []
    with watch():
        for x in data:
            with sharded.step_context():
                loss = model(x).square().mean()
                loss.backward()
            optimizer.step()
            sharded.after_optimizer_step(optimizer)
            optimizer.zero_grad()
            losses.append(loss.item())
            if offload_params:
                for unit in sharded.units:
                    _check_offloaded(unit, f"unit {unit.name!r} on {device}")
                assert sharded.memory_stats()["params"] == 0
    with sharded.gathered_parameters(writable=False):
        final = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    return losses, final


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_host_shards_are_copied_in_without_blocking(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = _one_rank_training(device, offload_params=False)
    copies: list[bool] = []
    to = torch.Tensor.to

    def spy(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        target = args[0] if args else kwargs.get("device")
        if self.device.type == "cpu" and isinstance(target, torch.device) and target.type == "cuda":
            copies.append(bool(kwargs.get("non_blocking", False)) and self.is_pinned())
        return to(self, *args, **kwargs)

    @contextmanager
    def watch() -> Iterator[None]:  # the training steps only (not the final gather, a blocking read)
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "to", spy)
            yield

    offloaded = _one_rank_training(device, offload_params=True, watch=watch)
    assert offloaded[0] == plain[0]
    for got, want in zip(offloaded[1], plain[1]):
        assert torch.equal(got, want)
    if device == "cuda":
        # Every gather (forward and backward of each step) copied a pinned host shard without blocking.
        assert copies and all(copies), copies


# ---------------------------------------------------------------------- what a reduction keeps alive
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_reduction_lets_go_of_its_output_once_the_shard_has_left_it(dtype: torch.dtype) -> None:
    """bf16 parameters reduce in fp32 and cast the shard back, a new tensor, as a copy to the host does under
    offload: the fp32 output must then be freed at ``wait()``, not held by the slot to the end of backward. In
    fp32 the shard is a view of the output, and so is the slot (no copy)."""
    layer = nn.Linear(6, 5).to(dtype)
    plan = UnitPlan("layer", layer, [layer.weight, layer.bias], ["weight", "bias"])
    unit = ShardedUnit(plan, Comm(), EnginePolicy(stage=2))
    for param in unit.params:
        param.grad = torch.ones_like(param)
    reduced = reduce_grads(unit, async_op=True)
    output = weakref.ref(reduced.unused_anywhere.untyped_storage())  # the reduce-scatter output's storage
    shard = reduced.wait()
    gc.collect()
    slot = reduced.unused_anywhere
    assert slot.tolist() == [0.0]  # every parameter had a gradient
    if dtype == torch.bfloat16:
        assert output() is None, "the slot keeps the whole reduce-scatter output alive"
        assert slot.untyped_storage().nbytes() == slot.element_size()
    else:
        assert output() is not None and slot.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()


# ---------------------------------------------------------------------- pinned memory
class _Registry:
    """A ``HostRegistration`` that records what it is asked to pin and unpin."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def register(self, pointer: int, nbytes: int) -> None:
        assert pointer not in self.registered, "registered twice"
        self.registered[pointer] = nbytes

    def unregister(self, pointer: int) -> None:
        self.unregistered.append(pointer)

    @property
    def host(self) -> HostRegistration:
        return HostRegistration(self.register, self.unregister)


def test_pinned_buffers_register_their_exact_size_until_they_die() -> None:
    registry = _Registry()
    buffer = pinned_empty((3, 5), torch.float32, registry.host)  # 60 bytes: the caching allocator would pin 64
    assert registry.registered == {buffer.data_ptr(): 60}
    copy = pinned_copy(torch.arange(7, dtype=torch.float64), torch.bfloat16, registry.host)
    assert registry.registered[copy.data_ptr()] == 14 and copy.tolist() == list(range(7))
    assert pinned_empty((0, 4), torch.float32, registry.host).numel() == 0 and len(registry.registered) == 2
    pointer, view = buffer.data_ptr(), buffer[1:]
    del buffer
    gc.collect()
    assert registry.unregistered == []  # a view still uses the memory
    del view
    gc.collect()
    assert registry.unregistered == [pointer]


def test_host_gradients_reuse_a_buffer_once_nothing_holds_it() -> None:
    registry = _Registry()
    pool = PinnedPool(keep=2, host=registry.host)
    first = pool.take((10,), torch.float32)
    grads = first.split_with_sizes([4, 6])  # what the sharded gradients are
    pointer = first.data_ptr()
    del first
    second = pool.take((10,), torch.float32)  # the gradients still hold the first buffer
    assert second.data_ptr() != pointer
    del second
    assert pool.take((10,), torch.float32).data_ptr() != pointer  # the second, idle again
    del grads
    gc.collect()
    assert pool.take((10,), torch.float32).data_ptr() == pointer
    assert len(registry.registered) == 2 and pool.nbytes == 80  # registered once each, at their size
    held = [pool.take((10,), torch.float32) for _ in range(3)]  # more in use than kept: the third is not kept
    assert len(registry.registered) == 3 and pool.nbytes == 80
    del held
    gc.collect()
    assert len(registry.unregistered) == 1  # the one the pool did not keep


def test_nothing_pins_through_the_caching_host_allocator() -> None:
    package = Path(__file__).resolve().parents[1] / "lightning_zero"
    pattern = re.compile(r"pin_memory\s*=|\.pin_memory\(")
    found = [
        f"{path.relative_to(package)}:{number}: {line.strip()}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "pinned.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, "pinned memory through torch's caching host allocator (use engine/core/pinned.py):\n" + "\n".join(
        found
    )
