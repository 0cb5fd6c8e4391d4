"""The engine on its own (no Lightning): parity with DDP, collectives, memory, optimizer checks."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_zero.engine import (
    Comm,
    ShardedModel,
    UnsupportedOptimizerError,
    check_elementwise,
    module_class_policy,
    owns_parameters,
    shard_model,
)
from lightning_zero.engine.core.grouping import default_unit_policy
from lightning_zero.engine.core.memory import theory_bytes, theory_comm_bytes
from lightning_zero.engine.core.placeholder import ShardedParameterReadError
from lightning_zero.engine.core.unit import ShardedParameterWriteError
from lightning_zero.engine.errors import ShardedGradientError
from lightning_zero.engine.schedule.reduce import reduce_numel, reduce_width
from tests.distributed import spawn


class TiedNet(nn.Module):
    """A root-level parameter, a weight tied across submodules, and a block called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.scale = nn.Parameter(torch.ones(8))
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) * self.scale
        for _ in range(2):
            h = h + self.down(torch.relu(self.up(h)))
        return self.head(h)


def blocks(model: nn.Module):
    """The default units without the small-model rule: these test models are tiny, and the tests need units."""
    return default_unit_policy(model, whole_model_below=0)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 16), nn.ReLU(), nn.Linear(16, 3))


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _tied_pair(stage: int, kind: str, **options: object):
    """The same ``TiedNet`` twice from seed 0: under DDP with its optimizer, and sharded with its own."""
    torch.manual_seed(0)
    reference = TiedNet()
    model = copy.deepcopy(reference)
    ddp = DistributedDataParallel(reference)
    ref_opt = _optimizer(kind, ddp.parameters())
    sharded = shard_model(model, stage=stage, comm=Comm(), **options)
    opt = _optimizer(kind, model.parameters())
    sharded.bind_optimizer(opt)
    return reference, model, ddp, ref_opt, sharded, opt


def _ddp_step(ddp: nn.Module, ref_opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    ref_loss = nn.functional.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
    ref_opt.zero_grad()
    ref_loss.backward()
    ref_opt.step()
    return ref_loss


def _parity(rank: int, world_size: int) -> None:
    for stage in (1, 2, 3):
        for kind in ("sgd", "adamw"):
            reference, model, ddp, ref_opt, sharded, opt = _tied_pair(stage, kind)
            data = torch.Generator().manual_seed(rank)
            for _ in range(4):
                x, y = torch.randint(0, 11, (4, 5), generator=data), torch.randint(0, 11, (4, 5), generator=data)
                ref_loss = _ddp_step(ddp, ref_opt, x, y)
                with sharded.step_context():
                    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                    opt.zero_grad()
                    loss.backward()
                opt.step()
                sharded.after_optimizer_step(opt)
                # Two ranks: dividing by 2 is exact and a sum of two is order-free, so bitwise equal.
                assert loss.item() == ref_loss.item(), (stage, kind)
            full = sharded.full_state_dict()
            for key, value in reference.state_dict().items():
                assert torch.equal(full[key], value), (stage, kind, key)
            full_opt = sharded.full_optimizer_state_dict(opt)
            ref_state = ref_opt.state_dict()
            assert full_opt["param_groups"] == ref_state["param_groups"]
            for index, state in ref_state["state"].items():
                for key, value in state.items():
                    assert torch.equal(full_opt["state"][index][key], value), (stage, kind, index, key)
            sharded.release()
            assert all(p.grad is None for p in model.parameters())


def test_engine_matches_ddp_bitwise_on_two_ranks() -> None:
    spawn(_parity, world_size=2)


class SometimesNet(nn.Module):
    """``extra`` runs only where ``use`` is set: per rank and per micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.extra, self.b = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.use = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h + self.extra(h) if self.use else h)


def _used_on_some_ranks_across_micro_batches(rank: int, stage: int, check_finite: bool) -> None:
    """A layer used on some ranks (under stage 3: on all or none), or none, in each micro-batch: its sharded gradient
    exists at the step exactly where DDP's (``find_unused_parameters=True``) does, although backward attached every
    shard unread (see [Note: flags read at the step] in grad_flags.py). SGD with momentum: a gradient of zeros where DDP
    has none moves the parameter."""
    torch.manual_seed(0)
    reference = SometimesNet()
    model = copy.deepcopy(reference)
    ddp = DistributedDataParallel(reference, find_unused_parameters=True)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    sharded = shard_model(model, stage=stage, comm=Comm(), units=owns_parameters)
    sharded.reducer.check_finite = check_finite
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sharded.bind_optimizer(opt)
    data = torch.Generator().manual_seed(rank)
    # Each set: the ranks that use ``extra`` in that backward pass.
    script = ["zero", {0}, set(), "step", "zero", set(), set(), "step", "zero", {1}, "step"]
    script += ["zero", set(), {0, 1}, "step", set(), "step", "zero", {1}, {0}, "step"]
    for action in script:
        if action == "zero":
            ref_opt.zero_grad()
            opt.zero_grad()
        elif action == "step":
            ref_opt.step()
            opt.step()
            sharded.after_optimizer_step(opt)
        else:
            x = torch.randn(4, 6, generator=data)
            # Stage 3 gathers a unit where it runs: every rank must run the same modules.
            reference.use = model.use = rank in action if stage < 3 else bool(action)
            ddp(x).square().mean().backward()
            with sharded.step_context():
                model(x).square().mean().backward()
    state = model.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-7, msg=f"{stage} {check_finite} {key}")
    sharded.release()


def _zero_grad_semantics(rank: int, world_size: int) -> None:
    """The user's optimizer holds the module's parameters, so ``zero_grad`` only sees markers (markers.py): every
    order of backward, ``zero_grad`` (both kinds) and ``step`` must still mean what it means under DDP."""
    for stage in (1, 2, 3):
        for check_finite in (False, True):
            _used_on_some_ranks_across_micro_batches(rank, stage, check_finite)
        torch.manual_seed(0)
        reference = TiedNet()
        model = copy.deepcopy(reference)
        ddp = DistributedDataParallel(reference)
        ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        sharded = shard_model(model, stage=stage, comm=Comm(), units=owns_parameters)  # a unit per layer
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sharded.bind_optimizer(opt)
        data = torch.Generator().manual_seed(rank)
        # Accumulate over two backward passes; zero with set_to_none=False; no zero_grad after a step (DDP adds
        # onto the old gradients); a backward whose gradients are thrown away; a step with no gradient at all.
        script = ["zero", "bwd", "bwd", "step", "zero_keep", "bwd", "step", "bwd", "step"]
        script += ["zero", "bwd", "zero", "bwd", "step", "zero", "step"]
        for action in script:
            if action == "bwd":
                x, y = torch.randint(0, 11, (4, 5), generator=data), torch.randint(0, 11, (4, 5), generator=data)
                nn.functional.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).backward()
                with sharded.step_context():
                    nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            elif action.startswith("zero"):
                ref_opt.zero_grad(set_to_none=action == "zero")
                opt.zero_grad(set_to_none=action == "zero")
            else:
                ref_opt.step()
                opt.step()
                sharded.after_optimizer_step(opt)
        state = model.state_dict()  # gathers under stage 3: DDP's values, on every rank
        for key, value in reference.state_dict().items():
            # Not bitwise: DDP all-reduces the accumulated local gradient, ZeRO adds the new average to the old one
            # (a rounding apart); a wrong zero_grad meaning would be off by a whole gradient.
            torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-6, msg=f"{stage} {key}")
        # The module's .grad is a marker: reading it says what to call instead.
        with sharded.step_context():
            model(torch.randint(0, 11, (4, 5), generator=data)).mean().backward()
        assert all(sharded.reducer.is_marker(p) for p in model.parameters()), stage
        with pytest.raises(ShardedGradientError, match=r"strategy\.grad_norm"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        # Writes through gathered_parameters reach the shards on every rank.
        with sharded.gathered_parameters(model.up), torch.no_grad():
            model.up.weight.mul_(0.5)
        with torch.no_grad():
            reference.up.weight.mul_(0.5)
        torch.testing.assert_close(model.state_dict()["up.weight"], reference.up.weight, rtol=1e-6, atol=1e-6)
        if stage == 3:  # outside a forward (see [Note: reading a sharded parameter] in placeholder.py)
            weight = model.up.weight
            assert weight.shape == reference.up.weight.shape and weight.numel() == reference.up.weight.numel()
            assert "sharded by lightning_zero stage 3" in repr(weight) and "'up.weight'" in f"{weight}"
            # A read on every rank is gathered: DDP's values, also through .data and detach().
            torch.testing.assert_close(weight.detach(), reference.up.weight.detach(), rtol=1e-6, atol=1e-6)
            assert torch.equal(weight.data, weight.detach()) and torch.equal(weight, weight)
            assert float(weight.norm()) == pytest.approx(float(reference.up.weight.norm()), rel=1e-6)
            with pytest.raises(ShardedParameterWriteError, match=r"'up\.weight' \(unit 'up'\) was written in place"):
                with torch.no_grad():
                    weight.mul_(2.0)
            # Under DDP these would change the weight: here they are refused, not lost.
            with pytest.raises(ShardedParameterWriteError, match=r"values read from parameter 'up\.weight'"):
                weight.detach().zero_()
            with pytest.raises(ShardedParameterWriteError, match=r"values read from parameter 'up\.weight'"):
                weight.data[0].clamp_(-1, 1)
            penalty = (weight**2).sum()  # with gradients enabled: served, but no gradient can flow back through it
            with pytest.raises(ShardedParameterReadError, match=r"a gradient was to flow into parameter 'up\.weight'"):
                penalty.backward()
        sharded.release()
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)


def test_zero_grad_step_and_weight_access_keep_ddp_semantics() -> None:
    spawn(_zero_grad_semantics, world_size=2)


def _reads_while_the_post_step_gather_travels(rank: int, world_size: int) -> None:
    """Stages 1 and 2 leave the post-step all-gathers in flight
    (see [Note: parameters whose values are on their way] in arriving.py): every read before the next forward
    waits for them and sees DDP's values, on one rank or on all, and the next step is still DDP's."""
    for stage in (1, 2):
        reference, model, ddp, ref_opt, sharded, opt = _tied_pair(stage, "adamw", units=owns_parameters)
        data = torch.Generator().manual_seed(rank)
        for step in range(5):
            x, y = torch.randint(0, 11, (4, 5), generator=data), torch.randint(0, 11, (4, 5), generator=data)
            ref_loss = _ddp_step(ddp, ref_opt, x, y)
            before = {u.name for u in sharded.units if u.arriving}  # (a read below waits for its unit's)
            with sharded.step_context():
                # From the second step on, begin_step leaves every unit's gather to its own forward (see [Note: each
                # unit waits for its own gather] in arrivals.py): each forward here ran eagerly.
                left = {u.name for u in sharded.units if u.arriving}
                assert left == before and (step != 4 or {"up", "down"} <= left), (stage, step, left)
                loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                assert not any(u.arriving for u in sharded.units), (stage, step)  # each waited for in its forward
                opt.zero_grad()
                loss.backward()
            opt.step()
            sharded.after_optimizer_step(opt)
            assert loss.item() == ref_loss.item(), (stage, step)
            assert all(u.arriving for u in sharded.units), (stage, step)  # in flight
            assert type(model.up.weight) is not nn.Parameter and model.up.weight.shape == reference.up.weight.shape
            if step == 0:  # a read on every rank, through each door a callback might use
                assert torch.equal(model.up.weight.detach(), reference.up.weight.detach()), stage
                assert type(model.up.weight) is nn.Parameter  # its unit settled by the read
                assert torch.equal(copy.deepcopy(model).down.weight, reference.down.weight), stage
            elif step == 1:
                state = model.state_dict()
                for key, value in reference.state_dict().items():
                    assert torch.equal(state[key], value), (stage, key)
            elif step == 2 and rank == 0:  # on one rank only: local, it pairs with no collective
                assert float(model.emb.weight.detach().norm()) == float(reference.emb.weight.detach().norm()), stage
            elif step == 3:  # an in-place write waits for the values first, then applies to them
                with torch.no_grad():
                    model.scale.mul_(1.0)
                    reference.scale.mul_(1.0)
        for key, value in reference.state_dict().items():
            assert torch.equal(model.state_dict()[key], value), (stage, key)
        # A failure right after a step: the gathers every rank issued have completed, so the values are kept.
        time.sleep(0.2)
        sharded.release(gather=False)
        for mine, theirs in zip(model.parameters(), reference.parameters()):
            assert torch.equal(mine.detach(), theirs.detach()), stage


def test_reads_before_the_next_forward_wait_for_the_post_step_gather() -> None:
    spawn(_reads_while_the_post_step_gather_travels, world_size=2)


def _comm_and_memory(rank: int, world_size: int) -> None:
    for stage in (1, 2, 3):
        _check_comm_and_memory(stage, world_size)


def _check_comm_and_memory(stage: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = _mlp()
    sharded = shard_model(model, stage=stage, comm=Comm(), units=blocks(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sharded.bind_optimizer(opt)
    units = sharded.units
    numel = sum(p.numel() for p in model.parameters())
    padded = sum(u.layout.padded_numel for u in units)
    x = torch.randn(4, 16, requires_grad=True)

    seen_gathered: list[set[str]] = []
    if stage == 3:
        for unit in units:
            unit.module.register_forward_pre_hook(
                lambda *_: seen_gathered.append({u.name for u in units if u.is_unsharded})
            )
    last = units[-1]
    during_backward: dict[str, list] = {}

    def record_last_grads(_grad: torch.Tensor) -> None:
        during_backward["last_grads"] = [p.grad for p in last.params]

    x.register_hook(record_last_grads)

    sharded.comm.stats.reset()
    with sharded.step_context():
        model(x).square().mean().backward()
    opt.step()
    sharded.after_optimizer_step(opt)
    stats = sharded.comm.stats

    # Communication: one collective per unit and direction, never one per tensor.
    gathers = (2 if stage == 3 else 1) * len(units)
    assert stats.calls("all_gather") == gathers, stage
    assert stats.calls("reduce_scatter") == len(units), stage
    assert stats.calls("all_reduce") == 1  # the first backward settles the reduce order (tiny)
    ring = (world_size - 1) / world_size
    # One unused-parameter slot per rank's chunk (see grad_flags.py), and zeros that align each chunk to 16 bytes.
    slots = sum(reduce_numel(u) for u in units) - padded
    assert world_size * len(units) <= slots <= 4 * world_size * len(units)  # (at most 3 fp32 elements of padding)
    assert stats.by_kind["reduce_scatter"].bytes_sent == (padded + slots) * 4 * ring
    assert stats.by_kind["all_gather"].bytes_sent == (2 if stage == 3 else 1) * padded * 4 * ring
    sent = stats.by_kind["reduce_scatter"].bytes_sent - slots * 4 * ring + stats.by_kind["all_gather"].bytes_sent
    theory = theory_comm_bytes(stage, numel, world_size)
    assert theory <= sent <= theory * padded / numel

    # Memory: storage sizes after the step, against the theory table (padding allowed).
    mem = sharded.memory_stats()
    shard_numel = sum(u.layout.shard_numel for u in units)
    assert mem["params"] == (padded if stage < 3 else shard_numel) * 4
    assert mem["gathered_params"] == 0
    # Each shard is a view of its reduction's output: its chunk, with the slot and the alignment padding.
    assert mem["grads"] == sum(reduce_width(u.layout, u.reduce_dtype) for u in units) * 4
    assert mem["optimizer_states"] == 2 * 4 * sum(p.numel() for p in sharded.shard_params_of(opt))
    expected = theory_bytes(stage, numel, world_size)
    assert expected.params <= mem["params"] <= expected.params + 4 * world_size * len(units)
    assert expected.optimizer_states <= mem["optimizer_states"] + 8 * world_size * len(units)
    # Full gradients are never kept: a parameter's .grad is at most its marker (no memory; see markers.py).
    assert not any(_has_full_grad(sharded, p) for p in model.parameters())
    if stage == 3:
        assert all(u.flat.untyped_storage().nbytes() == 0 for u in units)
        # Just in time: while a unit runs forward, it is the only one gathered.
        assert seen_gathered == [{u.name} for u in units]
    # Every stage reduces the last unit's gradients, and frees them, while backward is still running
    # (asynchronously: the reduce-scatter overlaps the rest of backward).
    assert not any(g is not None for g in during_backward["last_grads"]), stage
    # From the second step on, which parameters got a gradient rides in the reductions (see grad_flags.py): no
    # all-reduce of its own.
    opt.zero_grad()
    stats.reset()
    with sharded.step_context():
        model(x).square().mean().backward()
    assert stats.calls("all_reduce") == 0, stage
    # Under no_sync (gradient accumulation) stage 1 keeps full gradients; stages 2 and 3 still reduce.
    with sharded.no_sync(), sharded.step_context():
        model(x).square().mean().backward()
    kept = [_has_full_grad(sharded, p) for p in model.parameters()]
    assert all(kept) if stage == 1 else not any(kept), stage
    opt.zero_grad()
    for p in model.parameters():
        p.grad = None
    sharded.release()


def _has_full_grad(sharded: ShardedModel, param: nn.Parameter) -> bool:
    return param.grad is not None and not sharded.reducer.is_marker(param)


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_and_memory_match_theory(world_size: int) -> None:
    spawn(_comm_and_memory, world_size=world_size)


def _four_ranks(rank: int, world_size: int) -> None:
    for stage in (1, 3):
        torch.manual_seed(0)
        reference = TiedNet()
        model = copy.deepcopy(reference)
        ddp = DistributedDataParallel(reference)
        ref_opt = _optimizer("sgd", ddp.parameters())
        sharded = shard_model(model, stage=stage, comm=Comm())
        opt = _optimizer("sgd", model.parameters())
        sharded.bind_optimizer(opt)
        data = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x, y = torch.randint(0, 11, (2, 5), generator=data), torch.randint(0, 11, (2, 5), generator=data)
            for net, o, ctx in ((ddp, ref_opt, None), (model, opt, sharded)):
                o.zero_grad()
                if ctx is None:
                    nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten()).backward()
                else:
                    with ctx.step_context():
                        nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten()).backward()
                o.step()
            sharded.after_optimizer_step(opt)
        full = sharded.full_state_dict()
        for key, value in reference.state_dict().items():
            # Four ranks: summation order differs from DDP's all-reduce, so a tight tolerance.
            torch.testing.assert_close(full[key], value, rtol=1e-6, atol=1e-7)
        sharded.release()


def test_four_ranks_match_ddp_within_tolerance() -> None:
    spawn(_four_ranks, world_size=4)


class _NormalizedSGD(torch.optim.Optimizer):
    """Not element-wise: each step divides by the whole tensor's norm."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm() + 1e-12), alpha=-group["lr"])


class _PlainSGD(torch.optim.Optimizer):
    """Element-wise, but unknown to the engine: the probe must accept it."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def test_optimizer_check_refuses_non_elementwise_and_accepts_elementwise() -> None:
    params = [nn.Parameter(torch.ones(3))]
    with pytest.raises(UnsupportedOptimizerError, match="LBFGS cannot run on ZeRO shards"):
        check_elementwise(torch.optim.LBFGS(params))
    with pytest.raises(UnsupportedOptimizerError, match=r"_NormalizedSGD.*two slices"):
        check_elementwise(_NormalizedSGD(params))
    check_elementwise(_PlainSGD(params))
    check_elementwise(torch.optim.Adam(params))


def test_world_of_one_without_process_group() -> None:
    torch.manual_seed(0)
    model, reference = _mlp(), None
    reference = copy.deepcopy(model)
    sharded = shard_model(model, stage=3, comm=Comm())
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    sharded.bind_optimizer(opt)
    x = torch.randn(4, 16)
    with sharded.step_context():
        model(x).sum().backward()
    reference(x).sum().backward()
    opt.step()
    ref_opt.step()
    for key, value in reference.state_dict().items():
        assert torch.equal(sharded.full_state_dict()[key], value)


def test_model_without_parameters_is_refused() -> None:
    with pytest.raises(ValueError, match="has no parameters"):
        shard_model(nn.ReLU(), stage=1, comm=Comm())
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        shard_model(_mlp(), stage=4, comm=Comm())


def test_unit_with_mixed_dtypes_is_refused() -> None:
    model = nn.Linear(2, 2)
    model.bias.data = model.bias.data.double()
    with pytest.raises(ValueError, match="mixes dtypes"):
        shard_model(model, stage=2, comm=Comm())


def test_frozen_parameters_get_no_gradient_and_no_optimizer_state() -> None:
    model = _mlp()
    model[0].requires_grad_(False)
    sharded = shard_model(model, stage=2, comm=Comm(), units=blocks(model))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sharded.bind_optimizer(opt)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    frozen = sharded.units[0]
    assert all(p.grad is None for p in frozen.shard_params + frozen.params)
    assert all(p not in opt.state for p in frozen.params)
    assert all(p.grad is not None for u in sharded.units[1:] for p in u.shard_params)
    assert all(p in opt.state for u in sharded.units[1:] for p in u.params)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class _CheckpointedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def _activation_checkpointing(rank: int, world_size: int) -> None:
    for stage in (1, 2, 3):
        for policy in (owns_parameters, module_class_policy([_Block])):
            torch.manual_seed(0)
            reference = _CheckpointedNet()
            model = copy.deepcopy(reference)
            ddp = DistributedDataParallel(reference)
            sharded = shard_model(model, stage, Comm(), units=policy)
            ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            sharded.bind_optimizer(opt)
            data = torch.Generator().manual_seed(rank)
            for _ in range(3):
                x = torch.randn(4, 8, generator=data)
                ref_opt.zero_grad()
                ddp(x).square().mean().backward()
                ref_opt.step()
                opt.zero_grad()
                with sharded.step_context():
                    model(x).square().mean().backward()  # recomputes each block's forward inside backward
                opt.step()
                sharded.after_optimizer_step(opt)
            full = sharded.full_state_dict()
            for key, value in reference.state_dict().items():
                assert torch.equal(full[key], value), (stage, key)


def test_activation_checkpointing_matches_ddp() -> None:
    spawn(_activation_checkpointing, world_size=2)


class _AttentionNet(nn.Module):
    """nn.MultiheadAttention reads out_proj.weight without calling out_proj."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, x, x, need_weights=False)[0])


def _attention(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    reference = _AttentionNet()
    model = copy.deepcopy(reference)
    ddp = DistributedDataParallel(reference)
    sharded = shard_model(model, 3, Comm(), units=owns_parameters)  # MHA atomic even then
    assert [u.name for u in sharded.units] == ["attn", "head"]
    ref_opt, opt = torch.optim.Adam(ddp.parameters(), lr=1e-2), torch.optim.Adam(model.parameters(), lr=1e-2)
    sharded.bind_optimizer(opt)
    data = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(2, 5, 8, generator=data)
        ref_opt.zero_grad()
        ddp(x).square().mean().backward()
        ref_opt.step()
        opt.zero_grad()
        with sharded.step_context():
            model(x).square().mean().backward()
        opt.step()
        sharded.after_optimizer_step(opt)
    full = sharded.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


def test_stage3_multihead_attention_is_one_unit_and_matches_ddp() -> None:
    spawn(_attention, world_size=2)


def test_non_floating_parameter_is_refused_and_the_model_left_untouched() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].register_parameter("steps", nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"parameter '1.steps' in unit '1' has dtype torch.int64"):
        shard_model(model, stage=3, comm=Comm(), units=blocks(model))
    for key, value in before.items():  # checked before anything was sharded: still readable, unchanged
        assert torch.equal(model.state_dict()[key], value), key


def _prefetch_and_reshard_options(rank: int, world_size: int) -> None:
    x = torch.randn(4, 16)
    for prefetch, reshard in ((1, True), (2, True), (1, False)):
        torch.manual_seed(0)
        model = _mlp()
        sharded = shard_model(
            model, stage=3, comm=Comm(), units=blocks(model), prefetch=prefetch, reshard_after_forward=reshard
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sharded.bind_optimizer(opt)
        units = sharded.units
        seen: list[tuple[str, set[str]]] = []
        for unit in units:  # registered after the engine's hooks: they see what the engine left gathered
            unit.module.register_forward_pre_hook(
                lambda module, _args, name=unit.name, seen=seen, units=units: seen.append(
                    (name, {u.name for u in units if u.is_unsharded})
                )
            )
        gathers = []
        for _step in range(3):
            seen.clear()
            before = sharded.comm.stats.snapshot()
            with sharded.step_context():
                model(x).square().mean().backward()
            opt.step()
            sharded.after_optimizer_step(opt)
            opt.zero_grad()
            gathers.append(sharded.comm.stats.since(before).calls("all_gather"))
            assert all(u.flat.untyped_storage().nbytes() == 0 for u in units), "every unit is freed after the step"
            assert not sharded.reducer._pool, "no reduce buffer outlives the backward pass"
        where = f"prefetch={prefetch} reshard_after_forward={reshard}"
        names = [u.name for u in units]
        for position, (name, gathered) in enumerate(seen):  # the last step: prefetching along the recorded order
            ahead = set(names[position : position + 1 + prefetch])
            if reshard:
                assert name in gathered and gathered <= ahead, (where, name, gathered)
            else:  # kept from forward: everything already run, plus what is prefetched
                assert gathered <= set(names[: position + 1 + prefetch]), (where, name, gathered)
        # Communication: a gather per unit in forward, and again in backward unless kept after forward; once
        # the order is known (after the first step), the unit that ends forward stays gathered for backward.
        per_step = len(units) * (2 if reshard else 1)
        assert gathers == [per_step, per_step - reshard, per_step - reshard], (where, gathers)
        sharded.release()


def test_prefetch_is_bounded_and_reshard_after_forward_saves_the_backward_gather() -> None:
    spawn(_prefetch_and_reshard_options, world_size=2)
