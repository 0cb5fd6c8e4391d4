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
exit is left as it was.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import sys

import torch.distributed as dist


class _ExitState:
    registered = False
    failed = False


def destroy_at_exit() -> None:
    """Call right after this process created the default process group: destroy it at exit (see [Note: the process
    group at exit]). Idempotent."""
    if not _ExitState.registered:
        _ExitState.registered = True
        atexit.register(_destroy)


def mark_failed() -> None:
    """A run of this process failed: collectives may be in flight, so the group is left to the exit."""
    _ExitState.failed = True


def _destroy() -> None:
    if _ExitState.failed or getattr(sys, "last_value", None) is not None:
        return
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        # Destroying unregisters the groups; a group's worker threads are joined when the group object goes, and
        # the last references may sit in reference cycles: collect them while Python can still run the threads'
        # last decrefs (which need the GIL).
        gc.collect()
