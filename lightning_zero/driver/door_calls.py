"""What both doors do alike around the driver's calls: the module moved to the device before sharding, and the
first steps of a save and of a load (see [Note: one driver, two doors] in ``driver/driver.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.nn import Module

from lightning_zero.driver.driver import ZeRODriver
from lightning_zero.engine.meta.materialize import has_meta_tensors


def module_to_device(module: Module, device: torch.device) -> None:
    """``module.to(device)``; for a module built on the ``meta`` device (``configure_model`` or
    ``fabric.init_module()`` under ``meta_init``), only the tensors that exist already: the engine creates the
    others on the device, one unit at a time. Their data moves in place, so that the objects the meta-init
    recording holds (a real tensor that initialized a layer) stay the module's.

    Example::

        module_to_device(model, torch.device("cuda", 0))
    """
    if not has_meta_tensors(module):
        module.to(device)
        return
    for tensor in [*module.parameters(), *module.buffers()]:
        if not tensor.is_meta and tensor.device != device:
            tensor.data = tensor.data.to(device)


def refuse_storage_options(strategy: object, storage_options: Any | None) -> None:
    """Both doors' ``save_checkpoint`` write through the driver's save protocol, which takes no storage options."""
    if storage_options is not None:
        raise TypeError(f"{type(strategy).__name__}.save_checkpoint does not take storage_options")


def begin_save(driver: ZeRODriver, call: str, path: Any) -> Path:
    """Before a save: every rank agrees it is saving (``call`` names the user's call, e.g. ``"fabric.save"``, for
    the report of a rank that is not), and all write to rank 0's path.

    Example::

        target = begin_save(driver, "save_checkpoint", filepath)
    """
    if driver.sharded is not None:
        driver.sharded.comm.agree_event("save_checkpoint", lambda: f"{call}({str(path)!r})")
    return Path(driver.broadcast(str(path)))


def begin_load(driver: ZeRODriver, path: Any) -> Path:
    """Before a load: the save in flight is finished (it may be the checkpoint asked for), and all read rank 0's
    path.

    Example::

        target = begin_load(driver, checkpoint_path)
    """
    driver.finish_saves()
    return Path(driver.broadcast(str(path)))
