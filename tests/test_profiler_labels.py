"""The engine's work in a ``torch.profiler`` trace (see [Note: profiler labels] in ``comm/labels.py``), and a
unit's phases over a step (see [Note: unit lifecycle] in ``core/unit_state.py``)."""

from __future__ import annotations

import collections
from contextlib import nullcontext
from unittest import mock

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from lightning_zero.engine import Comm, ShardedUnit, UnitPhase, owns_parameters, shard_model
from lightning_zero.engine.comm.labels import label
from tests.distributed import spawn
from tests.test_engine import TiedNet

_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 16), nn.ReLU(), nn.Linear(16, 3))


def _zero_labels(prof: profile) -> tuple[collections.Counter[str], set[str]]:
    """How many ranges of each ``ZeRO::`` label the trace holds (the unit's name in brackets dropped), and the
    unit names that appeared in brackets."""
    counts: collections.Counter[str] = collections.Counter()
    units: set[str] = set()
    for event in prof.events():
        if event.name.startswith("ZeRO::"):
            base, _, unit = event.name.partition(" (")
            counts[base] += 1
            if unit:
                units.add(unit[:-1])
    return counts, units


def _labels_per_step(rank: int, world_size: int) -> None:
    for stage in (2, 3):
        torch.manual_seed(0)
        model = _mlp()
        sharded = shard_model(model, stage=stage, comm=Comm(), units=owns_parameters)  # a unit per Linear
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sharded.bind_optimizer(opt)
        units = len(sharded.units)
        assert units == 3
        data = torch.Generator().manual_seed(rank)
        for step in range(3):
            x = torch.randn(4, 16, generator=data)
            before = sharded.comm.stats.snapshot()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                with sharded.step_context():
                    model(x).square().mean().backward()
                opt.step()
                sharded.after_optimizer_step(opt)
                opt.zero_grad()
            stats = sharded.comm.stats.since(before)
            counts, named = _zero_labels(prof)
            where = f"stage {stage}, step {step}"
            # Every collective the engine issued is one range of its kind, and every one it waited for in flight
            # one wait range.
            for kind in _KINDS:
                assert counts[f"ZeRO::{kind}"] == stats.calls(kind), (where, kind, counts)
            # A reduce-scatter per unit and step; the reduce order is settled by one all-reduce on the first step.
            assert counts["ZeRO::reduce_grads"] == counts["ZeRO::reduce_scatter"] == units, (where, counts)
            assert counts["ZeRO::all_reduce"] == (1 if step == 0 else 0), (where, counts)
            assert counts["ZeRO::wait_reduce_scatter"] == units, (where, counts)  # each was issued in flight
            assert counts["ZeRO::finish_backward"] == 1, (where, counts)
            if stage == 2:
                # The updated shards, gathered after the step; no hook around forward or backward.
                assert counts["ZeRO::gather"] == counts["ZeRO::all_gather"] == units, (where, counts)
                assert counts["ZeRO::pre_forward"] == counts["ZeRO::pre_backward"] == 0, (where, counts)
                assert counts["ZeRO::release"] == 0, (where, counts)
            else:
                # Forward gathers every unit, backward again, except (once the order is recorded) the unit that
                # ends forward, kept for backward; every gather is freed again.
                gathers = 2 * units - (1 if step else 0)
                assert counts["ZeRO::gather"] == counts["ZeRO::all_gather"] == gathers, (where, counts)
                assert counts["ZeRO::release"] == gathers, (where, counts)
                for hook in ("pre_forward", "post_forward", "pre_backward"):
                    assert counts[f"ZeRO::{hook}"] == units, (where, hook, counts)
            assert named == {u.name for u in sharded.units}, (where, named)
        sharded.release()


def test_profiler_labels_count_each_steps_collectives_on_two_ranks() -> None:
    spawn(_labels_per_step, world_size=2)


def test_a_label_is_a_range_only_while_a_profiler_records() -> None:
    assert isinstance(label("ZeRO::gather", "layer"), nullcontext)  # nothing to enter, nothing formatted
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with label("ZeRO::gather", "layer"):
            torch.ones(2).sum()
    assert [e.name for e in prof.events() if e.name.startswith("ZeRO::")] == ["ZeRO::gather (layer)"]


class _PhaseLog:
    """Replaces ``ShardedUnit.phase`` with a property that keeps, per unit, every phase it moves to."""

    def __init__(self) -> None:
        self.by_unit: dict[str, list[UnitPhase]] = collections.defaultdict(list)

    def property(self) -> property:
        def get(unit: ShardedUnit) -> UnitPhase:
            return unit.__dict__["_logged_phase"]

        def set_(unit: ShardedUnit, phase: UnitPhase) -> None:
            if unit.__dict__.get("_logged_phase") is not phase:
                self.by_unit[unit.name].append(phase)
            unit.__dict__["_logged_phase"] = phase

        return property(get, set_)

    def take(self) -> dict[str, list[UnitPhase]]:
        taken = dict(self.by_unit)
        self.by_unit.clear()
        return taken


def _phases_over_a_step(rank: int, world_size: int) -> None:
    idle, forward = UnitPhase.IDLE, UnitPhase.FORWARD
    pre, post = UnitPhase.PRE_BACKWARD, UnitPhase.POST_BACKWARD
    log = _PhaseLog()
    with mock.patch.object(ShardedUnit, "phase", log.property(), create=True):
        for stage in (2, 3):
            torch.manual_seed(0)
            model = TiedNet()
            sharded = shard_model(model, stage=stage, comm=Comm(), units=owns_parameters)
            names = [u.name for u in sharded.units]
            assert names == ["<root>", "up", "down"]  # the root holds the tied weight and is held for the step
            assert log.take() == {name: [idle] for name in names}  # every unit starts idle
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            sharded.bind_optimizer(opt)
            data = torch.Generator().manual_seed(rank)
            for step in range(2):  # the first step records the orders, the second prefetches along them
                x, y = torch.randint(0, 11, (4, 5), generator=data), torch.randint(0, 11, (4, 5), generator=data)
                with sharded.step_context():
                    nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
                opt.step()
                sharded.after_optimizer_step(opt)
                opt.zero_grad()
                seen = log.take()
                if stage == 2:
                    assert seen == {}, seen  # no hooks: every unit stays idle
                    continue
                # up and down run twice in TiedNet's forward, inside the root's; backward reaches each twice too,
                # and reduces it once both uses have given their gradients.
                twice = [forward, idle, forward, idle, pre, post, idle]
                assert seen == {"<root>": [forward, idle, pre, post, idle], "up": twice, "down": twice}, (step, seen)
                assert all(u.phase is idle for u in sharded.units)
            if stage == 3:  # an evaluation step: forward only
                with torch.no_grad(), sharded.step_context():
                    model(x)
                assert log.take() == {"<root>": [forward, idle], "up": [forward, idle] * 2, "down": [forward, idle] * 2}
            sharded.release()


def test_a_units_phases_over_a_step_go_from_idle_through_forward_and_backward_to_idle() -> None:
    spawn(_phases_over_a_step, world_size=2)
