"""The order in which units are reduced: one that every rank knows in advance, recorded on the first backward pass.

[Note: reduce order]
Every rank must issue the same collectives in the same order, and a unit should be reduced (and its
full gradients freed) as soon as its gradients are complete. The two meet in an order that every
rank knows in advance, as DDP rebuilds its buckets after the first iteration:

- on the first backward pass that reduces, units are reduced in the reverse of registration order
  (the usual order of backward), and each rank records the order in which its units *completed*
  (all of their trainable parameters have their gradient); units that never completed follow, in
  reverse registration order;
- when that backward pass ends, a hash of the recorded order travels in the all-reduce that the first
  backward pass issues (see [Note: which gradients exist] in ``grad_flags.py``): if every rank recorded the same
  order, it becomes the reduce order from the next backward on; if not (control flow that differs
  between ranks), every rank keeps the reverse registration order. Either way all ranks agree,
  without a collective per unit.

A unit is reduced from a gradient hook as soon as it is complete *and* every unit before it in the
order has been reduced; whatever is left (parameters unused in this backward, on this rank) is
reduced when the backward pass ends. The order cannot skip a unit that is incomplete on this rank:
whether another rank uses that unit is not known here, and if it does, that rank reduces it now
while this one would move on to the next, pairing different collectives. Skipping needs a rule
that reads only what every rank knows, and the recorded order is that rule: a unit unused on the
first step (or registered where it does not run) sits at its end, so it blocks nothing; one that
stops being used later, on one rank, delays the units after it on that rank to the end of backward
(correct, only later). Stage 1 reduces only on the micro-batch that synchronises: under ``no_sync``
(gradient accumulation) it keeps accumulating full gradients; stages 2 and 3 reduce every
micro-batch.
"""

from __future__ import annotations

import hashlib

from lightning_zero.engine.core.unit import ShardedUnit


def proposed_order(completed: list[ShardedUnit], units: list[ShardedUnit]) -> list[ShardedUnit]:
    """The units in the order they ``completed`` in this backward pass, then the rest of ``units`` in reverse
    registration order: what this rank proposes as the reduce order.

    Example::

        proposal = proposed_order([block1, block0], [root, block0, block1])   # [block1, block0, root]
    """
    done = set(completed)
    return completed + [u for u in reversed(units) if u not in done]


def order_hash(units: list[ShardedUnit], order: list[ShardedUnit]) -> list[int]:
    """Eight bytes of a hash of ``order`` (as positions in ``units``), then their complements (255 - b): after a
    MAX over ranks, every byte equals 255 minus its complement's maximum exactly when all ranks sent the same."""
    position = {id(u): i for i, u in enumerate(units)}
    data = list(hashlib.blake2b(repr([position[id(u)] for u in order]).encode(), digest_size=8).digest())
    return data + [255 - b for b in data]


def same_everywhere(hash_max: list[int]) -> bool:
    """Whether every rank sent the same ``order_hash``, from its bytes all-reduced with MAX."""
    half = len(hash_max) // 2
    return all(a == 255 - b for a, b in zip(hash_max[:half], hash_max[half:]))
