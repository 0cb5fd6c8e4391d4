"""Which recorded steps of a meta-init trace must run, and when each version of a storage needs memory.

Pure analysis of an ``InitTrace`` (``init_trace.py``); ``materialize.py`` runs the result. See
[Note: meta init] in ``materialize.py`` for why: *versions* (an op that writes every byte of a storage
without reading it starts a new one), *liveness* (walking backwards from the final versions of the
parameters and buffers, a step runs if it writes a needed version, or draws random numbers) and
*lifetimes* (the first and last step that runs on each version).

Example::

    plan = plan_replay(trace, {storage_key(p) for p in model.parameters()})
    sum(plan.execute), plan.first, plan.last
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_zero.engine.meta.init_trace import InitTrace

UNKNOWN = -1  # the version of a storage that existed before recording began

Version = tuple[int, int]  # (storage key, version number)


@dataclass
class StepVersions:
    """The version of each storage one step touches (by storage key), and by role."""

    touched: dict[int, int]
    reads: list[Version]
    writes: list[Version]
    created: list[Version]


@dataclass
class ReplayPlan:
    """Which recorded steps run, and when each version they touch needs memory (see [Note: meta init])."""

    steps: list[StepVersions]
    execute: list[bool]
    final: dict[int, int]  # storage key -> its version at the end of the recording
    first: dict[Version, int]  # version -> first step that runs on it
    last: dict[Version, int]  # version -> last step that runs on it
    unknown: list[Version]  # needed, but from before the recording: nothing says what they hold


def plan_replay(trace: InitTrace, needed: set[int]) -> ReplayPlan:
    """Versions, liveness and lifetimes (see [Note: meta init]) for the final values of the storages ``needed``."""
    current: dict[int, int] = {}
    per_step = []
    for step in trace.steps:
        read_keys = {r.storage for r in step.reads}
        starts = {
            w.storage
            for w in step.writes
            if step.overwrites and w.storage not in read_keys and w.covers(trace.nbytes[w.storage])
        }
        for key in starts:
            current[key] = current.get(key, UNKNOWN) + 1
        for ref in step.outputs:
            if ref is not None:
                current[ref.storage] = 0
        touched = {r.storage: current.get(r.storage, UNKNOWN) for r in [*step.reads, *step.writes]}
        touched.update({r.storage: 0 for r in step.outputs if r is not None})
        per_step.append(
            StepVersions(
                touched=touched,
                reads=[(r.storage, touched[r.storage]) for r in step.reads],
                writes=[(w.storage, touched[w.storage]) for w in step.writes],
                created=[(r.storage, 0) for r in step.outputs if r is not None],
            )
        )
    live = {(key, current.get(key, UNKNOWN)) for key in needed}
    execute = [False] * len(per_step)
    for i in reversed(range(len(per_step))):
        versions = per_step[i]
        if trace.steps[i].random or any(v in live for v in versions.writes + versions.created):
            execute[i] = True
            live.update(versions.reads)
    first: dict[Version, int] = {}
    last: dict[Version, int] = {}
    for i, versions in enumerate(per_step):
        if execute[i]:
            for version in versions.touched.items():
                first.setdefault(version, i)
                last[version] = i
    return ReplayPlan(per_step, execute, current, first, last, sorted(v for v in live if v[1] == UNKNOWN))
