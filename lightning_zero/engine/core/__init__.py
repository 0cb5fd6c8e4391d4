"""The sharding core: how parameters are laid out in flat shards (``layout``), which modules form a unit
(``grouping``), one unit's shards and gathers (``unit``), the optimizer over shards (``optimizer``), and what a
sharded parameter answers when read outside its unit's gather (``placeholder``).

Imports ``engine.comm``, ``engine.errors`` and torch.
"""
