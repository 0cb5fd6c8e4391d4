"""Models built on the ``meta`` device: recording a construction (``init_trace``, ``init_calls``), replaying it one
unit at a time already sharded (``init_plan``, ``materialize``). Pretrained weights read into the shards are in
``engine.hf``.

Imports ``engine.core``, ``engine.io``, ``engine.errors`` and torch.
"""
