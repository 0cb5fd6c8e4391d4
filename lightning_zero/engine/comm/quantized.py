"""Quantized collectives (``quantize_weights="int8"``, ``quantize_grads="int8"``): blockwise int8 with one fp32
scale per block, moved by the same ``Comm`` as the exact ones and counted in its statistics at the bytes they send.

[Note: quantized collectives]
A row of ``n`` values is cut into blocks of ``BLOCK`` (256) elements, the last padded with zeros; each block keeps
``scale = max|x| / 127`` (fp32) and ``q = round(x / scale)`` in int8 (a block of zeros has scale 0 and stays 0).
The wire format of a row is one byte buffer: the int8 values, then the scales, then any exact fp32 values the
row carries (a reduction's flag slot), so every collective moves one buffer: 1 + 4/256 bytes per element instead
of the compute dtype's 2 or 4. Every step is a vectorised torch op over all rows and blocks at once (a view to
``(rows, blocks, BLOCK)``), with no Python loop over blocks.

- **Weights** (stage 3, every gather of a unit for compute: forward, backward, prefetches, evaluation): each rank
  quantizes its shard, the all-gather moves the rows, and every rank dequantizes every row, its own included,
  into the unit's flat buffer in the compute dtype: every rank computes with the same values. Master weights and
  the optimizer stay exact, and so does every gather that reads or saves the parameters (state dicts,
  checkpoints, ``gathered_parameters``): a unit gathered quantized is gathered again, exactly, for those
  (``ShardedUnit.full_flat``), so nothing saved is ever a quantized copy.
- **Gradients** (stages 2 and 3, each unit's reduce-scatter): each rank quantizes each destination's chunk of its
  packed gradients (the flag slot stays exact), one all-to-all moves chunk ``q`` to rank ``q``, and each rank
  dequantizes the chunks it received in fp32 and sums them in rank order, its own chunk exact: the reduction is
  done in fp32 after quantizing once, as ZeRO++'s qgZ does, rather than by summing int8 values. Under hybrid
  sharding only the reduce-scatter inside the shard group is quantized; the all-reduce across the replicas
  stays exact (it moves 1/S of the gradients).

CUDA: the quantization runs on the current (compute) stream before the collective is issued, which is queued on
NCCL's stream after an event on it (see [Note: streams] in ``comm.py``), so it reads finished rows; the send and
receive buffers are kept alive by the ``Pending`` until its wait; the dequantization (and the sum) run in the
``Pending``'s ``then`` at the wait, which on NCCL returns at once having ordered the compute stream after the
collective: they are queued behind it and the host never blocks. What is allocated per collective: this rank's
wire rows (a quarter of its fp32 values, plus a sixty-fourth for the scales) and the W received rows; a gather
dequantizes straight into the unit's buffer (in place in fp32; through one fp32 copy of the unit for a half
type, rounded once), and a reduction into one fp32 buffer of the W chunks it received, summed into the shard.
Encoding is four passes over the values (one min-max per block, a multiplication by 127 / max, a rounding, a cast
written into the wire row), decoding two (a cast and a multiplication).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from lightning_zero.engine.comm.comm import Comm, Pending

Quantization = Literal["int8"]
QUANTIZATIONS = ("int8",)
BLOCK = 256  # elements per scale
_QMAX = 127.0


def blocks_of(numel: int) -> int:
    return -(-numel // BLOCK)


def row_bytes(numel: int, exact: int = 0) -> int:
    """Bytes of one quantized row of ``numel`` values with ``exact`` fp32 values after it."""
    return blocks_of(numel) * (BLOCK + 4) + 4 * exact


def quantize(rows: torch.Tensor, exact: torch.Tensor | None = None) -> torch.Tensor:
    """``rows`` (R x n, any float dtype) as R wire rows of ``row_bytes(n, k)`` bytes (uint8), ``exact`` (R x k, fp32
    after the cast) appended to each unchanged.

    Example::

        >>> x = torch.linspace(-1, 1, 300).view(1, 300)
        >>> wire = quantize(x)
        >>> wire.shape, wire.dtype
        (torch.Size([1, 520]), torch.uint8)
        >>> bool((dequantize(wire, 300) - x).abs().max() <= 1 / 254 + 1e-7)   # at most half a step of the scale
        True
    """
    count, numel = rows.shape
    blocks, full = blocks_of(numel), numel // BLOCK
    wire = torch.empty(
        (count, row_bytes(numel, 0 if exact is None else exact.shape[1])), dtype=torch.uint8, device=rows.device
    )
    values, scales = _parts(wire, numel)
    _encode(rows[:, : full * BLOCK].view(count, full, BLOCK), values[:, :full], scales[:, :full])
    if full < blocks:  # the last block, padded with zeros (a copy of under BLOCK elements per row)
        tail = F.pad(rows[:, full * BLOCK :], (0, blocks * BLOCK - numel)).view(count, 1, BLOCK)
        _encode(tail, values[:, full:], scales[:, full:])
    if exact is not None:
        wire[:, blocks * (BLOCK + 4) :].view(torch.float32).copy_(exact)
    return wire


def _parts(wire: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the int8 values (R x blocks x BLOCK) and the fp32 scales (R x blocks) of wire rows."""
    blocks = blocks_of(numel)
    values = wire[:, : blocks * BLOCK].view(torch.int8).view(wire.shape[0], blocks, BLOCK)
    return values, wire[:, blocks * BLOCK : blocks * (BLOCK + 4)].view(torch.float32)


def _encode(blocks: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
    """``blocks`` (R x b x BLOCK) into ``values`` (int8) and ``scales`` (fp32), in place: four passes over the
    elements (one min-max, a multiplication, a rounding, a cast into the wire), no temporary beyond one fp32
    copy of the blocks."""
    low, high = torch.aminmax(blocks, dim=2)
    largest = torch.maximum(high, low.neg()).float()
    scales.copy_(largest / _QMAX)
    inverse = torch.where(largest > 0, _QMAX / largest, torch.zeros_like(largest))  # a block of zeros stays zero
    # |x| * 127 / max|x| <= 127: no clamp is needed before the cast (a NaN block is flagged by the caller's slots).
    values.copy_(blocks.mul(inverse.unsqueeze(2)).round_())


def dequantize(wire: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The R x ``numel`` values of R wire rows made by ``quantize``: fp32, or written into ``out`` (R x ``numel``,
    any float dtype, e.g. a unit's gathered buffer), which is returned."""
    count = wire.shape[0]
    values, scales = _parts(wire, numel)
    full = numel // BLOCK
    if out is None:
        out = torch.empty((count, numel), dtype=torch.float32, device=wire.device)
    main = out[:, : full * BLOCK].view(count, full, BLOCK)
    if out.dtype == torch.float32:  # in place: a cast and a multiplication, no temporary
        main.copy_(values[:, :full]).mul_(scales[:, :full].unsqueeze(2))
    else:  # scaled in fp32, rounded once into the half type
        main.copy_(values[:, :full].to(torch.float32).mul_(scales[:, :full].unsqueeze(2)))
    if full < values.shape[1]:
        tail = values[:, full:].to(torch.float32).mul_(scales[:, full:].unsqueeze(2)).view(count, BLOCK)
        out[:, full * BLOCK :].copy_(tail[:, : numel - full * BLOCK])
    return out


def exact_values(wire: torch.Tensor, numel: int, exact: int) -> torch.Tensor:
    """The R x ``exact`` fp32 values carried after the quantized part of each wire row."""
    start = blocks_of(numel) * (BLOCK + 4)
    return wire[:, start : start + 4 * exact].view(torch.float32)


def all_gather_quantized(
    comm: Comm, output: torch.Tensor, shard: torch.Tensor, name: str = "", guard: bool = False, async_op: bool = False
) -> Pending | None:
    """``comm.all_gather(output, shard)`` with int8 on the wire: ``output`` receives every rank's shard, each
    quantized once (this rank's too: every rank sees the same values). See [Note: quantized collectives]."""
    numel = shard.numel()
    world = comm.world_size
    own = quantize(shard.view(1, numel))
    received = torch.empty((world, own.shape[1]), dtype=torch.uint8, device=shard.device)
    chunks = output.view(world, numel)

    def unpack() -> None:
        dequantize(received, numel, out=chunks)

    return _then(
        comm.all_gather(received.view(-1), own.view(-1), name=name, guard=guard, async_op=True), unpack, async_op
    )


def reduce_scatter_quantized(
    comm: Comm, out: torch.Tensor, chunks: torch.Tensor, name: str = "", async_op: bool = False
) -> Pending | None:
    """Sum the rows of ``chunks`` (W x (n + 1): rank ``q``'s chunk of a unit's packed gradients, then its flag slot)
    over ranks into ``out`` (n + 1), row ``comm.rank``'s, with the n values int8 on the wire and the slot exact; the
    sum in fp32 (see [Note: quantized collectives])."""
    width = chunks.shape[1]
    numel = width - 1
    send = quantize(chunks[:, :-1], exact=chunks[:, -1:])
    received = torch.empty_like(send)
    rank = comm.rank

    def add_up() -> None:
        values = dequantize(received, numel)
        values[rank] = chunks[rank, :-1]  # this rank's own chunk never went through the wire
        out[:-1].copy_(values.sum(dim=0))
        slots = exact_values(received, numel, 1)
        slots[rank] = chunks[rank, -1:].float()
        out[-1:].copy_(slots.sum(dim=0))

    return _then(comm.all_to_all(received, send, kind="reduce_scatter", name=name, async_op=True), add_up, async_op)


def _then(pending: Pending | None, finish: Callable[[], None], async_op: bool) -> Pending | None:
    """``finish`` once the collective ``pending`` is done: returned in flight with ``async_op``, else waited for."""
    assert pending is not None  # issued with async_op=True
    pending.then(finish)
    if async_op:
        return pending
    pending.wait()
    return None


def check_quantization(name: str, value: object) -> None:
    if value is not None and value not in QUANTIZATIONS:
        raise ValueError(f"{name} must be None or 'int8', got {value!r}")
