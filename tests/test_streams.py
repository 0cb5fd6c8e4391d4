"""Which stream each copy between host and device memory is queued on, and in what order the waits come, with a
recording fake of the side streams on a CPU (see [Note: copies off the compute stream] in
``engine/core/streams.py``); a refresh of the compute shard waits for a gather in flight (see [Note: a refresh waits
for the gather in flight] in ``engine/core/unit.py``); under stages 1 and 2 each unit's forward waits for its own
post-step gather (see [Note: each unit waits for its own gather] in ``engine/schedule/arrivals.py``).

Every case runs in one process, a world of one (collectives are copies): no process group. On a CPU every copy is
between host tensors, so the fake only says where a device would have queued it; the values must be those of the
engine without side streams, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_zero.engine import Comm, shard_model
from lightning_zero.engine.checkpoint import background
from lightning_zero.engine.core.grouping import UnitPlan, owns_parameters
from lightning_zero.engine.core.pinned import HostRegistration
from lightning_zero.engine.core.policy import EnginePolicy, Offload
from lightning_zero.engine.core.unit import ShardedUnit
from lightning_zero.engine.schedule.reduce import host_copies_event, reduce_grads


class _Stream:
    def __init__(self, log: list[tuple[str, ...]], name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(("wait", self.name, other.name))

    def wait_event(self, event: _Event) -> None:
        self.log.append(("wait for", self.name, event.name))


class _Event:
    def __init__(self, log: list[tuple[str, ...]], name: str) -> None:
        self.log, self.name = log, name

    def record(self, stream: _Stream) -> None:
        self.log.append(("record", self.name, stream.name))

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))


class _Streams:
    """A ``Streams`` that logs what each call would queue: the current stream is ``"compute"`` unless ``on`` says
    otherwise; copies (``Tensor.copy_``) are logged with the stream current when they are queued."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.compute = _Stream(self.log, "compute")
        self.current = self.compute
        self._side: dict[str, _Stream] = {}
        self._events = 0

    def current_stream(self) -> _Stream:
        return self.current

    def side_stream(self, name: str) -> _Stream:
        if name not in self._side:
            self._side[name] = _Stream(self.log, name)
        return self._side[name]

    @contextmanager
    def on(self, stream: _Stream) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def new_event(self) -> _Event:
        self._events += 1
        return _Event(self.log, f"event {self._events}")

    def keep_for(self, tensor: torch.Tensor, stream: _Stream) -> None:
        self.log.append(("keep", stream.name))

    @contextmanager
    def copies(self) -> Iterator[None]:
        """Log each ``copy_`` as ("copy", stream, destination pointer, source pointer)."""
        streams = self

        class Copies(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
                if func is torch.Tensor.copy_:
                    dst, src = args[0], args[1]
                    streams.log.append(("copy", streams.current.name, str(dst.data_ptr()), str(src.data_ptr())))
                return func(*args, **(kwargs or {}))

        with Copies():
            yield

    def entries(self, kind: str) -> list[tuple[str, ...]]:
        return [entry for entry in self.log if entry[0] == kind]

    def index(self, entry: tuple[str, ...]) -> int:
        return self.log.index(entry)


def _copy_into(streams: _Streams, tensor: torch.Tensor) -> tuple[str, ...]:
    """The one logged copy whose destination is ``tensor``."""
    found = [entry for entry in streams.entries("copy") if entry[2] == str(tensor.data_ptr())]
    assert len(found) == 1, (found, streams.log)
    return found[0]


def _linear_unit(stage: int, offload: Offload = Offload.NONE, **options: Any) -> ShardedUnit:
    torch.manual_seed(0)
    layer = nn.Linear(6, 5)
    plan = UnitPlan("layer", layer, [layer.weight, layer.bias], ["weight", "bias"])
    return ShardedUnit(plan, Comm(), EnginePolicy(stage=stage, offload=offload, **options))


# ---------------------------------------------------------------------- a sharded gradient to the host
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_a_reduced_shard_goes_to_the_host_on_the_reduce_stream(param_dtype: torch.dtype | None) -> None:
    """The copy of a reduced shard to the host is queued on the ``"reduce"`` side stream, after that stream waited
    for the compute stream (which waited for the reduce-scatter and divided), with an event recorded behind it that
    the end of backward waits for (``host_copies_event``); its device source is kept for the side stream."""
    values = []
    for fake in (None, _Streams()):
        unit = _linear_unit(2, Offload.OPTIMIZER, param_dtype=param_dtype)
        unit.streams = fake
        for param in unit.params:
            param.grad = torch.arange(param.numel(), dtype=param.dtype).view(param.shape) / 7
        reduced = reduce_grads(unit, async_op=True)
        if fake is None:
            values.append(reduced.wait().clone())
            assert host_copies_event([unit]) is None
            continue
        with fake.copies():
            shard = reduced.wait()
        values.append(shard.clone())
        copy = _copy_into(fake, shard)
        event = unit.copied_to_host
        assert copy[1] == "reduce", fake.log
        recorded = fake.index(("record", event.name, "reduce"))
        assert fake.index(("wait", "reduce", "compute")) < fake.index(copy) < recorded
        assert fake.index(copy) < fake.index(("keep", "reduce"))
        assert not [e for e in fake.entries("copy") if e[1] == "compute" and e[2] == str(shard.data_ptr())]
        assert host_copies_event([unit]) is event
    assert torch.equal(values[0], values[1])


# ---------------------------------------------------------------------- shards to the device
@pytest.mark.parametrize("stage", [2, 3])
def test_a_refreshed_shard_is_copied_in_and_gathered_from_the_copy_stream(stage: int) -> None:
    """After a step, the copy of the (host) master into the device's compute shard is queued on the ``"copy_in"``
    side stream, after it waited for the compute stream, with an event behind it that the host waits for before it
    writes the master again; the all-gather that reads the shard is issued from the same stream, after the copy
    (stages 1 and 2 at once, stage 3 at its next gather)."""
    fake = _Streams()
    unit = _linear_unit(stage, Offload.OPTIMIZER)
    unit.streams = fake
    issued: list[str] = []
    all_gather = unit.comm.all_gather

    def spy(*args: Any, **kwargs: Any) -> Any:
        issued.append(fake.current.name)
        return all_gather(*args, **kwargs)

    unit.comm.all_gather = spy  # type: ignore[method-assign]
    with torch.no_grad():
        unit.master.mul_(2.0)
    want = unit.master.clone()
    with fake.copies():
        pending = unit.gather_updated_shards(async_op=True)
        if pending is not None:
            pending.wait()
        if stage == 3:
            unit.unshard()
    assert unit.shard is not None
    refresh = _copy_into(fake, unit.shard)
    assert refresh[1] == "copy_in", fake.log
    assert fake.index(("wait", "copy_in", "compute")) < fake.index(refresh)
    host_read = unit._host_read
    assert fake.index(refresh) < fake.index(("record", host_read.name, "copy_in"))
    assert issued == ["copy_in"], issued  # the gather, from the copy stream, after the refresh
    assert torch.equal(unit.flat[: want.numel()], want)
    unit.wait_host_reads()  # what the optimizer step does before it writes the master
    assert fake.log[-1] == ("synchronize", host_read.name)


def test_an_offloaded_shard_is_staged_on_the_copy_stream_and_waited_for_on_the_compute_stream() -> None:
    """``offload_params``: each gather copies the host shard into a staging shard on the ``"copy_in"`` side stream
    and issues the all-gather from there; a blocking gather is waited for afterwards, on the compute stream."""
    fake = _Streams()
    unit = _linear_unit(3, Offload.PARAMS)
    want = unit.master.clone()
    unit.streams = fake
    on_wait: list[str] = []
    all_gather = unit.comm.all_gather

    def spy(*args: Any, **kwargs: Any) -> Any:
        assert kwargs["async_op"], "a gather issued from a side stream must be waited for on the compute stream"
        pending = all_gather(*args, **kwargs)
        wait = pending.wait
        pending.wait = lambda: (on_wait.append(fake.current.name), wait())[1]  # type: ignore[method-assign]
        return pending

    unit.comm.all_gather = spy  # type: ignore[method-assign]
    with fake.copies():
        unit.unshard()
    staged = [e for e in fake.entries("copy") if e[3] == str(unit.shard.data_ptr())]
    assert [e[1] for e in staged] == ["copy_in"], fake.log
    assert fake.index(("wait", "copy_in", "compute")) < fake.index(staged[0])
    assert on_wait == ["compute"]
    assert torch.equal(unit.flat[: want.numel()], want)
    with fake.copies():
        unit.reshard()
        unit.serve_gather()  # another rank's gather: the same streams
    assert on_wait == ["compute", "compute"]


@pytest.mark.parametrize("stage,options", [(2, {"offload_optimizer": True}), (3, {"offload_params": True})])
def test_training_with_side_streams_gives_the_same_bits(stage: int, options: dict[str, Any]) -> None:
    """Three steps of an offloaded model with the recording streams give the values without them; every gradient
    went to the host on the reduce stream, and the end of each backward waited for those copies."""
    runs = []
    for fake in (None, _Streams()):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        sharded = shard_model(model, stage=stage, comm=Comm(), units=owns_parameters, **options)
        for unit in sharded.units:
            unit.streams = fake
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sharded.bind_optimizer(optimizer)
        losses = []
        for x in torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1)):
            with sharded.step_context():
                loss = model(x).square().mean()
                loss.backward()
            optimizer.step()
            sharded.after_optimizer_step(optimizer)
            optimizer.zero_grad()
            losses.append(loss.item())
        with sharded.gathered_parameters(writable=False):
            runs.append((losses, [p.detach().clone() for p in model.parameters()]))
        if fake is not None:
            copies = [e for e in fake.log if e[0] == "record" and e[2] == "reduce"]
            assert len(copies) == 3 * len(sharded.units), fake.log
            last_of_each_backward = copies[len(sharded.units) - 1 :: len(sharded.units)]
            assert {("synchronize", e[1]) for e in last_of_each_backward} <= set(fake.log)
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


# ---------------------------------------------------------------------- an asynchronous save's staging
class _Registry:
    def register(self, pointer: int, nbytes: int) -> None:
        pass

    def unregister(self, pointer: int) -> None:
        pass


def test_an_asynchronous_save_stages_on_its_side_stream() -> None:
    """``stage_on_host``: the copies into pinned buffers on the ``"save"`` side stream, after it waited for the
    compute stream, an event behind them that the save thread waits for (``ready``) and that the compute stream
    waits for before the engine next writes the model (``order_writes``, once, at the next step)."""
    fake = _Streams()
    registry = _Registry()
    pinned = background.PinnedBuffers(host=HostRegistration(registry.register, registry.unregister))
    weights = {"w": torch.arange(6.0), "nested": [torch.ones(2, 3)]}
    sharded = shard_model(nn.Linear(3, 3), stage=2, comm=Comm())
    with fake.copies():
        staged = background.stage_on_host(
            weights, pinned, streams=lambda device: fake, join_later=sharded.order_writes_after
        )
    copies = fake.entries("copy")
    assert [c[1] for c in copies] == ["save", "save"], fake.log
    assert fake.log[0] == ("wait", "save", "compute")
    assert fake.log[-1] == ("record", "event 1", "save")
    weights["w"].add_(1.0)  # (on a CPU every copy has happened by now; on a GPU ``order_writes`` orders this)
    assert torch.equal(staged.state["w"], torch.arange(6.0))
    assert torch.equal(staged.state["nested"][0], torch.ones(2, 3))
    assert staged.device is None  # nothing came from a CUDA device
    staged.ready()
    assert fake.log[-1] == ("synchronize", "event 1")

    assert ("wait for", "compute", "event 1") not in fake.log  # not before the engine writes again
    with sharded.step_context():
        pass
    assert fake.log[-1] == ("wait for", "compute", "event 1")
    with sharded.step_context():
        pass
    assert fake.log.count(("wait for", "compute", "event 1")) == 1
    # A caller that names no point to wait at gets the wait at once.
    fake.log.clear()
    background.stage_on_host({"w": torch.ones(2)}, pinned, streams=lambda device: fake)
    assert fake.log[-1] == ("wait for", "compute", "event 2"), fake.log


# ---------------------------------------------------------------------- a refresh and a gather in flight
class _InFlight:
    """A gather in flight that records what the shard held when it was waited for."""

    def __init__(self, shard: torch.Tensor) -> None:
        self.shard = shard
        self.seen: list[torch.Tensor] = []

    def wait(self) -> None:
        self.seen.append(self.shard.clone())

    def completed(self) -> bool:
        return False


@pytest.mark.parametrize("stage", [2, 3])
def test_a_shard_refresh_waits_for_the_gather_in_flight(stage: int) -> None:
    """``_refresh_shard`` called directly with an all-gather in flight (stages 1 and 2: it writes the shard, a view
    of ``flat``; stage 3 with offload: it reads the shard): the gather is waited for first, and only then is the
    shard overwritten (see [Note: a refresh waits for the gather in flight] in ``unit.py``)."""
    options: dict[str, Any] = {"param_dtype": torch.bfloat16} if stage == 2 else {"offload": Offload.OPTIMIZER}
    unit = _linear_unit(stage, **options)
    assert unit.shard is not None and unit.shard is not unit.master
    before = unit.shard.clone()
    in_flight = _InFlight(unit.shard)
    unit._gathering = in_flight  # type: ignore[assignment]
    with torch.no_grad():
        unit.master.add_(1.0)
    unit._refresh_shard()
    assert len(in_flight.seen) == 1 and torch.equal(in_flight.seen[0], before)  # waited for, before the refresh
    assert not unit.gather_in_flight
    assert torch.equal(unit.shard, unit.master.to(unit.shard.dtype))


# ---------------------------------------------------------------------- each unit waits for its own gather
def test_each_units_forward_waits_only_for_its_own_post_step_gather() -> None:
    """Stage 2: after the first step, ``begin_step`` waits for no post-step gather of a unit whose forward ran
    eagerly; each unit's forward waits for its own, so the first unit's forward runs before the last unit's gather
    is waited for. A unit read by compiled code is waited for in ``begin_step``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    sharded = shard_model(model, stage=2, comm=Comm(), units=owns_parameters)
    names = [unit.name for unit in sharded.units]
    assert names == ["0", "2", "4"]
    order: list[str] = []
    for unit in sharded.units:
        wait = unit.wait_gather

        def logged(unit: ShardedUnit = unit, wait: Any = wait) -> None:
            if unit.arriving:
                order.append(f"wait {unit.name}")
            wait()

        unit.wait_gather = logged  # type: ignore[method-assign]
        unit.module.register_forward_pre_hook(lambda module, args, name=unit.name: order.append(f"forward {name}"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sharded.bind_optimizer(optimizer)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    for step in range(3):
        order.clear()
        with sharded.step_context():
            at_start = list(order)
            model(x).square().sum().backward()
        optimizer.step()
        sharded.after_optimizer_step(optimizer)
        optimizer.zero_grad()
        assert all(unit.arriving for unit in sharded.units)
        if step == 0:
            assert order == ["forward 0", "forward 2", "forward 4"]  # nothing in flight yet
            continue
        assert at_start == [], order  # begin_step left them to their forwards
        assert order == ["wait 0", "forward 0", "wait 2", "forward 2", "wait 4", "forward 4"], order
        assert order.index("forward 0") < order.index("wait 4")


def test_a_unit_read_by_compiled_code_is_waited_for_at_the_start_of_the_step() -> None:
    """A module compiled before sharding gets no hook (its hooks would be traced), and its unit's gather is waited
    for in ``begin_step``, so compiled code never meets a parameter whose values are on their way; the others are
    left to their own forwards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[2] = torch.compile(model[2], backend="eager")
    sharded = shard_model(model, stage=2, comm=Comm(), units=owns_parameters)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sharded.bind_optimizer(optimizer)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    losses = []
    for _step in range(3):
        with sharded.step_context():
            left = {unit.name for unit in sharded.units if unit.arriving}
            loss = model(x).square().sum()
            loss.backward()
        optimizer.step()
        sharded.after_optimizer_step(optimizer)
        optimizer.zero_grad()
        losses.append(loss.item())
    assert left == {"0"}, left  # the compiled Linear's unit was waited for at the start
    assert all(torch.isfinite(torch.tensor(losses)))
