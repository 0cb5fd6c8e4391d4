"""The pieces of ``benchmarks/gpu_first_run.py``: what each variant trains (``training``), the probes that watch
a step (``probes``: host synchronisations, late collectives, what stays alive, peak memory) and the two-rank check
(``ranks``). Nothing runs at import; call ``load_engine()`` before importing ``training`` or ``probes``."""

from __future__ import annotations

import sys
import types
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_zero"


def load_engine() -> str:
    """Make ``lightning_zero``'s engine importable without ``lightning_zero/__init__.py``, which imports Lightning
    (absent on a bare GPU machine, and seconds of every process's start on a loaded CPU; the engine, the estimator
    and the activation profiler are pure torch), as ``benchmarks/gpu_check.py`` does without Lightning. Returns how:
    ``"engine only"``, or ``"package"`` when the package was imported already."""
    if "lightning_zero" in sys.modules:
        return "package"
    package = types.ModuleType("lightning_zero")
    package.__path__ = [str(PACKAGE)]
    sys.modules["lightning_zero"] = package
    return "engine only"
