"""Checkpoints of a ``ShardedModel``: its pieces as DCP or ``torch.save`` entries and back (``sharded``), the save
protocol every front door uses (``saving``), and Hugging Face exports (``hf_export``, peft's ``peft_export``).

The top layer of the engine: imports everything below it.
"""
