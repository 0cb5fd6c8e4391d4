"""The sharded gradients of one optimizer, as clipping, logging and the non-finite policy read them: their global
norm, which ranks hold an inf or NaN, dropping them, clipping them. Each reads what the backward passes found first
(``GradReducer.settle``: see [Note: flags read at the step] in ``grad_flags.py``)."""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from lightning_zero.engine.comm.device_wait import read_on_host
from lightning_zero.engine.model.optimizer_steps import OptimizerSteps


def grad_norm(steps: OptimizerSteps, optimizer: Optimizer, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of ``optimizer``'s gradients over all ranks' shards (one all-reduce; same on every rank). Under
    hybrid sharding over the shard group only: its replicas hold the same shards.

    Example::

        total = grad_norm(sharded.steps, optimizer)   # as torch.nn.utils.get_total_norm of the full gradients
    """
    steps.reducer.settle()
    grads = [p.grad for p in steps.shard_params_of(optimizer) if p.grad is not None and p.numel()]
    norm_type = float(norm_type)
    device = steps.units[0].device  # where collectives run (gradients may be offloaded to the CPU)
    total = torch.zeros((), device=device)
    shard_comm = steps.groups.shard
    if norm_type == float("inf"):
        if grads:
            total = torch.stack([g.abs().max() for g in grads]).max().float().to(device)
        shard_comm.all_reduce(total, op=torch.distributed.ReduceOp.MAX)
        return total
    if grads:
        total = torch.stack([torch.linalg.vector_norm(g, norm_type).float() ** norm_type for g in grads]).sum()
        total = total.to(device)
    shard_comm.all_reduce(total)
    return total ** (1.0 / norm_type)


def nonfinite_grads(steps: OptimizerSteps, optimizer: Optimizer) -> tuple[list[int], list[str]]:
    """Which ranks hold an ``inf``/``NaN`` in ``optimizer``'s sharded gradients (the same list on every rank, one
    all-reduce), and the names of this rank's offending parameters.

    Example::

        ranks, names = nonfinite_grads(sharded.steps, optimizer)   # ([], []) when every gradient is finite
    """
    steps.reducer.settle()
    with_grads = [u for u in steps.units_of(optimizer) if any(p.grad is not None for p in u.shard_params)]
    if all(u.grads_finite is True for u in with_grads):
        # Known on every rank alike from the reduction's own all-reduce: no collective needed.
        return [], []
    shard_params = [p for p in steps.shard_params_of(optimizer) if p.grad is not None and p.numel()]
    comm = steps.groups.world
    device = steps.units[0].device
    flags = torch.zeros(comm.world_size, device=device)
    peaks: list[torch.Tensor] = []
    if shard_params:
        # One fused pass over all gradients (the largest magnitude of each is inf or NaN if any element is),
        # flagged on the device: the one read on the host is of the all-reduced flags.
        peaks = torch._foreach_norm([p.grad for p in shard_params], float("inf"))
        bad = ~torch.isfinite(torch.stack(peaks)).all()
        flags[comm.rank] = bad.to(device=device, dtype=flags.dtype)
    comm.all_reduce(flags)
    ranks = [r for r, flag in enumerate(read_on_host(comm, flags, "which ranks hold inf/NaN")) if flag > 0]
    local: list[str] = []
    if comm.rank in ranks:  # names are looked up only when something is wrong
        for shard_param, peak in zip(shard_params, peaks):
            if not bool(torch.isfinite(peak)):
                local.append(steps.index.name_of(shard_param))
    return ranks, local


def drop_grads(steps: OptimizerSteps, optimizer: Optimizer) -> None:
    """Forget ``optimizer``'s sharded gradients, so that its next ``step()`` changes nothing.

    Example::

        drop_grads(sharded.steps, optimizer)   # the non-finite policy "skip"
    """
    steps.reducer.settle()
    for param in (p for g in optimizer.param_groups for p in g["params"]):
        steps.index.shard_of[param][0].grad = None
        steps.reducer.clear_marker(param)


def clip_grad_norm_(
    steps: OptimizerSteps, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale ``optimizer``'s sharded gradients so that their global norm is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does for full gradients; return the norm before clipping.

    Example::

        total = clip_grad_norm_(sharded.steps, optimizer, max_norm=1.0)
    """
    total = grad_norm(steps, optimizer, norm_type)
    grads = [p.grad for p in steps.shard_params_of(optimizer) if p.grad is not None]
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, clip_coef.to(device=grads[0].device, dtype=grads[0].dtype))
    return total
