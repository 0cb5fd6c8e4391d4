"""The default process group, destroyed before the interpreter exits, when this package's strategy created it.

[Note: the process group at exit]
Lightning creates the default process group in the strategy's ``setup_environment`` and never
destroys it. At the interpreter's exit its gloo worker threads then still run: one that frees the
last collective it ran frees that collective's tensors, whose Python objects need the GIL, and a
thread that asks for the GIL after Python has finalized is ended by ``pthread_exit``, whose forced
unwind through torch's C++ frames aborts the process with ``terminate called without an active
exception`` (a core dump shows ``ProcessGroupGloo::runLoop`` destroying an ``AsyncAlltoallWork``),
in about one two-rank run in twenty (``DDPStrategy``'s too), after the run had succeeded. So when
a ZeRO strategy is the one that created the group, an ``atexit`` handler destroys it, as
``torch.distributed`` asks, while Python still runs. Destroying a group waits for the work queued
on it, so the handler does so only when nothing can be in flight: no run of this process failed
(``mark_failed``), and no uncaught exception ended the program (``sys.last_value``); otherwise the
exit is left as it was. Before that, the handler closes the control channels no teardown closed (a Fabric script
that never calls ``fabric.strategy.teardown()``, as LitGPT's do): their monitor threads stop while Python runs.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import sys
import weakref
from typing import Any

import torch.distributed as dist


class _ExitState:
    registered = False
    owns_group = False
    failed = False
    channels: list[weakref.ref] = []  # control channels to close at exit, if the run never reached teardown


def destroy_at_exit() -> None:
    """Call right after this process created the default process group: destroy it at exit (see [Note: the process
    group at exit]). Idempotent."""
    _ExitState.owns_group = True
    _register()


def close_at_exit(channel: Any) -> None:
    """Close ``channel`` (a ``ControlChannel``: its monitor thread, and its group unless a run failed) at exit if
    nothing closed it before: a Fabric script that never calls ``fabric.strategy.teardown()`` (LitGPT's) ends
    with it open, and its monitor thread, a daemon, would still run while the interpreter finalizes (see [Note:
    nothing outlives teardown] in ``control.py``)."""
    _ExitState.channels = [ref for ref in _ExitState.channels if ref() is not None]
    _ExitState.channels.append(weakref.ref(channel))
    _register()


def _register() -> None:
    if not _ExitState.registered:
        _ExitState.registered = True
        atexit.register(_destroy)


def mark_failed() -> None:
    """A run of this process failed: collectives may be in flight, so the group is left to the exit."""
    _ExitState.failed = True


def _destroy() -> None:
    failed = _ExitState.failed or getattr(sys, "last_value", None) is not None
    for ref in _ExitState.channels:
        channel = ref()
        if channel is not None and not channel.closed:
            with contextlib.suppress(Exception):
                channel.close(destroy_group=not failed)
    if failed or not _ExitState.owns_group:
        return
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        # Destroying unregisters the groups; a group's worker threads are joined when the group object goes, and
        # the last references may sit in reference cycles: collect them while Python can still run the threads'
        # last decrefs (which need the GIL).
        gc.collect()
