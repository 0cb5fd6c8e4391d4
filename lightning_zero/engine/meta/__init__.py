"""Models built on the ``meta`` device: recording a construction (``init_trace``, ``init_calls``), replaying it one
unit at a time already sharded (``init_plan``, ``materialize``), and pretrained weights read into the shards
(``pretrained``).

Imports ``engine.core``, ``engine.io``, ``engine.errors`` and torch.
"""
