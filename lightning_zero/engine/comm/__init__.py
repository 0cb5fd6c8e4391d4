"""Communication and control: every collective the engine issues (``Comm``), the CPU channel on which ranks agree
before they communicate (``ControlChannel``), hybrid-sharding meshes and the process group's end.

Imports only ``engine.errors`` and torch.
"""
