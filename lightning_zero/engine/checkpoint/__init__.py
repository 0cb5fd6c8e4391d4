"""Checkpoints of a ``ShardedModel``: its pieces as DCP or ``torch.save`` entries and back (``sharded``), the save
protocol every front door uses (``saving``). Hugging Face exports are in ``engine.hf``.

The top layer of the engine: imports everything below it.
"""
