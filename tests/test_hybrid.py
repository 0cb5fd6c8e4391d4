"""Hybrid sharding (``shard_size``): states sharded inside groups of ranks, replicated across them.

Four CPU processes, ``shard_size=2``: two shard groups ({0, 1} and {2, 3}) of two ranks each (see
[Note: hybrid sharding] in ``engine/comm/mesh.py``). One spawn per test, many cases per spawn:

- every stage trains through a real ``Trainer`` like ``DDPStrategy`` (losses, parameters, learning
  rates and the gradient norm before clipping), within the tolerance four ranks allow today (the sums
  run in another order than gloo's all-reduce), and ``shard_size=None`` / ``shard_size=4`` give
  exactly today's results;
- in the engine, every parameter all-gather and reduce-scatter stays inside the rank's shard group,
  only gradient shards cross groups, and states are laid out over two ranks;
- ``shard_size=3`` at world size 4 is refused with the same clear error on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

import lightning_zero  # noqa: F401  registers the strategy names
from lightning_zero import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy
from lightning_zero.engine import Comm, module_class_policy, shard_model
from lightning_zero.engine.comm.mesh import resolve_shard_size
from tests.distributed import spawn
from tests.test_trainer_parity import _train

PER_LAYER = [nn.Linear, nn.LayerNorm, nn.BatchNorm1d]
HYBRID = {
    "zero1": lambda: ZeRO1Strategy(shard_size=2),
    "zero2": lambda: ZeRO2Strategy(shard_size=2, log_stats=True),  # bytes inside and across groups logged too
    "zero3": lambda: ZeRO3Strategy(shard_size=2),
    "zero3-per-layer": lambda: ZeRO3Strategy(shard_size=2, unit_modules=PER_LAYER),
}


def _assert_close(got: dict[str, Any], want: dict[str, Any], where: str, exact: bool = False) -> None:
    assert got["lrs"] == want["lrs"], where
    if exact:
        assert got["losses"] == want["losses"], where
        assert got["grad_norms"] == want["grad_norms"], where
        for key, value in want["state"].items():
            assert torch.equal(got["state"][key], value), f"{where}: {key}"
        return
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-6, atol=0, msg=where)
    torch.testing.assert_close(got["grad_norms"], want["grad_norms"], rtol=1e-6, atol=0, msg=where)
    for key, value in want["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-6, atol=1e-7, msg=f"{where}: {key}")


def _trainer_parity(rank: int, world_size: int) -> None:
    model_kwargs = {"optimizer": "adamw", "param_groups": True, "unused": True, "scheduler": "step"}
    trainer_kwargs = {"gradient_clip_val": 0.5, "accumulate_grad_batches": 2}
    ddp = _train(DDPStrategy(find_unused_parameters=True), world_size, model_kwargs, trainer_kwargs)
    assert ddp["trained"]
    for name, make in HYBRID.items():
        got = _train(make(), world_size, model_kwargs, trainer_kwargs)
        _assert_close(got, ddp, f"{name} shard_size=2 rank {rank}")
    # One shard group of every rank is exactly the default run, shard_size=None (the same collectives on the same
    # groups; the default's parity with DDP is tests/test_trainer_parity.py's).
    today = _train(ZeRO3Strategy(shard_size=None), world_size, model_kwargs, trainer_kwargs)
    got = _train(ZeRO3Strategy(shard_size=world_size), world_size, model_kwargs, trainer_kwargs)
    _assert_close(got, today, f"zero3 shard_size={world_size} rank {rank}", exact=True)
    _assert_close(today, ddp, f"zero3 shard_size=None rank {rank}")
    # A layer used on rank 0 only: whether its gradient exists is agreed by every rank, not by the shard group
    # (ranks 2 and 3 never use it), and its gradient is rank 0's divided by the world size, as in DDP.
    model_kwargs = {"optimizer": "sgd", "rank_dependent": True}
    ddp = _train(DDPStrategy(find_unused_parameters=True), world_size, model_kwargs, {})
    for name in ("zero1", "zero2"):
        _assert_close(_train(HYBRID[name](), world_size, model_kwargs, {}), ddp, f"{name} rank-dependent rank {rank}")


def _groups_of_collectives(rank: int, world_size: int) -> None:
    # The shard group of each rank, from the mesh ("replicate", "shard") = (2, 2): consecutive ranks.
    mine = [0, 1] if rank < 2 else [2, 3]
    calls: list[tuple[str, list[int], int]] = []  # (collective, ranks of its group, elements)
    originals = {name: getattr(dist, name) for name in ("scatter", "all_to_all_single", "all_reduce", "broadcast")}

    def spy(name: str):
        def call(tensor: torch.Tensor, *args: Any, group: dist.ProcessGroup | None = None, **kwargs: Any):
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world_size))
            calls.append((name, ranks, tensor.numel()))
            return originals[name](tensor, *args, group=group, **kwargs)

        return call

    for stage in (1, 2, 3):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        reference = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        reference.load_state_dict(net.state_dict())
        policy = None if stage < 3 else module_class_policy([nn.Linear])
        sharded = shard_model(net, stage=stage, comm=Comm(), shard_size=2, units=policy)
        assert dist.get_process_group_ranks(sharded.shard_comm.group) == mine
        assert sharded.replicate_comm is not None
        assert dist.get_process_group_ranks(sharded.replicate_comm.group) == [rank % 2, rank % 2 + 2]
        for unit in sharded.units:  # states laid out over the two ranks of the shard group
            assert unit.layout.shard_numel * 2 == unit.layout.padded_numel
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        sharded.bind_optimizer(opt)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(2):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))
            calls.clear()
            for name in originals:
                setattr(dist, name, spy(name))
            try:
                with sharded.step_context():
                    net(x).square().mean().backward()
                norm = sharded.grad_norm(opt)
                opt.step()
                sharded.after_optimizer_step(opt)
                opt.zero_grad()
            finally:
                for name, fn in originals.items():
                    setattr(dist, name, fn)
            # The gathers and reduce-scatters (on gloo: broadcasts, and scatters or, for small buffers, all-to-alls) and
            # the norm stay inside the shard group; the only collective across groups is one all-reduce of each unit's
            # gradient shard (half a unit), with its unused-parameter slot (see grad_flags.py).
            gathers = [c for c in calls if c[0] in ("scatter", "all_to_all_single", "broadcast") and c[2] > 1]
            assert gathers and all(ranks == mine for _, ranks, _ in gathers), (stage, gathers)
            across = [c for c in calls if c[1] == [rank % 2, rank % 2 + 2]]
            assert [c[0] for c in across] == ["all_reduce"] * len(sharded.units), (stage, across)
            assert sorted(n for _, _, n in across) == sorted(u.layout.shard_numel + 1 for u in sharded.units)
            assert all(c[1] in (mine, [rank % 2, rank % 2 + 2], list(range(world_size))) for c in calls)
            # The reference: every rank's batch, the mean gradient (what DDP computes).
            ref_opt.zero_grad()
            batches = [torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + r)) for r in range(4)]
            sum(reference(b).square().mean() for b in batches).div(4).backward()
            ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
            torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
            ref_opt.step()
        stats = sharded.comms()
        assert stats["shard"].stats.calls("all_gather") > 0 and stats["world"].stats.calls("all_gather") == 0
        assert stats["replicate"].stats.calls("all_gather") == 0
        # Across groups, per step: one all-reduce of each fp32 gradient shard between two ranks (ring: 2 x 1/2).
        shard_bytes = sum((u.layout.shard_numel + 1) * 4 for u in sharded.units)
        assert stats["replicate"].stats.by_kind["all_reduce"].bytes_sent == 2 * shard_bytes
        full = sharded.full_state_dict()
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(full[key], value, rtol=1e-6, atol=1e-7, msg=f"stage {stage}: {key}")
        sharded.release()


def _refused(rank: int, world_size: int) -> list[str]:
    from tests.models import ParityNet, quiet_trainer

    messages = []
    for make in (lambda: ZeRO3Strategy(shard_size=3), lambda: ZeRO1Strategy(shard_size=8)):
        trainer = quiet_trainer(strategy=make(), devices=world_size, max_steps=1)
        with pytest.raises(ValueError, match="does not divide the world size 4") as caught:
            trainer.fit(ParityNet())
        messages.append(str(caught.value))
    with pytest.raises(ValueError, match="shard_size=3 does not divide"):
        shard_model(nn.Linear(2, 2), stage=1, comm=Comm(), shard_size=3)
    return messages


def _fabric_run(strategy: Any, rank: int, world_size: int) -> dict[str, Any]:
    from lightning.fabric import Fabric

    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=world_size)
    fabric.launch()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=0.01))
    losses = []
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = model(x).square().mean()
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=0.05)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fabric.strategy.teardown()
    return {"losses": losses, "state": state}


def _four_ranks(rank: int, world_size: int) -> list[str]:
    """Every case that needs 4 ranks, in one process group (each spawn costs seconds of startup)."""
    _trainer_parity(rank, world_size)
    _groups_of_collectives(rank, world_size)
    from lightning_zero import fabric as zero_fabric

    ddp = _fabric_run("ddp", rank, world_size)
    for strategy in (zero_fabric.ZeRO1Strategy(shard_size=2), zero_fabric.ZeRO3Strategy(shard_size="node")):
        got = _fabric_run(strategy, rank, world_size)
        # "node" is the 4 local processes here: one shard group, today's plain ZeRO-3.
        assert strategy.resolved_shard_size() == (2 if isinstance(strategy, zero_fabric.ZeRO1Strategy) else 4)
        torch.testing.assert_close(got["losses"], ddp["losses"], rtol=1e-6, atol=0)
        for key, value in ddp["state"].items():
            torch.testing.assert_close(got["state"][key], value, rtol=1e-6, atol=1e-7, msg=key)
    return _refused(rank, world_size)


def test_every_stage_with_shard_groups_matches_ddp_collectives_stay_in_their_groups_and_bad_sizes_are_refused() -> None:
    messages = spawn(_four_ranks, world_size=4, timeout=450)
    assert all(m == messages[0] for m in messages)
    assert "Use one of [1, 2, 4]" in messages[0][0]


@pytest.mark.parametrize(
    ("shard_size", "local", "expected"), [(None, 8, 16), ("node", 8, 8), (4, None, 4), (16, 8, 16), (1, 8, 1)]
)
def test_resolve_shard_size(shard_size: Any, local: int | None, expected: int) -> None:
    assert resolve_shard_size(shard_size, world_size=16, local_world_size=local) == expected


@pytest.mark.parametrize("shard_size", [0, -2, 2.0, True, "nodes"])
def test_bad_shard_size_is_refused_at_construction(shard_size: Any) -> None:
    from lightning_zero import fabric as zero_fabric

    for strategy in (ZeRO2Strategy, zero_fabric.ZeRO2Strategy):
        with pytest.raises(ValueError, match="shard_size must be"):
            strategy(shard_size=shard_size)


# ---------------------------------------------------------------------------------------------- checkpoints
# Saved at 2 ranks without shard groups, resumed at 4 with shard_size=2, saved there, resumed at 2 again. The
# reference is DDPStrategy resumed from the same full file (it is DDP's own format); the sharded directories are
# compared with it too (the runs that wrote them match DDP).
SAVED_PLAIN = {"full": (lambda: "zero2", "plain-full"), "sharded": (lambda: _sharded(1), "plain-sharded")}
SAVED_HYBRID = {
    "full": (lambda: ZeRO3Strategy(shard_size=2), "hybrid-full"),
    "sharded": (lambda: _sharded(1, shard_size=2), "hybrid-sharded"),
}


def _sharded(stage: int, **kwargs: Any) -> Any:
    return (ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy)[stage - 1](checkpoint_format="sharded", **kwargs)


def _resume_and_compare(root: str, saved: dict, loaders: list[tuple[str, Any]], world_size: int) -> None:
    from tests.test_checkpoints import _run

    reference = _run(DDPStrategy(), world_size, ckpt_path=f"{root}/{saved['full'][1]}/epoch0.ckpt")
    assert reference.losses
    for kind, make in loaders:
        resumed = _run(make(), world_size, ckpt_path=f"{root}/{saved[kind][1]}/epoch0.ckpt")
        where = f"{kind} checkpoint {saved[kind][1]} resumed at {world_size} ranks"
        torch.testing.assert_close(resumed.losses, reference.losses, rtol=1e-6, atol=0, msg=where)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(resumed.state_dict()[key], value, rtol=1e-6, atol=1e-7, msg=f"{where}: {key}")


def _save(root: str, saved: dict, world_size: int) -> None:
    from tests.test_checkpoints import _run

    for make, directory in saved.values():
        _run(make(), world_size, directory=f"{root}/{directory}")


def _save_plain(rank: int, world_size: int, root: str) -> None:
    _save(root, SAVED_PLAIN, world_size)


def _resume_with_shard_groups_and_save(rank: int, world_size: int, root: str) -> None:
    _resume_and_compare(
        root,
        SAVED_PLAIN,
        [("full", lambda: ZeRO3Strategy(shard_size=2)), ("sharded", lambda: ZeRO2Strategy(shard_size=2))],
        world_size,
    )
    _save(root, SAVED_HYBRID, world_size)


def _resume_without_shard_groups(rank: int, world_size: int, root: str) -> None:
    _resume_and_compare(root, SAVED_HYBRID, [("full", lambda: "zero2"), ("sharded", lambda: "zero3")], world_size)


def test_checkpoints_move_between_shard_layouts_and_world_sizes(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    root = str(tmp_path)
    spawn(_save_plain, world_size=2, timeout=200, root=root)
    spawn(_resume_with_shard_groups_and_save, world_size=4, timeout=300, root=root)
    # Only the first shard group wrote the sharded pieces (ranks 0 and 1), each once.
    (shards,) = (tmp_path / "hybrid-sharded" / "epoch0.ckpt").glob("shards-*")
    metadata = dcp.FileSystemReader(str(shards)).read_metadata()
    pieces = [i for i in metadata.storage_data if i.fqn.startswith(("model/", "optim/")) and len(i.offset) == 1]
    files = {metadata.storage_data[index].relative_path for index in pieces}
    assert files == {"__0_0.distcp", "__1_0.distcp"}, files
    for fqn in {index.fqn for index in pieces}:  # the chunks tile each tensor exactly: no piece twice
        entry = metadata.state_dict_metadata[fqn]
        assert sum(chunk.sizes[0] for chunk in entry.chunks) == entry.size[0], fqn
    spawn(_resume_without_shard_groups, world_size=2, timeout=200, root=root)


def test_node_is_the_processes_of_one_node() -> None:
    strategy = ZeRO3Strategy(shard_size="node", parallel_devices=[torch.device("cpu")] * 4)
    strategy.num_nodes = 2  # what the Trainer sets from num_nodes=2, devices=4
    assert strategy.resolved_shard_size() == 4
    strategy.shard_size = 3
    with pytest.raises(ValueError, match=r"shard_size=3 does not divide the world size 8.*\[1, 2, 4, 8\]"):
        strategy.resolved_shard_size()
