"""Making errors that come from torch.distributed say what happened in this library's terms."""

from __future__ import annotations

import re

from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_zero.engine.checkpoint.sharded import CheckpointMismatchError, CorruptCheckpointError
from lightning_zero.engine.core.optimizer import UnsupportedOptimizerError
from lightning_zero.engine.errors import CollectiveMismatchError
from lightning_zero.engine.meta.init_trace import MetaInitError
from lightning_zero.strategies.checkpointing import (
    CheckpointSaveError,
    UnsafeCheckpointError,
    WeightsOnlyCheckpointError,
)
from lightning_zero.strategies.precision import NonFiniteGradientError

# Errors raised by checks that run identically on every rank at the same point, so that after one of
# them all ranks can still take part in the collectives of a clean teardown.
RAISED_ON_EVERY_RANK: tuple[type[BaseException], ...] = (
    CheckpointMismatchError,
    CheckpointSaveError,
    CollectiveMismatchError,
    CorruptCheckpointError,
    MetaInitError,
    UnsupportedOptimizerError,
    NonFiniteGradientError,
    UnsafeCheckpointError,
    WeightsOnlyCheckpointError,
    SIGTERMException,  # rank 0's SIGTERM, announced in the step agreement (see [Note: the start of a training batch])
)

_PEER_GONE = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote process exited|Broken pipe|"
    r"ProcessGroupNCCL.*(?:abort|watchdog)|NCCL communicator was aborted",
    re.IGNORECASE,
)
PEER_FAILURE_HINT = (
    "lightning_zero: another rank exited or was killed while this rank waited for it in a collective, so this "
    "rank stopped too. The cause is in the other ranks' logs (an exception, the out-of-memory killer, a "
    "preempted node). Resume from the last checkpoint with trainer.fit(..., ckpt_path=...)."
)


def explain_peer_failure(exception: BaseException) -> None:
    """Append ``PEER_FAILURE_HINT`` to ``exception``'s message if it says a peer went away (in place)."""
    message = str(exception)
    if _PEER_GONE.search(message) and PEER_FAILURE_HINT not in message:
        exception.args = (f"{message}\n{PEER_FAILURE_HINT}", *exception.args[1:])


def peer_went_away(exception: BaseException) -> bool:
    """Whether ``exception`` is the backend's error for a peer that exited or was killed (a failure caused by
    another rank, not this one's own)."""
    return bool(_PEER_GONE.search(str(exception)))
