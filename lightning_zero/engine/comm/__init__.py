"""Communication and control: every collective the engine issues (``Comm``, ``comm.py``), its counters
(``stats.py``), the checks that every rank issues the same ones (``sequence.py``), the CPU channel on which ranks
agree before they communicate (``ControlChannel``, ``control.py``), the stall reports that turn a hang into an
error (``stall.py``), the names the engine's work has in a profiler trace (``labels.py``), hybrid-sharding meshes
and the process group's end.

Imports only ``engine.errors`` and torch.
"""
