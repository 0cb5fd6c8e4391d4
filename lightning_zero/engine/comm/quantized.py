"""Quantized collectives (``quantize_weights="int8"``, ``quantize_grads="int8"``): blockwise int8 with one fp32
scale per block, moved by the same ``Comm`` as the exact ones and counted in its statistics at the bytes they send.

[Note: quantized collectives]
A *row* is one rank's range of a unit's flat buffer (see [Note: flat layout] in ``core/layout.py``): ``n`` values
cut into ``n // BLOCK`` *full blocks* of ``BLOCK`` (256) elements and a *tail* of fewer. Each full block keeps
``scale = max|x| / 126`` over its finite values (fp32) and ``q = round(x / scale)`` in int8; ``+inf``, ``-inf`` and
NaN have codes of their own (127, -127, -128) and decode as themselves. Some blocks go exactly, in the row's own
dtype, beside the int8 ones: the tail, and every full block that holds values of more than one parameter (see
[Note: blocks that span parameters]). The wire format of a row is one byte buffer::

    int8 values (full blocks) | fp32 scales | exact blocks | tail | padding | fp32 slots

the slots being exact values the row carries (a reduction's flag slot) and the padding aligning each part to its
element size. Every collective moves one buffer: 1 + 4/256 bytes per element instead of the compute dtype's 2 or
4, plus the exact blocks (``row_bytes``). Every step is a vectorised torch op over all rows and blocks at once (a
view to ``(rows, blocks, BLOCK)``; the exact blocks by one gather and one scatter over a small index tensor made
once per unit), with no Python loop over blocks or parameters.

- **Weights** (stage 3, every gather of a unit for compute: forward, backward, prefetches, evaluation): each rank
  quantizes its shard, the all-gather moves the rows, and every rank dequantizes every row, its own included,
  into the unit's flat buffer in the compute dtype: every rank computes with the same values. Master weights and
  the optimizer stay exact, and so does every gather that reads or saves the parameters (state dicts,
  checkpoints, ``gathered_parameters``): a unit gathered quantized is gathered again, exactly, for those
  (``ShardedUnit.full_flat``), so nothing saved is ever a quantized copy.
- **Gradients** (stages 2 and 3, each unit's reduce-scatter): each rank quantizes each destination's chunk of its
  packed gradients (the flag slot stays exact), one all-to-all moves chunk ``q`` to rank ``q``, and each rank
  dequantizes the chunks it received in fp32 and sums them in rank order, its own chunk exact: the reduction is
  done in fp32 after quantizing once, as ZeRO++'s qgZ does, rather than by summing int8 values. Chunk ``q`` is
  range ``q`` of the same layout, so it has row ``q``'s exact blocks on every rank. Under hybrid sharding only the
  reduce-scatter inside the shard group is quantized; the all-reduce across the replicas stays exact (it moves
  1/S of the gradients).

CUDA: the quantization runs on the current (compute) stream before the collective is issued, which is queued on
NCCL's stream after an event on it (see [Note: streams] in ``comm.py``), so it reads finished rows; the send and
receive buffers are kept alive by the ``Pending`` until its wait; the dequantization (and the sum) run in the
``Pending``'s ``then`` at the wait, which on NCCL returns at once having ordered the compute stream after the
collective: they are queued behind it and the host never blocks. Nothing on a device is read on the host: which
blocks go exactly is decided from the layout when the unit is built, and the non-finite codes are chosen element
by element on the device. What is allocated per collective: this rank's wire rows (a quarter of its fp32 values,
plus a sixty-fourth for the scales and its exact blocks) and the W received rows; a gather dequantizes straight
into the unit's buffer (in place in fp32; through one fp32 copy of the unit for a half type, rounded once), and a
reduction into one fp32 buffer of the W chunks it received, summed into the shard. Encoding is four passes over
the values (one min-max per block, a multiplication by 126 / max, a rounding, a cast written into the wire row),
decoding two (a cast and a multiplication). The non-finite values cost three passes more to encode (a copy
without them, a min-max over it, their codes) and six to decode (a comparison and a fill per code); a block that
holds one has a negative scale. On a GPU these passes always run (they are bandwidth-bound kernels, and skipping
them would need a host read of the flags); on the CPU, where reading a tensor costs nothing, they run only when a
block is flagged, so rows without an inf or NaN cost what they did before.

[Note: blocks that span parameters]
A block's scale is its largest magnitude, and a flat buffer lays parameters end to end, so a block of a regular
grid over a row holds the end of one parameter and the start of the next wherever a boundary is not a multiple
of 256 elements from the row's start: nearly everywhere. Their magnitudes are unrelated (a gain of 1e4 beside an
embedding of values near 0.1; a LayerNorm weight of ones beside biases of 1e-3), and every value of the smaller
one in that block rounds to 0: with a one-element 1e4 parameter before an embedding, 255 embedding weights were
gathered as exactly 0, and the run drifted with no sign of why. DeepSpeed's qwZ has the same flaw: it
concatenates a gather's per-parameter partitions and quantizes the concatenation in groups of 2048 that cross
them. Libraries that quantize one tensor at a time (bitsandbytes, torchao) never cross a boundary, at one call per
tensor. What we weighed:

- *A grid restarted at each parameter* (its blocks begin at its first element): exactly per tensor, but a row's
  blocks are then no longer a view of the row: each encode and decode would need an element-level index (8 bytes
  per element: more than the unit itself) or a Python loop over the pieces (launches per parameter on CUDA).
- *An outlier-aware codec* (values far above their block's typical magnitude sent aside, as LLM.int8 does for
  activations): how many there are depends on the values, so the wire size would need a host sync per gather, or
  a cap that overflows silently; and a block that merely mixes a large parameter with a small one has no outlier
  to find, only two scales.
- *Chosen*: keep the regular grid, and send every block that holds values of more than one parameter (a *mixed*
  block) exactly, in the row's dtype. Which blocks are mixed depends on the layout alone: ``plan_blocks`` lists
  them once, when the unit is built, as a (W, E) tensor of block numbers, E the most of any row (a row with fewer
  sends some single-parameter blocks exactly as well: the rows of a collective have one size). Every other block
  lies within one parameter, where blockwise int8 gives its usual bound: half a step of that block's own scale.
  The tail, under one block per row and possibly mixed, goes exactly too. The cost is at most one block per
  parameter boundary plus the tail: for a unit of large matrices (a transformer layer: about ten boundaries over
  millions of elements a rank) a few parts in 100,000 of the bytes (the 25M-parameter benchmark GPT, 512 wide,
  still sends 0.254 of the exact bytes); a unit of many small tensors sends more of itself exactly (a 32-wide toy
  GPT about 0.41), which is what its small tensors need. Giving a mixed block one scale per parameter in it would
  be cheaper there, at the price of a second, per-element layout; it is not worth it at the widths quantization
  is for. The estimator counts these bytes from the same plan.

Non-finite values are the same question within a block: ``inf / inf`` made a block with one ``-inf`` (an attention
mask kept as a frozen parameter) NaN throughout. The scale is taken over the block's finite values, and the three
non-finite values have codes of their own, so they travel exactly and the block's finite values keep their scale.
This is decided per element at every encoding, on the device: a setup-time check of the parameters would miss
values that arrive later (a checkpoint loaded into a frozen mask, a weight that overflows), and refusing them would
refuse a model that DDP trains. The scale is at least the smallest normal fp32 (so that its inverse is finite and
an infinity times it stays infinite); a block whose finite values are all 0 decodes them as 0. The scales are fp32:
a float64 row with finite values beyond fp32's range decodes that block as NaN, never as a wrong finite value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from lightning_zero.engine.comm.comm import Comm, Pending

Quantization = Literal["int8"]
QUANTIZATIONS = ("int8",)
BLOCK = 256  # elements per scale
_QMAX = 126.0  # the largest code of a finite value; 127, -127 and -128 are the non-finite ones
_POSINF, _NEGINF, _NAN = 127, -127, -128
_SMALLEST_SCALE = torch.finfo(torch.float32).tiny


def _align(offset: int, size: int) -> int:
    return -(-offset // size) * size


class _Sections(NamedTuple):
    """Where each part of a wire row starts (see [Note: quantized collectives]), in bytes."""

    full: int  # full blocks (int8 values, one scale each)
    tail: int  # elements after them, sent exactly
    exact_blocks: int  # full blocks also sent exactly
    scales_at: int
    exact_at: int
    tail_at: int
    slots_at: int
    row_bytes: int


def _sections(numel: int, exact_blocks: int, element_size: int, slots: int) -> _Sections:
    full = numel // BLOCK
    scales_at = full * BLOCK
    exact_at = _align(scales_at + 4 * full, element_size)
    tail_at = exact_at + exact_blocks * BLOCK * element_size
    # Each part at a multiple of its element size and every row a multiple of the largest, so that each part of
    # every row is a view of the byte buffer in its own dtype; the slots last, at a place that needs no count.
    row_bytes = _align(tail_at + (numel - scales_at) * element_size + 4 * slots, max(4, element_size))
    return _Sections(
        full, numel - scales_at, exact_blocks, scales_at, exact_at, tail_at, row_bytes - 4 * slots, row_bytes
    )


def row_bytes(numel: int, element_size: int = 4, exact_blocks: int = 0, slots: int = 0) -> int:
    """Bytes of one quantized row of ``numel`` values of ``element_size`` bytes, ``exact_blocks`` of its full blocks
    sent exactly, with ``slots`` fp32 values after it.

    Example::

        >>> row_bytes(1000)                      # 3 full blocks (256 int8 values and a scale each), a tail of 232
        1708
        >>> row_bytes(1000, exact_blocks=1)      # one block of 256 fp32 values more
        2732
    """
    return _sections(numel, exact_blocks, element_size, slots).row_bytes


def mixed_blocks(row_numel: int, rows: int, boundaries: Iterable[int]) -> list[list[int]]:
    """For each of ``rows`` rows of ``row_numel`` values (a flat buffer cut into equal ranges), its full blocks that
    hold values on both sides of a boundary: ``boundaries`` are the positions in the flat buffer where one
    parameter ends and another starts (see [Note: blocks that span parameters]). Pure arithmetic: no tensors.

    Example::

        >>> mixed_blocks(600, 2, [1, 300, 1150])   # rows of 2 full blocks and a tail; 1150 is in row 1's tail
        [[0, 1], []]
    """
    full = row_numel // BLOCK
    found: list[set[int]] = [set() for _ in range(rows)]
    for position in boundaries:
        row, offset = divmod(position, row_numel) if row_numel else (rows, 0)
        block, inside = divmod(offset, BLOCK)
        if row < rows and inside and block < full:  # not at a block's start, not in the (exact) tail
            found[row].add(block)
    return [sorted(blocks) for blocks in found]


@dataclass(frozen=True)
class BlockPlan:
    """Which full blocks of each row go exactly (``exact``: rows x E block numbers, distinct within a row, on the
    device the rows are on), for a flat buffer cut into equal rows. Made once per unit by ``plan_blocks``."""

    numel: int  # values per row
    exact: torch.Tensor

    @property
    def exact_blocks(self) -> int:
        return self.exact.shape[1]


def plan_blocks(row_numel: int, rows: int, boundaries: Iterable[int], device: torch.device | None = None) -> BlockPlan:
    """The ``BlockPlan`` of ``rows`` rows of ``row_numel`` values with parameters starting at ``boundaries``: each
    row's mixed blocks (``mixed_blocks``), topped up to the most of any row with its first single-parameter blocks.

    Example::

        >>> plan_blocks(600, 2, [1, 300, 1150]).exact.tolist()   # row 1 tops up with two blocks of one parameter
        [[0, 1], [0, 1]]
    """
    mixed = mixed_blocks(row_numel, rows, boundaries)
    most = max((len(blocks) for blocks in mixed), default=0)
    table = []
    for blocks in mixed:  # a row has at least ``most`` full blocks: every mixed block is one of them
        taken = set(blocks)
        table.append(blocks + [b for b in range(row_numel // BLOCK) if b not in taken][: most - len(blocks)])
    return BlockPlan(row_numel, torch.tensor(table, dtype=torch.int64, device=device).view(rows, most))


class _Parts(NamedTuple):
    """Views of the parts of R wire rows."""

    values: torch.Tensor  # R x full x BLOCK, int8
    scales: torch.Tensor  # R x full, fp32
    exact: torch.Tensor  # R x E x BLOCK, in the rows' dtype
    tail: torch.Tensor  # R x tail, in the rows' dtype


def _parts(wire: torch.Tensor, s: _Sections, dtype: torch.dtype) -> _Parts:
    count = wire.shape[0]
    values = wire[:, : s.scales_at].view(torch.int8).view(count, s.full, BLOCK)
    scales = wire[:, s.scales_at : s.scales_at + 4 * s.full].view(torch.float32)
    exact = wire[:, s.exact_at : s.tail_at].view(dtype).view(count, s.exact_blocks, BLOCK)
    tail = wire[:, s.tail_at : s.tail_at + s.tail * dtype.itemsize].view(dtype)
    return _Parts(values, scales, exact, tail)


def _block_index(exact_blocks: torch.Tensor) -> torch.Tensor:
    """``exact_blocks`` (R x E) as the index of a gather or scatter along the blocks of an R x blocks x BLOCK view."""
    return exact_blocks.unsqueeze(2).expand(*exact_blocks.shape, BLOCK)


def quantize(
    rows: torch.Tensor, exact_blocks: torch.Tensor | None = None, slots: torch.Tensor | None = None
) -> torch.Tensor:
    """``rows`` (R x n, any float dtype) as R wire rows of ``row_bytes(n, ...)`` bytes (uint8): the full blocks in
    int8, those numbered in ``exact_blocks`` (R x E, from a ``BlockPlan``) and the tail also exactly, and ``slots``
    (R x k, fp32 after the cast) appended unchanged.

    Example::

        >>> x = torch.linspace(-1, 1, 300).view(1, 300)
        >>> wire = quantize(x)
        >>> wire.shape, wire.dtype
        (torch.Size([1, 436]), torch.uint8)
        >>> bool((dequantize(wire, 300, x.dtype) - x).abs().max() <= 1 / 252 + 1e-7)   # half a step of the scale
        True
    """
    count, numel = rows.shape
    exact = 0 if exact_blocks is None else exact_blocks.shape[1]
    s = _sections(numel, exact, rows.element_size(), 0 if slots is None else slots.shape[1])
    wire = torch.empty((count, s.row_bytes), dtype=torch.uint8, device=rows.device)
    parts = _parts(wire, s, rows.dtype)
    main = rows[:, : s.scales_at].view(count, s.full, BLOCK)
    if s.full:
        _encode(main, parts.values, parts.scales)
    if exact:
        assert exact_blocks is not None
        parts.exact.copy_(main.gather(1, _block_index(exact_blocks)))
    parts.tail.copy_(rows[:, s.scales_at :])
    wire[:, s.tail_at + s.tail * rows.element_size() : s.slots_at].zero_()  # the padding: every byte sent is set
    if slots is not None:
        wire[:, s.slots_at :].view(torch.float32).copy_(slots)
    return wire


def _any(flags: torch.Tensor) -> bool:
    """Whether the elementwise work for non-finite values must run: always off the CPU (reading ``flags`` on the
    host would wait for the device), else only when a block is flagged (a CPU tensor is read at no cost)."""
    return flags.device.type != "cpu" or bool(flags.any())


def _encode(blocks: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
    """``blocks`` (R x b x BLOCK) into ``values`` (int8) and ``scales`` (fp32), in place (see [Note: quantized
    collectives] for the passes); at most one fp32 copy of the blocks and one in their dtype as temporaries. A block
    that holds an inf or NaN has a negative scale: the decoder looks for the codes of those values only then."""
    low, high = torch.aminmax(blocks, dim=2)
    largest = torch.maximum(high, low.neg()).float()
    nonfinite = largest.isfinite().logical_not_()  # an inf or a NaN in the block (inf or NaN as its largest)
    finite: torch.Tensor | None = None
    special = _any(nonfinite)
    if special:  # the scale over the finite values only
        finite = torch.nan_to_num(blocks, nan=0.0, posinf=0.0, neginf=0.0)
        low, high = torch.aminmax(finite, dim=2)
        largest = torch.maximum(high, low.neg()).float()
    scale = largest.div_(_QMAX).clamp_(min=_SMALLEST_SCALE)
    scales.copy_(torch.where(nonfinite, scale.neg(), scale))
    # |x| / scale <= 126 for a finite x; the non-finite values to their codes (the inverse is finite and positive).
    reuse = finite if finite is not None and finite.dtype == torch.float32 else None
    scaled = torch.mul(blocks, scale.reciprocal_().unsqueeze(2), out=reuse)
    if special:
        scaled.nan_to_num_(nan=_NAN, posinf=_POSINF, neginf=_NEGINF)
    values.copy_(scaled.round_())


def _decode(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """The values of ``values`` (int8) and ``scales`` written into ``out`` (same shape, any float dtype)."""
    decoded = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    decoded.copy_(values).mul_(scales.abs().unsqueeze(2))  # in place: a cast and a multiplication
    if _any(scales < 0):  # a block with an inf or NaN (see ``_encode``)
        for code, value in ((_POSINF, torch.inf), (_NEGINF, -torch.inf), (_NAN, torch.nan)):
            decoded.masked_fill_(values == code, value)
    if decoded is not out:  # scaled in fp32, rounded once into the half type
        out.copy_(decoded)


def dequantize(
    wire: torch.Tensor,
    numel: int,
    dtype: torch.dtype,
    exact_blocks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The R x ``numel`` values of R wire rows made by ``quantize`` from rows of ``dtype`` with these
    ``exact_blocks``: fp32, or written into ``out`` (R x ``numel``, any float dtype, e.g. a unit's gathered
    buffer), which is returned."""
    count = wire.shape[0]
    exact = 0 if exact_blocks is None else exact_blocks.shape[1]
    s = _sections(numel, exact, dtype.itemsize, 0)
    parts = _parts(wire, s, dtype)
    if out is None:
        out = torch.empty((count, numel), dtype=torch.float32, device=wire.device)
    main = out[:, : s.scales_at].view(count, s.full, BLOCK)
    if s.full:
        _decode(parts.values, parts.scales, main)
    if exact:
        assert exact_blocks is not None
        main.scatter_(1, _block_index(exact_blocks), parts.exact.to(out.dtype))
    out[:, s.scales_at :].copy_(parts.tail)
    return out


def slot_values(wire: torch.Tensor, slots: int) -> torch.Tensor:
    """The R x ``slots`` fp32 values carried at the end of each wire row."""
    return wire[:, wire.shape[1] - 4 * slots :].view(torch.float32)


def all_gather_quantized(
    comm: Comm,
    output: torch.Tensor,
    shard: torch.Tensor,
    plan: BlockPlan,
    name: str = "",
    guard: bool = False,
    async_op: bool = False,
) -> Pending | None:
    """``comm.all_gather(output, shard)`` with int8 on the wire: ``output`` receives every rank's shard, each
    quantized once (this rank's too: every rank sees the same values), the blocks of ``plan`` exactly. See
    [Note: quantized collectives]."""
    numel = shard.numel()
    world = comm.world_size
    own = quantize(shard.view(1, numel), plan.exact[comm.rank : comm.rank + 1])
    received = torch.empty((world, own.shape[1]), dtype=torch.uint8, device=shard.device)
    chunks = output.view(world, numel)

    def unpack() -> None:
        dequantize(received, numel, shard.dtype, plan.exact, out=chunks)

    return _then(
        comm.all_gather(received.view(-1), own.view(-1), name=name, guard=guard, async_op=True), unpack, async_op
    )


def reduce_scatter_quantized(
    comm: Comm, out: torch.Tensor, chunks: torch.Tensor, plan: BlockPlan, name: str = "", async_op: bool = False
) -> Pending | None:
    """Sum the rows of ``chunks`` (W x (n + 1): rank ``q``'s chunk of a unit's packed gradients, then its flag slot)
    over ranks into ``out`` (n + 1), row ``comm.rank``'s, with the n values int8 on the wire (the blocks of
    ``plan`` exactly) and the slot exact; the sum in fp32 (see [Note: quantized collectives])."""
    width = chunks.shape[1]
    numel = width - 1
    send = quantize(chunks[:, :-1], plan.exact, slots=chunks[:, -1:])
    received = torch.empty_like(send)
    rank = comm.rank
    # Every rank sent this rank its chunk ``rank``: range ``rank`` of the layout, with that row's exact blocks.
    own_blocks = plan.exact[rank : rank + 1].expand(comm.world_size, plan.exact_blocks)

    def add_up() -> None:
        values = dequantize(received, numel, chunks.dtype, own_blocks)
        values[rank] = chunks[rank, :-1]  # this rank's own chunk never went through the wire
        out[:-1].copy_(values.sum(dim=0))
        slots = slot_values(received, 1)
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
