"""The collectives the engine uses, with byte and time accounting.

Every call into ``torch.distributed`` made by the engine goes through ``Comm``, so that:

- backend differences and renamed APIs are handled in one place (torch 2.13 deprecates
  ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of ``all_gather_single`` /
  ``reduce_scatter_single``; older releases only have the former);
- the bytes each rank sends are counted with the ring model that the ZeRO paper's 2Ψ / 3Ψ
  figures assume: all-gather and reduce-scatter send ``(N - 1) / N`` of the full buffer, an
  all-reduce twice that, a broadcast the whole buffer from its source only.

A world of one process never calls ``torch.distributed`` at all.

[Note: gloo all-to-all]
gloo's own all-gather and reduce-scatter are slow: on two CPU processes, moving 48 MB takes them
51 and 68 ms, against 35 ms for an all-reduce of the same buffer. An all-to-all moves the same
bytes a ring does, and gloo runs it at all-reduce speed; so on gloo, ``all_gather`` sends every
rank a copy of this rank's shard with one ``all_to_all_single``, and ``reduce_scatter`` sends
every rank its chunk and sums the chunks it receives (in rank order). NCCL keeps its own
collectives, which are the fast ones there.
"""

from __future__ import annotations

import time
import zlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CollectiveStats:
    """Calls, bytes sent by this rank and seconds spent, for one kind of collective."""

    calls: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0


@dataclass
class CommStats:
    """Per-kind accounting; ``reset()`` between steps to read per-step figures."""

    by_kind: dict[str, CollectiveStats] = field(default_factory=lambda: defaultdict(CollectiveStats))

    def record(self, kind: str, bytes_sent: int, seconds: float) -> None:
        entry = self.by_kind[kind]
        entry.calls += 1
        entry.bytes_sent += bytes_sent
        entry.seconds += seconds

    def add_seconds(self, kind: str, seconds: float) -> None:
        """Time spent waiting for an asynchronous collective counted in ``record`` when it was issued."""
        self.by_kind[kind].seconds += seconds

    @property
    def bytes_sent(self) -> int:
        return sum(s.bytes_sent for s in self.by_kind.values())

    def calls(self, kind: str) -> int:
        return self.by_kind[kind].calls if kind in self.by_kind else 0

    def reset(self) -> None:
        self.by_kind.clear()

    def snapshot(self) -> CommStats:
        """A copy of the counters as they are now (``since`` subtracts one)."""
        copy = CommStats()
        for kind, entry in self.by_kind.items():
            copy.by_kind[kind] = CollectiveStats(entry.calls, entry.bytes_sent, entry.seconds)
        return copy

    def since(self, earlier: CommStats) -> CommStats:
        """What was counted after ``earlier`` was taken."""
        delta = CommStats()
        for kind, entry in self.by_kind.items():
            before = earlier.by_kind.get(kind, CollectiveStats())
            delta.by_kind[kind] = CollectiveStats(
                entry.calls - before.calls, entry.bytes_sent - before.bytes_sent, entry.seconds - before.seconds
            )
        return delta

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {
            k: {"calls": v.calls, "bytes_sent": v.bytes_sent, "seconds": v.seconds} for k, v in self.by_kind.items()
        }


class Pending:
    """An asynchronous collective in flight. ``wait()`` blocks until it is done (idempotent); the time
    spent blocked, not the time it overlapped with other work, counts as time in collectives.

    ``keep`` holds tensors the collective reads or writes, so that they live until it completes.
    """

    def __init__(self, stats: CommStats, kind: str, work: dist.Work | None, *keep: torch.Tensor) -> None:
        self._stats = stats
        self._kind = kind
        self._work = work
        self._keep = keep
        self._then: Callable[[], None] | None = None

    def then(self, finish: Callable[[], None]) -> Pending:
        """Run ``finish`` once the collective is done (in ``wait``, or now if it already is)."""
        if self._work is None:
            finish()
        else:
            self._then = finish
        return self

    @property
    def done(self) -> bool:
        return self._work is None

    def wait(self) -> None:
        if self._work is None:
            return
        start = time.perf_counter()
        self._work.wait()
        if self._then is not None:
            self._then()
            self._then = None
        self._stats.add_seconds(self._kind, time.perf_counter() - start)
        self._work = None
        self._keep = ()


class CollectiveMismatchError(RuntimeError):
    """Ranks were about to issue different collectives (raised on every rank, before the collective)."""


CollectiveChecks = Literal["auto", "all", "off"]
_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


def _name_code(name: str) -> int:
    return zlib.crc32(name.encode())  # the same in every process (hash() is salted per process)


class Comm:
    """Collectives over one process group, counted in ``stats``, optionally checked first.

    [Note: collective checks]
    Collectives pair up by order: if ranks disagree on what comes next, gloo aborts the process
    (different sizes) or, worse, exchanges the wrong data (same sizes). A *guarded* collective is
    preceded by an all-gather of a 4-number descriptor (kind, name, element count, how many guarded
    collectives this rank issued before); any difference raises ``CollectiveMismatchError`` on every
    rank, naming what each rank was about to do, before the real collective runs. ``checks="auto"``
    guards the calls whose order depends on the model's control flow (stage-3 gathers, called with
    ``guard=True``); ``"all"`` every collective (a debugging mode: one extra tiny collective each);
    ``"off"`` none.

    Example::

        comm = Comm(group=None)             # the default process group (or a world of 1)
        comm.all_gather(full, shard)        # full.numel() == shard.numel() * comm.world_size
        comm.reduce_scatter(shard, full)    # sum over ranks
    """

    def __init__(self, group: dist.ProcessGroup | None = None, checks: CollectiveChecks = "auto") -> None:
        if checks not in ("auto", "all", "off"):
            raise ValueError(f"checks must be 'auto', 'all' or 'off', got {checks!r}")
        self.group = group
        initialized = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if initialized else 1
        self.rank = dist.get_rank(group) if initialized else 0
        self.stats = CommStats()
        self.checks = checks
        self._guarded_calls = 0
        self._names: dict[int, str] = {}
        # See [Note: gloo all-to-all].
        self.via_all_to_all = initialized and self.world_size > 1 and dist.get_backend(group) == "gloo"

    def register_names(self, names: list[str]) -> None:
        """Names a mismatch report may need to print for another rank (the same model on every rank)."""
        self._names.update({_name_code(n): n for n in names})

    def check_next(self, kind: str, name: str, numel: int, device: torch.device) -> None:
        """Check, as for a guarded call, a collective that another library is about to issue."""
        if self.world_size > 1:
            self._check(kind, name, numel, device, guard=True)

    def _check(self, kind: str, name: str, numel: int, device: torch.device, guard: bool) -> None:
        if self.checks == "off" or (self.checks == "auto" and not guard):
            return
        self._names.setdefault(_name_code(name), name)
        mine = torch.tensor([_KINDS.index(kind), _name_code(name), numel, self._guarded_calls], dtype=torch.int64)
        everyone = torch.empty(4 * self.world_size, dtype=torch.int64, device=device)
        self._timed(
            "check",
            everyone.numel() * 8 * (self.world_size - 1) // self.world_size,
            _all_gather_single,
            everyone,
            mine.to(device),
            group=self.group,
        )
        self._guarded_calls += 1
        rows = everyone.view(self.world_size, 4).tolist()
        if any(row != rows[0] for row in rows):
            lines = [
                f"rank {r}: {_KINDS[k]} of {self._names.get(c, 'an unknown unit')!r} ({n} elements, "
                f"after {calls} checked collectives)"
                for r, (k, c, n, calls) in enumerate(rows)
            ]
            raise CollectiveMismatchError(
                "the ranks are about to issue different collectives, so they would deadlock or exchange the wrong "
                "data:\n  " + "\n  ".join(lines) + "\nUnder stage 3 every rank must run the same submodules in the "
                "same order (a data-dependent branch, a mixture-of-experts layer or a generation loop that stops "
                "early on one rank breaks this). Run the same modules on every rank (e.g. call unused experts on an "
                "empty batch), make the branch depend on all ranks, or use stage 1 or 2, which handle it."
            )

    def _timed(self, kind: str, bytes_sent: int, fn, *args, async_op: bool = False, **kwargs) -> Pending | None:
        start = time.perf_counter()
        work = fn(*args, async_op=async_op, **kwargs) if async_op else fn(*args, **kwargs)
        self.stats.record(kind, bytes_sent, time.perf_counter() - start)
        if not async_op:
            return None
        return Pending(self.stats, kind, work, *(a for a in args if isinstance(a, torch.Tensor)))

    def _ring_bytes(self, tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size() * (self.world_size - 1) // self.world_size

    def all_gather(
        self, output: torch.Tensor, shard: torch.Tensor, name: str = "", guard: bool = False, async_op: bool = False
    ) -> Pending | None:
        """Concatenate every rank's ``shard`` into ``output`` (``shard`` may alias its own chunk). With
        ``async_op``, return a ``Pending`` to wait on before ``output`` is read."""
        if self.world_size == 1:
            if output.data_ptr() != shard.data_ptr():
                output.copy_(shard)
            return Pending(self.stats, "all_gather", None) if async_op else None
        self._check("all_gather", name, output.numel(), output.device, guard)
        gather, source = _all_gather_single, shard
        if self.via_all_to_all:  # see [Note: gloo all-to-all]; the copies also free ``shard`` to alias ``output``
            gather = dist.all_to_all_single
            source = shard.unsqueeze(0).expand(self.world_size, shard.numel()).contiguous()
        return self._timed(
            "all_gather", self._ring_bytes(output), gather, output, source, group=self.group, async_op=async_op
        )

    def reduce_scatter(
        self, shard: torch.Tensor, full: torch.Tensor, name: str = "", async_op: bool = False
    ) -> Pending | None:
        """Sum ``full`` over ranks and keep this rank's chunk in ``shard``. With ``async_op``, return a
        ``Pending`` to wait on before ``shard`` is read (``full`` stays alive until then)."""
        if self.world_size == 1:
            shard.copy_(full)
            return Pending(self.stats, "reduce_scatter", None) if async_op else None
        self._check("reduce_scatter", name, full.numel(), full.device, guard=False)
        bytes_sent = self._ring_bytes(full)
        if not self.via_all_to_all:
            return self._timed(
                "reduce_scatter", bytes_sent, _reduce_scatter_single, shard, full, group=self.group, async_op=async_op
            )
        # See [Note: gloo all-to-all]: every rank's chunk for us arrives in ``chunks``; summed in rank order.
        chunks = torch.empty_like(full)

        def add_up() -> None:
            torch.sum(chunks.view(self.world_size, -1), dim=0, out=shard)

        pending = self._timed(
            "reduce_scatter", bytes_sent, dist.all_to_all_single, chunks, full, group=self.group, async_op=async_op
        )
        if pending is None:
            add_up()
            return None
        return pending.then(add_up)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        if self.world_size == 1:
            return
        self._check("all_reduce", "", tensor.numel(), tensor.device, guard=False)
        self._timed("all_reduce", 2 * self._ring_bytes(tensor), dist.all_reduce, tensor, op=op, group=self.group)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast from group rank ``src``."""
        if self.world_size == 1:
            return
        self._check("broadcast", "", tensor.numel(), tensor.device, guard=False)
        sent = tensor.numel() * tensor.element_size() if self.rank == src else 0
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        self._timed("broadcast", sent, dist.broadcast, tensor, src=global_src, group=self.group)
