"""``Comm`` in a process group of one rank with ``run_alone=True``: the collectives really run (the path a
single GPU exercises in ``benchmarks/gpu_check.py``), agreements included, and give the single-rank values."""

from __future__ import annotations

import torch

from lightning_zero.engine import Comm
from lightning_zero.engine.comm.control import ControlChannel
from tests.distributed import spawn


def _alone(rank: int, world_size: int) -> dict[str, int]:
    skipping = Comm(checks="off")
    full = torch.zeros(4)
    skipping.all_gather(full, torch.arange(4.0))
    assert skipping.stats.calls("all_gather") == 0 and full.tolist() == [0, 1, 2, 3]

    comm = Comm(checks="auto", control=ControlChannel.create(run_alone=True), run_alone=True)
    assert comm.control is not None
    comm.begin_sequence("training", [1], lambda: "step 1")
    full = torch.zeros(4)
    comm.all_gather(full, torch.arange(4.0), name="u", guard=True)
    shard = torch.zeros(4)
    pending = comm.reduce_scatter(shard, torch.ones(4), name="u", async_op=True)
    assert pending is not None
    pending.wait()
    total = torch.full((2,), 3.0)
    comm.all_reduce(total)
    comm.end_sequence()
    assert full.tolist() == [0, 1, 2, 3] and shard.tolist() == [1, 1, 1, 1] and total.tolist() == [3, 3]
    calls = {kind: comm.stats.calls(kind) for kind in ("all_gather", "reduce_scatter", "all_reduce", "check")}

    # A sequence opened at the step's agreement and named later (the gathers issued at a batch's start, see
    # Comm.continue_sequence): on track while it matches the named key's reference, agreed from where it does not.
    def step(number: int, key: str) -> int:
        before = comm.stats.calls("check")
        comm.agree_step([number], lambda: f"step {number}")
        comm.begin_sequence("training", None, lambda: f"step {number}")
        comm.all_gather(full, torch.arange(4.0), name="u", guard=True)
        comm.continue_sequence(key, lambda: f"step {number}")
        comm.reduce_scatter(shard, torch.ones(4), name="u")
        comm.all_reduce(total)
        return comm.stats.calls("check") - before

    calls["same key"] = step(2, "training")  # the agreement only
    calls["new key"] = step(3, "training (accumulating)")  # and the two collectives after the gather
    calls["known key"] = step(4, "training (accumulating)")  # its reference now exists
    comm.end_sequence()

    # A deferred step (evaluation under stages 1 and 2): agreed at its first collective, if any.
    def deferred(number: int, collectives: int) -> int:
        before = comm.stats.calls("check")
        comm.defer_sequence("evaluation", [number], lambda: f"evaluation step {number}")
        for _ in range(collectives):
            comm.all_reduce(total)
        comm.end_sequence()
        return comm.stats.calls("check") - before

    calls["deferred, silent"] = deferred(1, 0)  # nothing
    calls["deferred, first"] = deferred(2, 2)  # the step, and its two collectives (no reference yet)
    calls["deferred, again"] = deferred(3, 2)  # the step only
    calls["deferred, silent again"] = deferred(4, 0)
    return calls


def test_a_comm_of_one_rank_runs_its_collectives_when_asked() -> None:
    (calls,) = spawn(_alone, world_size=1, timeout=120)
    # The first step of a key is agreed collective by collective: 1 for the step and 3 for its collectives.
    assert calls == {
        "all_gather": 1,
        "reduce_scatter": 1,
        "all_reduce": 1,
        "check": 4,
        "same key": 1,
        "new key": 3,
        "known key": 1,
        "deferred, silent": 0,
        "deferred, first": 3,
        "deferred, again": 1,
        "deferred, silent again": 0,
    }
