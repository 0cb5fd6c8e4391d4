"""What a run tool trains: the ``LightningModule`` a ``"FILE.py:CLASS"`` or ``"module:CLASS"`` target names, its
first optimizer and its first batch.

Example::

    module = build_on_meta("examples/dry_run_gpt.py:GPT1B")
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_zero.engine.meta.init_trace import record_meta_init


def build_on_meta(target: str | Callable[[], Any], init_kwargs: dict[str, Any] | None = None) -> nn.Module:
    """The ``LightningModule`` that ``target`` names (as ``dry_run`` takes it), built on the meta device as stage 3
    builds it (its ``configure_model`` too): every parameter's shape, and no memory, for ``estimate_memory``.

    Example::

        estimate_memory(build_on_meta("examples/dry_run_gpt.py:GPT1B"), devices=8)
    """
    factory = target_factory(target, init_kwargs or {})
    with record_meta_init():
        module = factory()
        if hasattr(module, "configure_model"):
            module.configure_model()
    return module


def target_factory(target: str | Callable[[], Any], kwargs: dict[str, Any]) -> Callable[[], Any]:
    """A function that builds ``target`` with ``kwargs``: the class a ``"FILE.py:CLASS"`` or ``"module:CLASS"``
    names (the file imported once), or ``target`` itself when it is a function."""
    if not isinstance(target, str):
        return lambda: target(**kwargs)
    location, sep, name = target.rpartition(":")
    if not sep or not location or not name:
        raise ValueError(f"expected FILE.py:CLASS or module:CLASS, got {target!r}")
    if location.endswith(".py"):
        path = Path(location).resolve()
        if not path.is_file():
            raise ValueError(f"{location!r} is not a file")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        source = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(path.stem, source)
        spec.loader.exec_module(source)
    else:
        source = importlib.import_module(location)
    if not hasattr(source, name):
        raise ValueError(f"{location!r} has no {name!r}")
    cls = getattr(source, name)
    return lambda: cls(**kwargs)


def first_optimizer(module: Any) -> torch.optim.Optimizer:
    """The module's first optimizer (``configure_optimizers`` may return one, a list, or Lightning's dict)."""
    configured = module.configure_optimizers()
    if isinstance(configured, dict):
        configured = configured["optimizer"]
    if isinstance(configured, (list, tuple)):
        configured = configured[0]
        if isinstance(configured, (list, tuple)):
            configured = configured[0]
    if not isinstance(configured, torch.optim.Optimizer):
        raise TypeError(f"configure_optimizers returned {type(configured).__name__}; dry_run needs an optimizer")
    return configured


def first_batch(module: Any, batch_shape: tuple[int, ...] | None) -> Any:
    """``(x, y)``, two int64 zero tensors of ``batch_shape``; without it, the first batch of the module's
    ``train_dataloader()`` (``None`` when it has none)."""
    if batch_shape is not None:
        x = torch.zeros(batch_shape, dtype=torch.long)
        return x, x.clone()
    loader = getattr(module, "train_dataloader", None)
    try:
        return next(iter(loader())) if callable(loader) else None
    except Exception as error:  # a datamodule-driven module: its own dataloader hook raises
        raise ValueError(f"the module's train_dataloader() gave no batch ({error}); pass batch_shape") from error
