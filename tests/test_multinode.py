"""Multi-node runs: two torchrun "nodes" on localhost, and SLURM detection.

``test_two_nodes_with_torchrun_match_one_node`` starts two ``torchrun --nnodes 2`` invocations, one
per node rank, as a user would on two machines, each running ``tests/multinode_job.py`` with
``Trainer(devices=1, num_nodes=2)``; then trains the same model on one node with two devices. The
losses and the parameters must be bitwise equal (2 ranks over gloo either way), and each node must
have seen its own node rank, a world of two and an engine sharded over both ranks.

``test_slurm_environment_is_detected`` sets the variables ``srun`` gives each task of a 2-node x
1-task job and checks that the ZeRO strategies pick ``SLURMEnvironment`` and read ranks, address
and port from it exactly as ``DDPStrategy`` does, without launching processes of their own.

``test_ranks_before_fit_match_ddp``: with Lightning's own launcher on node 1 (``NODE_RANK=1``), the Trainer
must report the same world size and ranks as under ``DDPStrategy`` as soon as it is built, not only once
``fit`` has set up the processes.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

import lightning_zero  # noqa: F401  registers the strategy names
from lightning_zero import ZeRO3Strategy
from tests.distributed import free_port, spawn
from tests.multinode_job import MAX_STEPS, train
from tests.test_examples import TINY

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "multinode_job.py"
STRATEGIES = ("zero3", "zero1")
TIMEOUT = 180.0  # seconds for both nodes together; a hang fails the test instead of blocking CI

# Variables that would make Lightning or torchrun pick another environment than the one under test.
_FOREIGN = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "OMPI_COMM_WORLD_SIZE",
    "LSB_JOBID",
    "PMI_SIZE",
)


# --------------------------------------------------------------------------- two nodes


def _node_command(
    launcher: str, node_rank: int, port: int, out_dir: Path, per_node: int = 1, strategies: tuple[str, ...] = STRATEGIES
) -> tuple[list[str], dict[str, str]]:
    """What node ``node_rank`` runs: torchrun, or the job itself with the variables ``srun`` would set."""
    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN and not k.startswith("SLURM_")}
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        }
    )
    job = [str(JOB), str(out_dir), "--devices", str(per_node), *strategies]
    if launcher == "torchrun":
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", str(per_node)]
        rendezvous = ["--node_rank", str(node_rank), "--master_addr", "127.0.0.1", "--master_port", str(port)]
        return [*torchrun, *rendezvous, *job], env
    # srun --nodes 2 --ntasks-per-node 1: one task per node; the address comes from the node list.
    env.update(
        {
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "multinode_job",
            "SLURM_NODELIST": "127.0.0.1",
            "SLURM_NNODES": "2",
            "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "1",
            "SLURM_PROCID": str(node_rank),
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": str(node_rank),
            "MASTER_PORT": str(port),  # rather than 15000 + the job id's last digits, which may be taken
        }
    )
    return [sys.executable, *job], env


def _run_two_nodes(
    launcher: str, out_dir: Path, log_dir: Path, per_node: int = 1, strategies: tuple[str, ...] = STRATEGIES
) -> None:
    """Both nodes at once; fail with their logs if either fails or they outlive TIMEOUT."""
    port = free_port()
    procs: list[tuple[subprocess.Popen, Path]] = []
    try:
        for node_rank in (0, 1):
            cmd, env = _node_command(launcher, node_rank, port, out_dir, per_node, strategies)
            log = log_dir / f"node{node_rank}.log"
            with open(log, "w") as fh:  # the child keeps its own copy of the descriptor
                # A session of its own, so that a timeout can kill it with all its children.
                proc = subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
                )
            procs.append((proc, log))
        deadline = time.monotonic() + TIMEOUT
        # A node that fails leaves the other waiting in a collective: fail as soon as one exits non-zero.
        while None in [proc.poll() for proc, _ in procs]:  # a list, not any(): poll (and reap) every node
            failed = [(log.name, proc.returncode) for proc, log in procs if proc.returncode not in (None, 0)]
            if failed:
                pytest.fail(f"{failed[0][0]}: {launcher} node exited with {failed[0][1]}\n{_logs(procs)}")
            if time.monotonic() > deadline:
                pytest.fail(f"the two-node run did not finish within {TIMEOUT:.0f}s (hang?)\n{_logs(procs)}")
            time.sleep(0.2)
        for proc, log in procs:
            assert proc.returncode == 0, f"{log.name}: {launcher} node exited with {proc.returncode}\n{_logs(procs)}"
    finally:
        _stop(procs, out_dir)


def _stop(procs: list[tuple[subprocess.Popen, Path]], out_dir: Path) -> None:
    """Stop what a failed or hung run left: each node (torchrun stops its workers on SIGTERM), then the rest.

    torchrun starts its workers in sessions of their own, so killing torchrun's group does not reach them;
    each worker records its pid in ``out_dir``, and any of those still running the job is killed by pid.
    """
    running = [proc for proc, _ in procs if proc.poll() is None]
    for proc in running:
        proc.terminate()
    for proc in running:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for pid_file in out_dir.glob("worker-*.pid"):
        pid = int(pid_file.read_text())
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # gone already (or no /proc: nothing more to do)
            continue
        if JOB.name.encode() in cmdline:
            os.kill(pid, signal.SIGKILL)


def _logs(procs: list[tuple[subprocess.Popen, Path]]) -> str:
    return "\n".join(f"--- {log.name} (last 3000 chars)\n{log.read_text()[-3000:]}" for _, log in procs)


def _reference(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {name: train(name, devices=2, num_nodes=1) for name in STRATEGIES}


@pytest.fixture(scope="module")
def one_node() -> list[dict[str, Any]]:
    """The same training on one node with two devices (two processes), by global rank."""
    return spawn(_reference, world_size=2, timeout=TIMEOUT)


@pytest.mark.parametrize(
    ("launcher", "environment"), [("torchrun", "TorchElasticEnvironment"), ("srun", "SLURMEnvironment")]
)
def test_two_nodes_match_one_node(
    launcher: str, environment: str, one_node: list[dict[str, Any]], tmp_path: Path
) -> None:
    out_dir, log_dir = tmp_path / "out", tmp_path / "logs"
    out_dir.mkdir()
    log_dir.mkdir()
    _run_two_nodes(launcher, out_dir, log_dir)
    nodes = [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(2)]

    for rank, (node, one) in enumerate(zip(nodes, one_node)):
        # torchrun or "srun", not Lightning, made the processes: rank r on node r, one process per node.
        if launcher == "torchrun":
            assert node["env"] == {"RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": str(rank)}
        else:
            assert node["env"] == {"SLURM_PROCID": str(rank), "SLURM_LOCALID": "0", "SLURM_NODEID": str(rank)}
        for name in STRATEGIES:
            got, want = node[name], one[name]
            where = f"{name} under {launcher}, global rank {rank}"
            seen = got["seen"]
            assert seen["cluster_environment"] == environment, where
            assert seen["creates_processes_externally"] is True, where
            assert (seen["world_size"], seen["num_nodes"], seen["num_devices"]) == (2, 2, 1), where
            assert (seen["node_rank"], seen["global_rank"], seen["local_rank"]) == (rank, rank, 0), where
            assert (seen["process_group_world_size"], seen["process_group_rank"]) == (2, rank), where
            # The engine shards over both ranks, across the two nodes: each holds half of every unit.
            assert (seen["comm_world_size"], seen["comm_rank"]) == (2, rank), where
            assert seen["comm_bytes_sent"] > 0, where
            assert seen["layouts"], where
            assert all(ws == 2 and 2 * shard == padded for ws, _, padded, shard in seen["layouts"]), where
            numel = sum(n for _, n, _, _ in seen["layouts"])
            padded = sum(p for _, _, p, _ in seen["layouts"])
            assert seen["optimizer_state_bytes"] == 2 * 4 * padded // 2, where  # AdamW: 2 fp32 states, half each
            if name == "zero3":  # stage 3 keeps only its half of the parameters between steps
                assert seen["param_bytes"] == 4 * padded // 2, where
                assert seen["param_bytes"] < 4 * numel, where
            # The single-node run saw one node with two devices, and the same engine.
            ref_seen = want["seen"]
            assert (ref_seen["world_size"], ref_seen["num_nodes"], ref_seen["num_devices"]) == (2, 1, 2), where
            assert (ref_seen["node_rank"], ref_seen["global_rank"], ref_seen["local_rank"]) == (0, rank, rank), where
            assert ref_seen["layouts"] == seen["layouts"], where
            # Same training, bit for bit.
            assert got["trained"] and got["global_step"] == want["global_step"] == MAX_STEPS, where
            assert len(got["losses"]) == MAX_STEPS, where
            assert got["losses"] == want["losses"], where
            assert got["state"].keys() == want["state"].keys(), where
            for key, value in want["state"].items():
                assert torch.equal(got["state"][key], value), f"{where}: {key}"
    # After fit every rank holds the full parameters, and they agree across the nodes.
    for name in STRATEGIES:
        for key, value in nodes[0][name]["state"].items():
            assert torch.equal(nodes[1][name]["state"][key], value), f"{name}: {key} differs between the nodes"


def test_hybrid_sharding_over_two_torchrun_nodes_matches_ddp(tmp_path: Path) -> None:
    """2 torchrun "nodes" x 2 processes; ``shard_size="node"`` shards inside each node and trains as DDP does."""
    out_dir, log_dir = tmp_path / "out", tmp_path / "logs"
    out_dir.mkdir()
    log_dir.mkdir()
    hybrid = ("zero2-node", "zero3-node")
    _run_two_nodes("torchrun", out_dir, log_dir, per_node=2, strategies=("ddp", *hybrid))
    ranks = [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(4)]
    for rank, result in enumerate(ranks):
        node = rank // 2
        assert result["env"]["GROUP_RANK"] == str(node) and result["env"]["WORLD_SIZE"] == "4"
        ddp = result["ddp"]
        for name in hybrid:
            got, where = result[name], f"{name}, global rank {rank}"
            seen = got["seen"]
            assert (seen["world_size"], seen["num_nodes"], seen["num_devices"], seen["node_rank"]) == (4, 2, 2, node)
            # States sharded over the node's two processes (a shard group per node), not over all four.
            assert seen["shard_group_ranks"] == [2 * node, 2 * node + 1], where
            assert all(ws == 2 and 2 * shard == padded for ws, _, padded, shard in seen["layouts"]), where
            # DDP's training: 4 ranks over gloo sum in another order than DDP's bucket, so to rounding.
            assert got["global_step"] == ddp["global_step"] == MAX_STEPS, where
            torch.testing.assert_close(got["losses"], ddp["losses"], rtol=1e-6, atol=0, msg=where)
            for key, value in ddp["state"].items():
                torch.testing.assert_close(got["state"][key], value, rtol=1e-6, atol=1e-7, msg=f"{where}: {key}")


# --------------------------------------------------------------------------- SLURM


def _clear_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset every variable that selects a cluster environment, for the rest of the test."""
    for name in [*_FOREIGN, *(k for k in os.environ if k.startswith("SLURM_"))]:
        # setenv first, so that the undo also removes what the test adds (SLURMEnvironment writes MASTER_*).
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def _slurm_task(monkeypatch: pytest.MonkeyPatch, node: int) -> None:
    """The environment ``srun`` gives the one task on node ``node`` of ``sbatch --nodes 2 --ntasks-per-node 1``."""
    _clear_launch_env(monkeypatch)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # or the launcher would set it (and torch's threads) for good
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NAME", "train_gpt")
    monkeypatch.setenv("SLURM_NODELIST", "gpu[017-018]")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[017-018]")
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_NPROCS", "2")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "1")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "1(x2)")
    monkeypatch.setenv("SLURM_PROCID", str(node))
    monkeypatch.setenv("SLURM_LOCALID", "0")
    monkeypatch.setenv("SLURM_NODEID", str(node))
    monkeypatch.setenv("SLURMD_NODENAME", f"gpu{17 + node:03d}")
    monkeypatch.setenv("SLURM_STEP_ID", "0")


def _what_lightning_sees(strategy: Any) -> dict[str, Any]:
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, num_nodes=2, logger=False, enable_progress_bar=False
    )
    env = trainer.strategy.cluster_environment
    launcher = trainer.strategy.launcher
    return {
        "environment": type(env),
        "creates_processes_externally": env.creates_processes_externally,
        "launcher": type(launcher),
        "launcher_counts": (launcher.num_processes, launcher.num_nodes),
        "trainer": (trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.world_size),
        "num": (trainer.num_nodes, trainer.num_devices),
        "main": (env.main_address, env.main_port),
        "sampler": trainer.strategy.distributed_sampler_kwargs,
        "trainer_object": trainer,
    }


@pytest.mark.parametrize("node", [0, 1])
def test_slurm_environment_is_detected(monkeypatch: pytest.MonkeyPatch, node: int) -> None:
    monkeypatch.setattr(rank_zero_only, "rank", rank_zero_only.rank)  # DDPStrategy sets it; undone after the test
    _slurm_task(monkeypatch, node)
    ddp = _what_lightning_sees("ddp")
    started: list[str] = []  # strategies whose launcher tried to start processes
    for strategy in ("zero3", "zero1", "zero2", ZeRO3Strategy(unit_modules=["Linear"])):
        # the MASTER_* variables SLURMEnvironment wrote for DDP must not help the next one
        monkeypatch.delenv("MASTER_ADDR", raising=False)
        monkeypatch.delenv("MASTER_PORT", raising=False)
        got = _what_lightning_sees(strategy)
        where = f"{strategy} on node {node}"
        assert got["environment"] is SLURMEnvironment, where
        assert got["creates_processes_externally"] is True, where
        assert got["trainer"] == (node, 0, node, 2), where  # global, local, node rank; world size
        assert got["num"] == (2, 1), where
        assert got["main"] == ("gpu017", 15000 + 4242), where  # first host of the list; port from the job id
        assert got["sampler"] == {"num_replicas": 2, "rank": node}, where
        for key in ("environment", "creates_processes_externally", "trainer", "num", "main", "sampler"):
            assert got[key] == ddp[key], f"{where}: {key} {got[key]} != DDP's {ddp[key]}"
        assert got["launcher"] is ddp["launcher"] is _SubprocessScriptLauncher, where
        assert got["launcher_counts"] == ddp["launcher_counts"] == (1, 2), where
        # Launching runs the function in this process and starts no other (srun started them all).
        trainer = got["trainer_object"]
        launcher = trainer.strategy.launcher
        monkeypatch.setattr(launcher, "_call_children_scripts", functools.partial(started.append, where))
        assert launcher.launch(lambda: "ran here", trainer=trainer) == "ran here", where
        assert started == [] and launcher.procs == [], where


# --------------------------------------------------------------------------- Lightning's own launcher


def test_ranks_before_fit_match_ddp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 1 of ``NODE_RANK=1 MASTER_ADDR=... python train.py`` with ``devices=2, num_nodes=2``, before fit."""
    monkeypatch.setattr(rank_zero_only, "rank", rank_zero_only.rank)
    _clear_launch_env(monkeypatch)
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    seen = {}
    for strategy in ("ddp", "zero3"):
        rank_zero_only.rank = 0
        trainer = L.Trainer(
            strategy=strategy, accelerator="cpu", devices=2, num_nodes=2, logger=False, enable_progress_bar=False
        )
        seen[strategy] = (trainer.world_size, trainer.global_rank, trainer.is_global_zero, rank_zero_only.rank)
    assert seen["ddp"] == (4, 2, False, 2)
    assert seen["zero3"] == seen["ddp"]  # today: (1, 0, True, 0)


# --------------------------------------------------------------------------- the cluster examples
CLUSTER = Path(__file__).resolve().parents[1] / "examples" / "cluster"
TINY_GPT = [*TINY, "--max-steps", "4", "--val-check-interval", "4", "--sample-chars", "10"]


def test_torchrun_example_script_trains_on_two_localhost_nodes(tmp_path: Path) -> None:
    script = CLUSTER / "torchrun_multinode.sh"
    port = free_port()
    procs = []
    try:
        for node in (0, 1):
            env = {
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "NODE_RANK": str(node),
                "NNODES": "2",
                "NPROC_PER_NODE": "1",
                "ACCELERATOR": "cpu",
                "OMP_NUM_THREADS": "1",
            }
            args = ["bash", str(script), *TINY_GPT, "--output", str(tmp_path / f"node{node}")]
            log = open(tmp_path / f"node{node}.log", "w")
            procs.append(
                (subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log)
            )
        for proc, _ in procs:
            proc.wait(timeout=240)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
    outputs = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    assert [p.returncode for p, _ in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "=== train_gpt summary (zero3, 2 x cpu, 32-true)" in outputs[0]
    assert "communication:" in outputs[0]


def test_sbatch_example_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(CLUSTER / "train_gpt.sbatch")], check=True)
