"""What both front doors ask every rank to agree on (see [Note: agreements] in ``engine/comm/control.py``).

- at setup: the trainable set (as ``DDPStrategy`` checks that every rank has the same parameters);
- at the start of a Fabric step (a forward, and its backward when training): its number; a Fabric no-grad step's
  start, which ranks elsewhere may serve (stage 3), or defer to its first collective (stages 1 and 2);
- before a barrier, a broadcast, a reduction that user code or Lightning's logging asks for.

The Trainer's loops agree on more (which step, epoch and phase, uneven evaluation, SIGTERM): that is in
``strategies/agreement.py``.
"""

from __future__ import annotations

import operator
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module

from lightning_zero.engine.comm.comm import Comm
from lightning_zero.engine.comm.control import ControlChannel
from lightning_zero.engine.core.placeholder import passthrough

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
PHASES = ("training", "validation", "sanity check", "test", "predict", "step")


def trainable_hash(params: Iterable[Tensor]) -> int:
    """A number that differs between ranks whose parameters (``module.parameters()``, or the sharded model's
    ``params``: any order that is the same on every rank) differ in which require a gradient."""
    with passthrough():  # a hidden or arriving parameter's attribute costs a ``__torch_function__`` call otherwise
        return zlib.crc32(bytes(map(_REQUIRES_GRAD, params)))


def agree_on_trainable_set(comm: Comm, module: Module) -> None:
    """Refuse, on every rank, a model whose trainable set (or parameter count) differs between ranks."""
    names = [name for name, p in module.named_parameters()]
    frozen = [name for name, p in module.named_parameters() if not p.requires_grad]

    def describe() -> str:
        listed = ", ".join(repr(n) for n in frozen[:6]) + (", ..." if len(frozen) > 6 else "")
        return f"setup with {len(names)} parameter tensors, {len(names) - len(frozen)} trainable" + (
            f" (frozen: {listed})" if frozen else " (none frozen)"
        )

    comm.agree_event(
        "setup: trainable parameters",
        describe,
        len(names),
        len(frozen),
        trainable_hash(module.parameters()),
        explain=lambda texts: (
            "The model must be the same on every rank, with the same parameters requiring a gradient, as "
            "DDPStrategy requires: set requires_grad (freeze layers) identically on every rank, before fit."
        ),
    )


def begin_plain_step(comm: Comm, key: str, step: int, describe: Callable[[], str]) -> None:
    """Agree on a step counted by the caller (Fabric: a forward, and its backward when training)."""
    comm.begin_sequence(key, [PHASES.index("step"), zlib.crc32(key.encode()), step], describe)


def defer_plain_step(comm: Comm, key: str, describe: Callable[[], str]) -> None:
    """A step that ranks may run different numbers of times, agreed only if it issues a collective (Fabric's no-grad
    steps under stages 1 and 2: see [Note: Fabric steps] in ``fabric/wrapper.py``); not counted, since the counts
    may differ."""
    comm.defer_sequence(key, [PHASES.index("step"), zlib.crc32(key.encode()), 0], describe)


def begin_no_grad_step(comm: Comm, first: str, broadcasts: bool, describe: Callable[[], str]) -> bool:
    """Agree on the beginning of a Fabric no-grad step under stage 3, which ranks elsewhere serve (see [Note: Fabric
    steps] in ``fabric/wrapper.py``); whether they do. See ``CollectiveSequence.begin_no_grad_step``."""
    return comm.begin_no_grad_step("no_grad", first, broadcasts, describe)


def reduce_like_lightning(comm: Comm, tensor: Tensor, reduce_op: object, name: str, guard: bool = False) -> Tensor:
    """``lightning.fabric.utilities.distributed._sync_ddp`` through ``comm`` (counted and checked like the
    engine's own collectives): ``"mean"``/``"avg"`` sums, then divides by the world size. ``guard``: agreed even
    outside a step (see ``Comm.all_reduce``)."""
    divide = False
    if isinstance(reduce_op, str):
        lowered = "avg" if reduce_op.lower() == "mean" else reduce_op.lower()
        if lowered == "avg":
            op, divide = dist.ReduceOp.SUM, True
        else:
            op = getattr(dist.ReduceOp, lowered.upper())
    else:
        op = dist.ReduceOp.SUM if reduce_op is None else reduce_op
    comm.all_reduce(tensor, op=op, name=name, guard=guard)
    if not divide:
        return tensor
    if not torch.is_floating_point(tensor):
        return tensor.copy_(tensor / comm.world_size)
    return tensor.div_(comm.world_size)


def barrier(control: ControlChannel | None, comm: Comm | None, checks: str, name: str | None, device: Any) -> None:
    """A barrier that names the ranks that are elsewhere: the agreement is a barrier itself (every rank must join
    it). Without a control channel, or with checks off, ``torch.distributed.barrier``."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if control is not None and checks != "off":
        comm = comm if comm is not None else Comm(checks="auto", control=control)
        comm.agree_event(f"barrier {name or ''}", lambda: f"barrier({name!r})")
    elif dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def broadcast(comm: Comm | None, obj: Any, src: int) -> Any:
    """``broadcast_object_list`` of one object from ``src``, agreed first (a rank that is elsewhere is named)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    if comm is not None:
        comm.agree_event("broadcast", lambda: f"broadcast of a {type(obj).__name__} from rank {src}")
    holder = [obj]
    dist.broadcast_object_list(holder, src, group=dist.group.WORLD)
    return holder[0]
