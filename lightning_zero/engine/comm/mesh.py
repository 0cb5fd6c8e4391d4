"""Hybrid sharding: states sharded inside groups of ranks, replicated across the groups.

[Note: hybrid sharding]
With ``shard_size=S`` at world size ``W`` the ranks form a ``(W // S, S)`` device mesh with dimensions
``("replicate", "shard")`` (``torch.distributed.device_mesh.init_device_mesh``): the ranks of one row
are a *shard group* (typically one node), those of one column a *replicate group*. Every state
(optimizer state, sharded gradients, stage-3 parameters) is laid out over the shard group only: the
layout's world size is ``S``, and replica groups hold identical shards. ``shard_size=None`` (or
``S == W``) is plain ZeRO: one shard group, no replicate group, the same collectives and bits as
before.

Which group each collective runs on (every site in the engine and the strategies):

- shard group: the stage-3 all-gathers (forward, backward, prefetch, ``gathered_parameters``,
  state dicts), the all-gather of updated shards after a step (stages 1 and 2), the gradient
  reduce-scatter, the all-gather of optimizer state for full state dicts, the gradient-norm
  all-reduce (replicas hold the same shards: summing over the shard group gives DDP's norm; over
  the world it would count each shard ``W // S`` times);
- replicate group: the all-reduce of each reduced gradient *shard* (``1/S`` of the unit, not the
  full gradient), which turns the shard group's sum into the sum over every rank; then the mean
  divides by ``W`` as without hybrid sharding (after summing when ``W`` is a power of two, so the bits stay DDP's
  wherever the order of the sums allows);
- world: everything that decides what every rank does next or that must see every rank: the
  agreements of ``control.py`` and the sequence checks (the subgroups' collectives are checked in
  the world's sequence, see ``Comm.subgroup``), the used-parameter / non-finite / reduce-order
  flags of ``GradReducer``, ``nonfinite_grads``, the gradient scaler's found-inf, buffer
  broadcasts, ``strategy.reduce``, barriers, object broadcasts, checkpoint agreements, the
  ``log_stats`` time maximum, and in ``engine/checkpoint/saving.py`` the failure reports
  (``all_gather_object``) and the count of elements written (an all-reduce: replicas write none,
  so the count still equals each tensor's size);
- both, one after the other: the initial broadcast of the parameters (in the shard group from its
  first rank, then in the replicate group from the first shard group: rank 0's values everywhere).

Checkpoints: the pieces a rank holds are named by their offset in the full tensor, not by rank (see
[Note: checkpoint layout] in ``checkpoint/pieces.py``), so a checkpoint written with any ``shard_size`` at
any world size loads under any other: each rank asks for the pieces of its own shard layout. Only
the first shard group (replicate rank 0) writes pieces, so each is written once; DCP's 1-D mesh
over the world (``strategy.device_mesh``) is unchanged.

Why ``Comm.subgroup`` rather than plain ``Comm`` s: the collective checks and stall reports compare
what every rank does at each position of one sequence; the shard and replicate collectives sit in
the world's sequence (every rank issues them at the same positions, in its own groups), so one
agreement per step still covers the step, and a rank that leaves the track is still caught.

Example::

    groups = ShardGroups.create(world_comm, shard_size=8)     # on every rank
    groups.shard.all_gather(full, shard)                       # inside the node
    groups.replicate.all_reduce(grad_shard)                    # across nodes (None: one shard group)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_zero.engine.comm.comm import Comm

ShardSize = int | Literal["node"] | None


def check_shard_size(shard_size: object) -> None:
    """Refuse a ``shard_size`` that is not ``None``, ``"node"`` or a positive int (before any process starts)."""
    if shard_size is None or shard_size == "node":
        return
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(
            f"shard_size must be None (shard over all ranks), 'node' (shard inside each node) or a positive number of "
            f"ranks that divides the world size, got {shard_size!r}"
        )


def resolve_shard_size(shard_size: ShardSize, world_size: int, local_world_size: int | None) -> int:
    """The number of ranks per shard group: ``world_size`` for ``None``, ``local_world_size`` for ``"node"``.
    Raises ``ValueError`` (the same on every rank) when it does not divide ``world_size``.

    Example::

        resolve_shard_size("node", world_size=16, local_world_size=8)   # 8
        resolve_shard_size(None, world_size=16, local_world_size=8)     # 16
    """
    check_shard_size(shard_size)
    if shard_size is None:
        return world_size
    if shard_size == "node":
        if local_world_size is None or local_world_size < 1:
            raise ValueError(
                "shard_size='node' needs the number of processes per node, which is not known here: pass it as a "
                "number (shard_size=8), or launch with torchrun/SLURM/Lightning, which set it"
            )
        size, what = local_world_size, f"shard_size='node' ({local_world_size} processes per node)"
    else:
        assert isinstance(shard_size, int)
        size, what = shard_size, f"shard_size={shard_size}"
    if size > world_size or world_size % size != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"{what} does not divide the world size {world_size}: the ranks must split into equal shard groups. "
            f"Use one of {divisors} (e.g. the number of processes per node), or shard_size=None to shard over all "
            "ranks."
        )
    return size


@dataclass
class ShardGroups:
    """The world's ``Comm`` and the ``Comm`` s of hybrid sharding (see [Note: hybrid sharding]).

    With one shard group, ``shard`` is ``world`` itself and ``replicate`` is ``None``: nothing changes.
    """

    world: Comm
    shard: Comm
    replicate: Comm | None = None

    @classmethod
    def create(cls, world: Comm, shard_size: int | None, device_type: str = "cpu") -> ShardGroups:
        """Split ``world`` into shard groups of ``shard_size`` consecutive ranks (a collective when it does: call
        on every rank), for collectives on tensors of ``device_type``. ``None`` or the world size: no split."""
        size = resolve_shard_size(shard_size, world.world_size, None)
        if size == world.world_size:
            return cls(world, world)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (world.world_size // size, size), mesh_dim_names=("replicate", "shard"))
        return cls(world, world.subgroup(mesh.get_group("shard")), world.subgroup(mesh.get_group("replicate")))
