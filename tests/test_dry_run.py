"""``dry-run``: one rank of an N-rank job on torch's fake process group (see [Note: dry run] in
``lightning_zero/tools/dry_run.py``). At world sizes 2, 8 and 64 its figures follow the theory; at world size 2 they
equal those of a real 2-rank run of the same model and batch (the check that the simulation is honest)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero.__main__ import main
from lightning_zero.driver.config import ZeROConfig
from lightning_zero.driver.driver import ZeRODriver
from lightning_zero.strategies.precision import ZeROPrecision
from lightning_zero.tools.dry_run_report import STATE_KEYS
from lightning_zero.tools.step_memory import StepMemory
from tests.distributed import spawn

ROOT = Path(__file__).resolve().parents[1]
TARGET = "examples/dry_run_gpt.py:GPTSmall"
SHAPE = (2, 64)


def _dry_runs(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cases one after another in one fresh process (a dry run joins a process group of its own): the first
    through the command line, the others through ``dry_run``."""
    out = ROOT / ".dry-run-cases.json"
    first, rest = cases[0], cases[1:]
    command = [sys.executable, "-m", "lightning_zero", "dry-run", TARGET, "--batch-shape", "2,64"]
    command += ["--unit-modules", "Block", "--json", str(out)]
    for key, value in first.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fake process group" in done.stdout
    reports = [json.loads(out.read_text())]
    script = (
        "import json, sys\n"
        "from lightning_zero.tools.dry_run import dry_run\n"
        "cases = json.loads(sys.argv[1])\n"
        f"reports = [dry_run({TARGET!r}, stage=int(c.pop('strategy')[-1]), unit_modules=['Block'], "
        f"batch_shape={SHAPE!r}, **c).as_dict() for c in cases]\n"
        "open(sys.argv[2], 'w').write(json.dumps(reports))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(rest), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reports += json.loads(out.read_text())
    out.unlink()
    return reports


def test_dry_run_follows_the_theory_at_2_8_and_64_ranks() -> None:
    cases = [
        {"strategy": strategy, "world_size": world} for world in (2, 8, 64) for strategy in ("zero1", "zero2", "zero3")
    ] + [{"strategy": "zero3", "world_size": 64, "shard_size": 8}]
    recomputed = [{"strategy": s, "world_size": 2, "activation_checkpointing": ["Block"]} for s in ("zero1", "zero3")]
    half = {"strategy": "zero3", "world_size": 8, "precision": "bf16-true"}
    reports = _dry_runs(cases + recomputed + [half])
    # bf16-true: the theory in bf16 (8Ψ/S of state, bf16 gathers, fp32 reductions), and the run's figures on it.
    report = reports.pop()
    assert abs(report["model_state_total"] - report["theory_model_state_bytes"]) <= 0.05 * report["model_state_total"]
    # Below 3Ψ by what is not gathered twice (the root unit, the last block of the forward: much of this small model).
    assert 0.8 <= report["bytes_sent_total"] / report["theory_bytes_sent_per_step"] <= 1.0, report
    assert abs(report["estimate"]["device_total"] - report["model_state_total"]) <= 0.05 * report["model_state_total"]
    assert abs(report["estimate"]["comm_bytes"] - report["bytes_sent_total"]) <= 0.01 * report["bytes_sent_total"]
    # activation_checkpointing_policy={Block}: the same model state and traffic, a lower peak in the step (the blocks
    # keep only their inputs for backward; how much lower varies by some percent from run to run: see docs/memory.md).
    for case, report in zip(recomputed, reports[len(cases) :]):
        plain = reports[cases.index({"strategy": case["strategy"], "world_size": 2})]
        assert report["model_state_bytes"] == plain["model_state_bytes"], case
        assert report["bytes_sent_per_step"] == plain["bytes_sent_per_step"], case
        saved, was = report["peak_step_bytes"]["total"], plain["peak_step_bytes"]["total"]
        assert saved < 0.95 * was, (case, saved, was)
    # The estimator's peak (model state, gathered units, and the activations profiled on a meta copy of the
    # module) beside the measured one: it leaves out the step's transients (gradients before their reduction, the
    # optimizer's temporaries), which show once checkpointing makes the activations small (docs/memory.md).
    for case, report in [(c, r) for c, r in zip(cases, reports) if c["world_size"] == 2] + list(
        zip(recomputed, reports[len(cases) :])
    ):
        measured, estimated = report["peak_step_bytes"]["total"], report["estimate"]["device_peak"]
        assert report["estimate"]["activations"] > 0, case
        assert 0.75 * measured <= estimated <= 1.15 * measured, (case, estimated, measured)
    for case, report in zip(cases, reports):
        stage, world = int(case["strategy"][-1]), case["world_size"]
        shard = case.get("shard_size", world)
        assert report["stage"] == stage and report["world_size"] == world and report["shard_size"] == shard
        # Model state at rest, fp32 Adam, up to padding: parameters 4Ψ (stages 1, 2) or 4Ψ/S (stage 3); gradients
        # 4Ψ/S under every stage (stage 1 too frees its full gradients once reduced); optimizer states 8Ψ/S.
        numel, state = report["numel"], report["model_state_bytes"]
        expected = {"params": 4 * numel / (shard if stage == 3 else 1), "grads": 4 * numel / shard}
        expected["optimizer_states"] = 8 * numel / shard
        for key, value in expected.items():
            assert abs(state[key] - value) <= 0.01 * value + 4 * 16 * 3, (case, key, state[key], value)
        if stage == 3:  # the theory's 16Ψ/S
            assert abs(report["model_state_total"] - report["theory_model_state_bytes"]) <= 0.05 * (16 * numel / shard)
        sent = report["bytes_sent_per_step"]
        gathers = sum(kinds.get("all_gather", 0) for kinds in sent.values())
        reductions = sum(kinds.get("reduce_scatter", 0) for kinds in sent.values())
        ring = 4 * report["numel"] * (shard - 1) / shard
        # Every gradient reduce-scattered once; parameters gathered once (stages 1, 2) or up to twice (stage 3:
        # the root and the last unit of forward stay gathered for backward).
        assert abs(reductions - ring) <= 0.02 * ring, (case, reductions, ring)
        low, high = (ring * 0.98, ring * 1.02) if stage < 3 else (ring * 1.0, ring * 2.02)
        assert low <= gathers <= high, (case, gathers, ring)
        # The estimator's bytes, from the same units: stage 3's root unit and the unit that ends the forward gathered
        # once, the others twice; what remains is the reductions' flag slots (one element per rank's chunk).
        assert abs(report["estimate"]["comm_bytes"] - report["bytes_sent_total"]) <= 0.01 * report["bytes_sent_total"]
        if shard != world:  # each gradient shard all-reduced across the replicas
            assert sent["replicate"]["all_reduce"] > 0
        assert report["peak_rss_bytes"] > 0 and report["wall_seconds"] > 0
        if stage == 3:
            assert report["peak_gathered_bytes"] > 0 and report["units_at_peak"]


def _real_run(rank: int, world_size: int, stage: int) -> dict[str, Any]:
    """The dry run's steps, on real gloo ranks: the same driver, model, batch and measurement."""
    import examples.dry_run_gpt as shapes

    torch.manual_seed(0)
    driver = ZeRODriver(ZeROConfig(stage=stage, unit_modules=["Block"], collective_checks="off"))
    plugin = ZeROPrecision("32-true")
    with driver.recording_init(torch.device("cpu")):
        module = shapes.GPTSmall()
        module.configure_model()
    sharded = driver.shard(module, device=torch.device("cpu"), param_dtype=None, prepare=plugin.convert_module)
    optimizer = module.configure_optimizers()["optimizer"]
    sharded.bind_optimizer(optimizer)
    x = torch.zeros(SHAPE, dtype=torch.long)
    before: Any = None
    at_rest: dict[str, int] = {}
    tracked: Any = None
    for step in range(2):
        if step == 1:
            before = sharded.comm.stats.snapshot()
            sharded.gathered.reset()
            at_rest = sharded.memory_stats()
            tracked = StepMemory(sharded.gathered).__enter__()
        sharded.begin_step()
        module.training_step((x, x.clone()), step).backward()
        sharded.end_step()
        with sharded.on_shards(optimizer):
            optimizer.step()
        sharded.after_optimizer_step(optimizer)
        if step == 0:
            optimizer.zero_grad()
    tracked.__exit__(None, None, None)
    sent = sharded.comm.stats.snapshot().since(before)
    stats = sharded.memory_stats()
    return {
        "state": {k: stats[k] for k in ("params", "master_params", "grads", "optimizer_states", "host_params")},
        "sent": {k: v.bytes_sent for k, v in sent.by_kind.items() if v.calls and k != "all_reduce"},
        "peak": sharded.gathered.peak,
        "peak_step": {
            "model_state_at_rest": sum(at_rest[k] for k in STATE_KEYS),
            "gathered": tracked.gathered_at_peak,
            "step_allocations": tracked.peak_allocated,
        },
        "largest_unit_bytes": max(u.layout.padded_numel for u in sharded.units) * 4,
    }


def test_dry_run_at_two_ranks_equals_a_real_two_rank_run() -> None:
    cases = [{"strategy": f"zero{stage}", "world_size": 2, "rank": rank} for stage in (1, 2, 3) for rank in (0, 1)]
    reports = iter(_dry_runs(cases))
    for stage in (1, 2, 3):
        for rank, real in enumerate(spawn(_real_run, world_size=2, stage=stage)):
            dry = next(reports)
            assert dry["model_state_bytes"] == real["state"], (stage, rank)
            sent = {k: v for k, v in dry["bytes_sent_per_step"]["world"].items() if k != "all_reduce"}
            assert sent == real["sent"], (stage, rank)
            assert dry["peak_gathered_bytes"] == real["peak"], (stage, rank)
            peak_step = dict(dry["peak_step_bytes"])
            assert peak_step.pop("total") == sum(peak_step.values()), (stage, rank)
            assert peak_step["step_allocations"] > 0 and (peak_step["gathered"] > 0) == (stage == 3), (stage, rank)
            # The fake backend completes every collective at once. A real gloo run may have a second reduction in
            # flight (its buffer not yet free for reuse: up to the reduce-buffer bound) and, having no
            # reduce-scatter, passes a small one through a temporary as large as the unit's gradients.
            extra = real["peak_step"]["step_allocations"] - peak_step.pop("step_allocations")
            bound = dry["reduce_buffer_bytes"] + real["largest_unit_bytes"]
            assert 0 <= extra <= bound, (stage, rank, extra, bound)
            real["peak_step"].pop("step_allocations")
            assert peak_step == real["peak_step"], (stage, rank)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--world-size", "2", "--rank", "5"],
            "argument --rank: must be in [0, 2) (one of the world_size ranks), got 5",
        ),
        (["--world-size", "3000000000"], "argument --world-size: must be at most 2,147,483,647 (torch's largest)"),
        (["--world-size", "x"], "argument --world-size: expected a whole number >= 1, got 'x'"),
        (["--world-size", "2", "--batch-shape", "0,8"], "argument --batch-shape: must be positive integers"),
        (["--world-size", "2", "--batch-shape=-1,8"], "argument --batch-shape: must be positive integers"),
        (["--world-size", "2", "--batch-shape", "1,x"], "argument --batch-shape: expected comma-separated integers"),
        (["--world-size", "4", "--shard-size", "3"], "argument --shard-size: shard_size=3 does not divide the world"),
        (["--world-size", "4", "--shard-size", "-2"], "argument --shard-size: expected a positive number of ranks"),
        (["--world-size", "2", "--precision", "64-true"], "argument --precision: must be one of"),
    ],
)
def test_cli_bad_numbers_are_refused_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as error:  # refused before the process group or the model
        main(["dry-run", TARGET, *argv])
    assert error.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_a_bad_number_or_a_batch_too_big_is_one_line_and_no_traceback() -> None:
    for argv, line in [
        (["--shard-size", "0"], "argument --shard-size: expected a positive number of ranks or 'node', got '0'"),
        # 8 PiB of token ids: beyond any address space, refused at the allocation whatever the overcommit policy
        (["--batch-shape", f"1,{2**50}"], "dry-run: rank 0 of 2 ran out of memory in this process"),
    ]:
        command = [sys.executable, "-m", "lightning_zero", "dry-run", TARGET, "--world-size", "2", *argv]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
        assert line in done.stderr.splitlines()[-1], done.stderr[-3000:]
