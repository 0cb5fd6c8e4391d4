"""The memory and communication estimator (``lightning_zero.planning``): arithmetic only, no processes (one
subprocess runs the command line, to see what a user sees of a bad number)."""

import doctest
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_zero.planning.arguments
import lightning_zero.planning.estimate
from lightning_zero import estimate_memory
from lightning_zero.__main__ import main
from lightning_zero.engine.core.layout import ShardLayout
from lightning_zero.engine.core.memory import theory_bytes, theory_comm_bytes
from lightning_zero.planning.arguments import ArgumentValueError, parse_bytes, parse_count
from lightning_zero.planning.estimate_report import INTER_NODE_GBPS, INTRA_NODE_GBPS, PCIE_GBPS
from lightning_zero.tools.targets import build_on_meta

ROOT = Path(__file__).resolve().parents[1]
PSI = 7_000_000_000
STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]


def totals(est):
    return {r.strategy: r.device.total for r in est.rows}


def test_docstring_examples_run() -> None:
    estimate = doctest.testmod(lightning_zero.planning.estimate)
    arguments = doctest.testmod(lightning_zero.planning.arguments)
    assert estimate.attempted >= 3 and arguments.attempted >= 2 and estimate.failed == arguments.failed == 0


def test_classic_fp32_figures() -> None:
    est = estimate_memory("7B", devices=8)
    assert totals(est) == {"ddp": 112e9, "zero1": 63e9, "zero2": 38.5e9, "zero3": 14e9}
    zero2 = est.row("zero2").device
    assert (zero2.params, zero2.grads, zero2.master, zero2.optimizer_states) == (28e9, 3.5e9, 0, 7e9)
    # The same as the engine's theory module, column by column, and its communication.
    for stage, row in zip([None, 1, 2, 3], est.rows):
        theory = theory_bytes(stage, PSI, 8)
        assert (row.device.params, row.device.grads, row.device.optimizer_states) == tuple(theory)
        assert row.comm_bytes == pytest.approx(theory_comm_bytes(stage, PSI, 8))
    assert est.row("zero1").comm_bytes == pytest.approx(49e9)
    assert est.row("zero3").comm_bytes == pytest.approx(73.5e9)
    assert est.row("zero3").comm_seconds == pytest.approx(73.5e9 / (INTRA_NODE_GBPS * 1e9))


@pytest.mark.parametrize("devices", [1, 2, 3, 8, 64, 1024, 4096])
def test_fp32_rows_follow_the_formulas(devices: int) -> None:
    n = devices
    est = estimate_memory(PSI, devices=devices)
    expected = {"ddp": 16 * PSI, "zero1": 8 * PSI + 8 * PSI / n, "zero2": 4 * PSI + 12 * PSI / n, "zero3": 16 * PSI / n}
    assert totals(est) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_rows_by_hand(precision: str) -> None:
    n = 8
    est = estimate_memory(PSI, devices=n, precision=precision)
    c, m, k = 2, 4, 8  # half compute copy, fp32 master (and sharded grads), Adam: two fp32 moments
    by_hand = {
        "ddp": (4 * PSI, 4 * PSI, 0, k * PSI),  # autocast: fp32 parameters and gradients
        "zero1": (c * PSI, c * PSI, m * PSI / n, k * PSI / n),
        "zero2": (c * PSI, m * PSI / n, m * PSI / n, k * PSI / n),
        "zero3": (0, m * PSI / n, m * PSI / n, k * PSI / n),  # no persistent half copy
    }
    for strategy, expected in by_hand.items():
        assert tuple(est.row(strategy).device) == pytest.approx(expected), strategy
    # DESIGN.md's table: DDP 16Ψ, stage 1 4Ψ + 12Ψ/N and stage 3 16Ψ/N agree with the paper; stage 2
    # keeps fp32 gradient shards, so 2Ψ + 16Ψ/N instead of the paper's 2Ψ + 14Ψ/N.
    assert totals(est) == pytest.approx(
        {"ddp": 16 * PSI, "zero1": 4 * PSI + 12 * PSI / n, "zero2": 2 * PSI + 16 * PSI / n, "zero3": 16 * PSI / n}
    )
    ring = (n - 1) / n
    assert [r.comm_bytes for r in est.rows] == pytest.approx(
        [8 * PSI * ring, 6 * PSI * ring, 6 * PSI * ring, 8 * PSI * ring]  # DDP fp32; RS fp32 + AG half; 2 AG + RS
    )


def test_half_true_and_overrides() -> None:
    est = estimate_memory(1000, devices=4, precision="bf16-true")
    assert tuple(est.row("ddp").device) == (2000, 2000, 0, 4000)  # bf16 states: 2 x 2 bytes
    assert tuple(est.row("zero3").device) == (500, 500, 0, 1000)
    sgd = estimate_memory(1000, devices=4, optimizer_state_bytes=0)
    assert sgd.row("zero1").device.optimizer_states == 0 and sgd.row("ddp").device.total == 8000
    fp32_compute = estimate_memory(1000, devices=4, precision="bf16-mixed", param_dtype_bytes=4, reduce_dtype_bytes=2)
    assert fp32_compute.row("zero2").device.params == 4000
    assert fp32_compute.row("zero1").comm_bytes == pytest.approx((1000 * 2 + 1000 * 4) * 3 / 4)
    assert estimate_memory(1000, precision="bf16").dtypes.precision == "bf16-mixed"  # Lightning's aliases


def test_offload_moves_sharded_state_to_cpu() -> None:
    n = 8
    on_device = estimate_memory(PSI, devices=n, precision="bf16-mixed")
    offloaded = estimate_memory(PSI, devices=n, precision="bf16-mixed", offload_optimizer=True)
    assert offloaded.row("ddp") == on_device.row("ddp")  # DDP has no offload
    for strategy in ["zero1", "zero2", "zero3"]:
        before, after = on_device.row(strategy), offloaded.row(strategy)
        assert tuple(after.cpu) == pytest.approx((0, 4 * PSI / n, 4 * PSI / n, 8 * PSI / n))
        assert after.device.master == after.device.optimizer_states == 0
        assert after.comm_bytes == before.comm_bytes
    assert tuple(offloaded.row("zero1").device) == (2 * PSI, 2 * PSI, 0, 0)  # full grads stay on the device
    assert tuple(offloaded.row("zero2").device) == (2 * PSI, 0, 0, 0)
    assert tuple(offloaded.row("zero3").device) == pytest.approx((2 * PSI / n, 0, 0, 0))  # compute shard kept
    # In fp32 the offloaded optimizer needs its own fp32 copy of the shard on the CPU.
    fp32 = estimate_memory(PSI, devices=n, offload_optimizer=True).row("zero3")
    assert tuple(fp32.cpu) == pytest.approx((0, 4 * PSI / n, 4 * PSI / n, 8 * PSI / n))
    assert fp32.device.params == pytest.approx(4 * PSI / n)


def test_world_size_one() -> None:
    est = estimate_memory(PSI)
    assert set(totals(est).values()) == {16 * PSI}
    assert all(r.comm_bytes == 0 and r.comm_seconds == 0 for r in est.rows)
    assert est.world_size == 1
    assert estimate_memory(PSI, memory_per_device="200GB").recommended.strategy == "ddp"


def test_bandwidth_defaults_and_override() -> None:
    assert estimate_memory(PSI, devices=8).bandwidth_gbps == INTRA_NODE_GBPS
    multi = estimate_memory(PSI, devices=8, nodes=4)
    assert multi.bandwidth_gbps == INTER_NODE_GBPS and multi.world_size == 32
    assert "several nodes" in multi.bandwidth_source and "25 GB/s" in multi.table()
    given = estimate_memory(PSI, devices=8, bandwidth_gbps=100)
    assert given.bandwidth_source == "given"
    assert given.row("zero1").comm_seconds == pytest.approx(49e9 / 100e9)
    assert any("one NVLink-class domain" in note for note in estimate_memory(PSI, devices=64).notes)


def test_stage3_gathered_units() -> None:
    unknown = estimate_memory(PSI, devices=8)
    assert unknown.row("zero3").gathered is None
    assert "not counted" in unknown.table()
    known = estimate_memory(PSI, devices=8, precision="bf16-mixed", largest_unit_params="200M", prefetch=2)
    assert known.row("zero3").gathered == 3 * 200e6 * 2  # (prefetch + 1) units in the compute dtype
    assert known.row("zero3").device_peak == 14e9 + 1.2e9


def test_recommendation() -> None:
    est = estimate_memory("7B", devices=8, memory_per_device="80GB")
    assert [r.fits for r in est.rows] == [False, True, True, True]
    assert est.recommended.strategy == "zero1"  # same traffic as stage 2, lower stage wins the tie
    assert "stage 1" in est.recommendation
    mixed = estimate_memory("7B", devices=8, precision="bf16-mixed", memory_per_device="30GB")
    assert mixed.recommended.strategy == "zero2"  # stage 1 needs 38.5 GB
    # Stage 3 holds 14 GB of shards plus 2 gathered units in bf16: 2 x 0.5B x 2 bytes fit in 16 GB, 2 x 1B do not.
    fits = estimate_memory(
        "7B", devices=8, precision="bf16-mixed", memory_per_device="16GB", largest_unit_params="500M"
    )
    assert fits.recommended.strategy == "zero3" and fits.row("zero3").device_peak == 16e9
    too_big = estimate_memory(
        "7B", devices=8, precision="bf16-mixed", memory_per_device="16GB", largest_unit_params="1B"
    )
    assert too_big.row("zero3").fits is False  # as asked for; the recommendation weighs offload as well:
    assert too_big.recommended.strategy == "zero2" and too_big.recommended.options(8) == {"offload_optimizer": True}
    assert "ZeRO2Strategy(offload_optimizer=True)" in too_big.recommendation
    roomy = estimate_memory("7B", devices=8, memory_per_device="1TB")
    assert roomy.recommended.strategy == "ddp"  # DDP fits and sends no more than stages 1 and 2
    assert estimate_memory("7B", devices=8).recommended is None


def test_recommendation_weighs_offload_and_says_when_nothing_fits() -> None:
    est = estimate_memory("175B", devices=8, precision="bf16-mixed", memory_per_device="80GB")
    assert not any(r.fits for r in est.rows)  # nothing fits as asked; offloading the optimizer does (43.75 GB)
    assert est.recommended.strategy == "zero3" and est.recommended.options(8) == {"offload_optimizer": True}
    assert est.recommended.device_peak == 2 * 175e9 / 8
    # Host copies per step: the gradient shard down (fp32), the updated bf16 shard up, at the PCIe bandwidth.
    assert est.recommended.host_bytes == pytest.approx((4 + 2) * 175e9 / 8)
    assert est.recommended.host_seconds == pytest.approx(est.recommended.host_bytes / (PCIE_GBPS * 1e9))
    # Gathered units of 25B parameters (100 GB in bf16) fit nowhere: nothing is recommended, and the text says why.
    est = estimate_memory(
        "175B", devices=8, precision="bf16-mixed", memory_per_device="80GB", largest_unit_params="25B"
    )
    assert est.recommended is None
    assert "nothing fits" in est.recommendation and "--offload-params" in est.recommendation
    assert "make the units smaller" in est.recommendation
    roomier = estimate_memory(
        "175B", devices=8, precision="bf16-mixed", memory_per_device="80GB", largest_unit_params="5B"
    )
    assert roomier.recommended is not None
    offloaded = estimate_memory(
        "175B", devices=8, precision="bf16-mixed", offload_optimizer=True, memory_per_device=80e9
    )
    assert offloaded.recommended.strategy == "zero3"


def test_parameter_offload() -> None:
    n = 8
    est = estimate_memory(PSI, devices=n, precision="bf16-mixed", offload_params=True)
    zero3 = est.row("zero3")
    assert tuple(zero3.device) == (0, 0, 0, 0) and zero3.offload_params and zero3.offload_optimizer
    # CPU: the bf16 compute shard, the fp32 gradient shard, master and Adam states.
    assert tuple(zero3.cpu) == pytest.approx((2 * PSI / n, 4 * PSI / n, 4 * PSI / n, 8 * PSI / n))
    # Per step: the gradient shard down, the bf16 shard up at each of the two gathers.
    assert zero3.host_bytes == pytest.approx((4 + 2 * 2) * PSI / n)
    # Stages 1 and 2 keep full parameters on the device: offload_params does not apply to them.
    assert not est.row("zero2").offload_params and est.row("zero2").device.params == 2 * PSI
    # In fp32 the master is the compute shard: nothing extra on the CPU.
    fp32 = estimate_memory(PSI, devices=n, offload_params=True).row("zero3")
    assert fp32.cpu.params == 0 and fp32.device.total == 0


def test_hybrid_sharding_memory_and_traffic_by_level() -> None:
    psi, nodes, per_node = 70 * 10**9, 8, 8
    world = nodes * per_node
    flat = estimate_memory(psi, devices=per_node, nodes=nodes, precision="bf16-mixed")
    hybrid = estimate_memory(psi, devices=per_node, nodes=nodes, precision="bf16-mixed", shard_size="node")
    assert hybrid.shard_size == 8 and flat.shard_size is None
    assert hybrid.row("ddp") == flat.row("ddp")
    for stage in (1, 2, 3):
        row = hybrid.row(f"zero{stage}")
        # States sharded over the node's 8 devices, as stage 3 over 8 devices on one node.
        one_node = estimate_memory(psi, devices=per_node, precision="bf16-mixed").row(f"zero{stage}")
        assert tuple(row.device) == pytest.approx(tuple(one_node.device))
        # Inside each node: what the stage sends on one node; across nodes: one ring all-reduce of the fp32
        # gradient shard over the 8 replicas.
        across = 2 * psi / per_node * 4 * (nodes - 1) / nodes
        assert row.intra_node_bytes == pytest.approx(one_node.comm_bytes)
        assert row.inter_node_bytes == pytest.approx(across)
        assert row.comm_seconds == pytest.approx(
            one_node.comm_bytes / (INTRA_NODE_GBPS * 1e9) + across / (INTER_NODE_GBPS * 1e9)
        )
        plain = flat.row(f"zero{stage}")  # every collective spans the nodes
        assert plain.intra_node_bytes == 0 and plain.inter_node_bytes == plain.comm_bytes
        assert plain.device.total < row.device.total  # sharded over 64 ranks rather than 8: less memory
    # A shard group of 2 inside nodes of 8: its collectives stay inside a node.
    pairs = estimate_memory(psi, devices=per_node, nodes=nodes, precision="bf16-mixed", shard_size=2)
    assert pairs.row("zero3").intra_node_bytes > 0 and pairs.shard_size == 2
    with pytest.raises(ValueError, match="does not divide the world size 64"):
        estimate_memory(psi, devices=per_node, nodes=nodes, shard_size=3)
    # The recommendation weighs hybrid sharding: with room for a node's shards, it keeps most traffic inside.
    roomy = estimate_memory(psi, devices=per_node, nodes=nodes, precision="bf16-mixed", memory_per_device="200GB")
    assert roomy.recommended.strategy == "zero3" and roomy.recommended.options(world) == {"shard_size": 8}
    assert "ZeRO3Strategy(shard_size=8)" in roomy.recommendation
    tight = estimate_memory(psi, devices=per_node, nodes=nodes, precision="bf16-mixed", memory_per_device="80GB")
    assert tight.recommended.strategy == "zero3" and tight.recommended.options(world) == {}


@pytest.mark.parametrize(
    ("text", "expected"),
    [("7B", 7 * 10**9), ("350M", 350 * 10**6), ("1.3b", 1_300_000_000), ("125000000", 125_000_000), ("125k", 125_000)],
)
def test_parse_count(text: str, expected: int) -> None:
    assert parse_count(text) == expected


@pytest.mark.parametrize("text", ["", "7X", "B", "-5", "1.5", "0.0005k", "7 B B", "1e", "1e400", "10000T"])
def test_parse_count_errors(text: str) -> None:
    with pytest.raises(ValueError, match="parameter count"):
        parse_count(text)


def test_parse_bytes() -> None:
    assert parse_bytes("80GB") == 80e9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("512MB") == 512e6
    assert parse_bytes("1.5 TB") == 1.5e12
    assert parse_bytes(1024) == parse_bytes("1024") == 1024
    for bad in ["x", "80 GX", "GB", "-1GB", "0GB"]:
        with pytest.raises(ValueError, match="bytes"):
            parse_bytes(bad)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"precision": "64-true"}, "bf16-mixed"),
        ({"devices": 0}, "devices must be"),
        ({"nodes": 0}, "nodes must be"),
        ({"prefetch": -1}, "prefetch must be"),
        ({"memory_per_device": "lots"}, "bytes"),
        ({"bandwidth_gbps": 0}, "bandwidth"),
        ({"optimizer_state_bytes": -1}, "optimizer_state_bytes"),
        ({"param_dtype_bytes": 2}, "mixed precision only"),
        ({"unit_modules": ["Block"]}, "needs a model"),
        ({"devices": 2**16, "nodes": 2**16}, "devices must be at most 32,767 with 65536 node"),
        ({"optimizer_state_bytes": float("inf")}, "optimizer_state_bytes must be a finite number"),
        ({"reduce_dtype_bytes": 3}, "reduce_dtype_bytes must be a dtype's bytes per element"),
        ({"largest_unit_params": 2000}, "largest_unit_params must be between 1 and the parameter count"),
        ({"largest_unit_params": 0}, "largest_unit_params must be between 1"),
        ({"shard_size": 3, "devices": 8}, "shard_size=3 does not divide the world size 8"),
    ],
)
def test_invalid_inputs(kwargs: dict, message: str) -> None:
    with pytest.raises(ArgumentValueError, match=message) as raised:  # a ValueError naming the argument
        estimate_memory(1000, **kwargs)
    assert raised.value.argument in kwargs, raised.value.argument
    for count, message in ((0, "the parameter count must be at least 1"), (-1, "whole number >= 0"), ("1e400", "2")):
        with pytest.raises(ArgumentValueError, match=message) as raised:
            estimate_memory(count)
        assert raised.value.argument == "model_or_numel"


def odd_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3), nn.Linear(3, 1, bias=False))
    model[2].bias.requires_grad_(False)  # a frozen parameter in a unit with a trainable one
    return model


def test_model_bytes_match_the_layout_by_hand() -> None:
    n = 3
    est = estimate_memory(odd_model(), devices=n, precision="bf16-mixed", unit_modules=[nn.Linear])
    units = [[35, 5], [15, 3], [3]]  # one unit per Linear, in registration order
    layouts = [ShardLayout.from_shapes([torch.Size([x]) for x in unit], n) for unit in units]
    assert [lay.padded_numel for lay in layouts] == [42, 18, 3]
    padded, shard = sum(lay.padded_numel for lay in layouts), sum(lay.shard_numel for lay in layouts)
    # Optimizer states: trainable elements in each rank's shards; all but the middle unit's bias are trainable.
    per_rank = [0] * n
    for lay, frozen in zip(layouts, [set(), {1}, set()]):
        for rank in range(n):
            per_rank[rank] += sum(p.numel for p in lay.param_shards(rank) if p.param_index not in frozen)
    assert per_rank == [21, 21, 16]
    assert (est.numel, est.trainable_numel, est.units) == (61, 58, 3)
    assert tuple(est.row("ddp").device) == (61 * 4, 58 * 4, 0, 58 * 8)
    assert tuple(est.row("zero1").device) == (padded * 2, 58 * 2, shard * 4, max(per_rank) * 8)
    assert tuple(est.row("zero2").device) == (padded * 2, shard * 4, shard * 4, max(per_rank) * 8)
    assert tuple(est.row("zero3").device) == (0, shard * 4, shard * 4, max(per_rank) * 8)
    assert est.row("zero3").gathered == 2 * 42 * 2  # (prefetch + 1) x the largest unit, gathered in bf16
    # Stage 3 gathers every unit twice but the last, which ends the forward and stays gathered for backward.
    assert est.row("zero3").comm_bytes == pytest.approx((padded * 4 + (2 * padded - 3) * 2) * (n - 1) / n)
    fp32 = estimate_memory(odd_model(), devices=n, unit_modules=[nn.Linear])
    assert tuple(fp32.row("zero3").device) == (shard * 4, shard * 4, 0, max(per_rank) * 8)


def test_model_units_follow_unit_modules() -> None:
    model = odd_model()
    whole = estimate_memory(model, devices=3, unit_modules=[])  # one unit: the root
    assert whole.units == 1
    assert whole.row("zero2").device.params == 63 * 4  # 61 padded to a multiple of 3
    assert whole.row("zero3").gathered == 63 * 4  # prefetch + 1 = 2 units, but there is only one
    # The root unit alone is held for the whole step: gathered once, so stage 3 sends what stage 2 sends.
    assert whole.row("zero3").comm_bytes == whole.row("zero2").comm_bytes == (63 * 4 + 63 * 4) * 2 / 3
    blocks = estimate_memory(model, devices=3, unit_modules=[nn.Linear])
    assert blocks.units == 3 and blocks.row("zero2") == estimate_memory(model, devices=3).row("zero2")
    with pytest.raises(ValueError, match="planned exactly"):
        estimate_memory(model, largest_unit_params=10)


def test_model_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(4)])
    est = estimate_memory(model, devices=8, unit_modules=[nn.Linear])
    assert est.numel == 4 * (4096 * 4096 + 4096)
    assert est.row("zero3").gathered == 2 * (4096 * 4096 + 4096) * 4


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7B", "--devices", "8"]) == 0
    out = capsys.readouterr().out
    words = " ".join(out.split())  # the assumptions below the table are wrapped
    for text in ["112 GB", "63 GB", "38.5 GB", "14 GB", "200 GB/s", "default for one node", "Recommendation"]:
        assert text in words
    lines = [line for line in out.splitlines() if line.startswith("| stage 2")]
    assert len(lines) == 1 and "38.5 GB" in lines[0]


def test_cli_several_sizes_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--params", "7B", "--devices", "8,64,1024", "--precision", "bf16-mixed", "--memory", "80GB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("| DDP ") == 3 and "on 1024 devices" in out
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["world_size"] for d in data] == [8, 64, 1024]
    assert [r["strategy"] for r in data[0]["rows"]] == STRATEGIES
    assert data[0]["rows"][3]["device"]["total"] == 14e9 and data[0]["recommended"] == "zero1"
    assert main(["estimate", "--params", "1.3B", "--devices", "8", "--nodes", "2", "--offload", "--json"]) == 0
    single = json.loads(capsys.readouterr().out)
    assert single["world_size"] == 16 and single["offload_optimizer"] and single["bandwidth_gbps"] == INTER_NODE_GBPS
    assert main(["estimate", "--params", "7B", "--bandwidth", "50", "--optimizer-state-bytes", "4"]) == 0
    assert "50 GB/s (given" in " ".join(capsys.readouterr().out.split())


def test_cli_hybrid_and_parameter_offload(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--params", "70B", "--devices", "8", "--nodes", "8", "--precision", "bf16-mixed"]
    assert main([*argv, "--shard-size", "node", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["shard_size"] == 8 and data["rows"][3]["inter_node_bytes"] == pytest.approx(61.25e9)
    assert main([*argv, "--shard-size", "node", "--inter-node-bandwidth", "50", "--memory", "200GB"]) == 0
    words = " ".join(capsys.readouterr().out.split())
    assert "sharded over groups of 8 (hybrid)" in words and "of which across nodes" in words and "50 GB/s" in words
    assert "Recommendation: stage 3 (ZeRO3Strategy(shard_size=8))" in words
    assert main(["estimate", "--params", "70B", "--devices", "8", "--precision", "bf16-mixed", "--offload-params"]) == 0
    words = " ".join(capsys.readouterr().out.split())
    assert "parameters offloaded to CPU" in words and "host copies" in words and "17.5 GB CPU" in words


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--params", "7B", "--devices", "8", "--shard-size", "3"], "does not divide"),
        (["--params", "7B", "--shard-size", "half"], "'node'"),
        (["--params", "seven"], "parameter count"),
        (["--params", "7B", "--devices", "8,x"], "comma"),
        (["--params", "7B", "--memory", "80XB"], "bytes"),
        (["--params", "7B", "--precision", "fp8"], "invalid choice"),
        (["--params", "7B", "--prefetch", "-1"], "prefetch"),
        (["--params", "0"], "argument --params: must be at least 1, got 0"),
        (["--params", "1e400"], "argument --params: a parameter count must be at most 2**53"),
        (["--params", "7B", "--bandwidth", "-1"], "argument --bandwidth: must be positive (GB/s), got -1.0"),
        (["--params", "7B", "--pcie-bandwidth", "0"], "argument --pcie-bandwidth: must be positive"),
        (["--params", "7B", "--optimizer-state-bytes", "inf"], "argument --optimizer-state-bytes: must be a finite"),
        (["--params", "7B", "--largest-unit", "8B"], "argument --largest-unit: must be between 1 and the parameter"),
        (["--params", "7B", "--accumulate-grad-batches", "0"], "argument --accumulate-grad-batches: must be an"),
        (["--params", "7B", "--nodes", "x"], "argument --nodes: expected a whole number >= 1, got 'x'"),
        (["--params", "7B", "--devices", "3000000000"], "argument --devices: must be at most 2,147,483,647"),
        (["--params", "7B", "--reduce-dtype-bytes", "3"], "argument --reduce-dtype-bytes: must be a dtype's bytes"),
        (["--params", "7B", "--unit-modules", "Block"], "argument --unit-modules: needs a model"),
        ([], "the model is required: --params"),
        (["examples/dry_run_gpt.py:GPTSmall", "--params", "7B"], "not both"),
        (["examples/nowhere.py:GPT"], "argument FILE.py:CLASS: 'examples/nowhere.py' is not a file"),
    ],
)
def test_cli_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as error:
        main(["estimate", *argv])
    assert error.value.code == 2
    assert message in capsys.readouterr().err


def test_accumulation_rows_count_both_modes_per_optimizer_step_and_may_be_recommended() -> None:
    one = estimate_memory("1B", devices=8)
    four = estimate_memory("1B", devices=8, accumulate_grad_batches=4)
    assert [(r.strategy, r.accumulate) for r in one.rows] == [
        ("ddp", None),
        ("zero1", None),
        ("zero2", None),
        ("zero3", None),
    ]
    rows = {(r.strategy, r.accumulate): r for r in four.rows}
    assert list(rows) == [
        ("ddp", None),
        ("zero1", None),
        ("zero2", "sharded"),
        ("zero3", "sharded"),
        ("zero2", "local"),
        ("zero3", "local"),
    ]
    reduction = one.row("zero1").comm_bytes / 2  # fp32: stage 1's reduce-scatter sends what its all-gather sends
    # Per optimizer step: DDP and stage 1 as without accumulation; stage 2 three reduce-scatters more than "local",
    # which sends what stage 1 sends; stage 3 gathers each unit twice per micro-batch either way.
    assert rows[("ddp", None)].comm_bytes == one.row("ddp").comm_bytes
    assert rows[("zero2", "local")].comm_bytes == rows[("zero1", None)].comm_bytes == one.row("zero1").comm_bytes
    assert rows[("zero2", "sharded")].comm_bytes == pytest.approx(rows[("zero2", "local")].comm_bytes + 3 * reduction)
    assert rows[("zero3", "sharded")].comm_bytes == pytest.approx(rows[("zero3", "local")].comm_bytes + 3 * reduction)
    assert rows[("zero3", "local")].comm_bytes == pytest.approx(one.row("zero3").comm_bytes + 6 * reduction)
    # Memory: "local" holds the full gradients, as stage 1 does; "sharded" the shard.
    assert rows[("zero3", "local")].device.grads == rows[("zero1", None)].device.grads == 4e9
    assert rows[("zero3", "sharded")].device.grads == one.row("zero3").device.grads
    # Where stage 3 with local accumulation fits and nothing faster does, it is the recommendation.
    fitting = estimate_memory(
        "7B", devices=8, precision="bf16-mixed", accumulate_grad_batches=4, memory_per_device="26GB"
    )
    assert fitting.recommended is not None and fitting.recommended.options(8) == {"accumulate": "local"}
    assert "ZeRO3Strategy(accumulate='local')" in fitting.recommendation


def test_cli_a_bad_number_is_one_line_with_exit_status_2_and_no_traceback() -> None:
    command = [sys.executable, "-m", "lightning_zero", "estimate", "--params", "1e400", "--devices", "8"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "python -m lightning_zero estimate: error: argument --params: a parameter count must be at most 2**53 "
        "(about 9.0e15), got '1e400'"
    )


def test_cli_takes_a_model_as_dry_run_does(capsys: pytest.CaptureFixture[str]) -> None:
    target = f"{ROOT}/examples/dry_run_gpt.py:GPTSmall"
    assert main(["estimate", target, "--devices", "8", "--unit-modules", "Block", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    module = build_on_meta(target)  # on the meta device: shapes only
    assert all(p.is_meta for p in module.parameters())
    expected = estimate_memory(module, devices=8, unit_modules=["Block"]).as_dict()
    assert printed == expected and printed["numel"] == sum(p.numel() for p in module.parameters())
