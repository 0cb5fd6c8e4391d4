"""What the Trainer's loops ask every rank to agree on (see [Note: agreements] in ``engine/comm/control.py``; what
both front doors agree on is in ``driver/agreement.py``).

- at the start of every step: which step it is (phase, epoch, step counter, trainable set, whether
  gradients are being accumulated), so that a rank that ran out of data, went on to validation or
  froze a layer alone is named at once instead of pairing its collectives with another step's
  (evaluation steps, which ranks may run different numbers of: see [Note: uneven evaluation]);
- at the start of a training batch: whether any rank received SIGTERM (``StepAgreement``: where that agreement
  stands, from the batch's start to its ``training_step``).
"""

from __future__ import annotations

import enum
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor

from lightning_zero.driver.agreement import PHASES, trainable_hash
from lightning_zero.engine import Comm
from lightning_zero.engine.comm.advice import AFTER_TRAINING, SERVING
from lightning_zero.engine.comm.sequence import PendingStep
from lightning_zero.engine.sharded_model import ShardedModel

log = logging.getLogger(__name__)


def _training_row(
    trainer: Any, params: Sequence[Tensor], step: int, batch_idx: int
) -> tuple[list[int], Callable[[], str]]:
    epoch = int(getattr(trainer, "current_epoch", 0))
    trainable = trainable_hash(params)

    def describe() -> str:
        return f"training step {step} (epoch {epoch}, batch_idx {batch_idx}, trainable set #{trainable:08x})"

    return [PHASES.index("training"), epoch, step, trainable], describe


def before_training_batch(
    comm: Comm, trainer: Any, params: Sequence[Tensor], step: int, sigterm: bool = False
) -> tuple[Callable[[], str], PendingStep]:
    """Issue the agreement on the training step every rank is about to start, before the batch is fetched (see
    ``wrap_batch_start``), without waiting for it; returns the step's description, for ``begin_training_step``,
    and the pending agreement, whose ``result()`` carries every rank's ``sigterm`` (``any_sigterm``). The
    step's next collective or agreement settles it by itself."""
    row, describe = _training_row(trainer, params, step, _batch_in_epoch(trainer))
    pending = comm.agree_step_later(row, describe, shared=int(sigterm))
    # The step's sequence starts here, so that the gathers issued at the batch's start are part of it (see
    # [Note: gathers at the start of a batch] in engine/sharded_model.py); ``begin_training_step`` names its key.
    comm.begin_sequence("training", None, describe)
    return describe, pending


# The Trainer's hooks that run after the training loop has ended, while the strategy is still set up (``on_fit_end``
# runs after its teardown, when nothing of this library's is left to check).
_AFTER_TRAINING_HOOKS = frozenset({"on_train_end"})


def after_training(trainer: Any) -> str | None:
    """Where this rank is, for the reports of the collective checks (``ControlChannel.context``), when it is in a
    hook that runs after the training loop: ``"in on_train_end, after the training loop"``; else ``None``.

    The last training step's sequence is still open there (nothing ends it before the hook: Lightning calls the
    callbacks' ``on_train_end`` before the strategy's), so its counters would call a collective of the hook
    "collective 11 of training step 2". Lightning records the hook it is calling on the module
    (``_current_fx_name``), which is read only when a report is made."""
    hook = getattr(getattr(trainer, "lightning_module", None), "_current_fx_name", None)
    return f"in {hook}, {AFTER_TRAINING}" if hook in _AFTER_TRAINING_HOOKS else None


class BatchStart(enum.Enum):
    """What the step agreement at the start of a training batch says (see [Note: the start of a training batch])."""

    STOP = "stop"  # some rank received SIGTERM: every rank raises Lightning's SIGTERMException, before the batch
    GO = "go"  # every rank starts the batch (or the answer is still on its way: settled once the batch is fetched)
    UNAGREED = "unagreed"  # nothing was exchanged: Lightning's own broadcast runs


def _answer(pending: PendingStep) -> BatchStart:
    """What every rank's SIGTERM flag in ``pending`` says (waits for it)."""
    shared = pending.result()
    if shared is None:
        return BatchStart.UNAGREED
    return BatchStart.STOP if any(shared) else BatchStart.GO


def stop_for_sigterm(trainer: Any) -> None:
    """What every rank does when a step agreement says some rank received SIGTERM: Lightning's exit."""
    trainer._signal_connector.received_sigterm = True
    raise SIGTERMException()


def begin_training_step(
    comm: Comm,
    trainer: Any,
    params: Sequence[Tensor],
    accumulating: bool,
    step: int,
    agreed: Callable[[], str] | None,
) -> None:
    """Start the sequence of training step ``step`` (counted since setup); agree on it first unless
    ``before_training_batch`` already did (``agreed``: the description it returned)."""
    key = "training (accumulating)" if accumulating else "training"
    if agreed is not None:
        comm.continue_sequence(key, agreed)
        return
    row, describe = _training_row(trainer, params, step, _batch_in_epoch(trainer) - 1)
    comm.begin_sequence(key, row, describe)


class SigtermRelay:
    """Lightning's SIGTERM notifier, without its broadcast: the signal is only recorded here (``pending``), and
    travels to the other ranks in the next step agreement (see [Note: the start of a training batch]).

    Example::

        relay = SigtermRelay(trainer)
        relay.install()        # after Lightning registered its handlers (at the first batch)
        relay.pending          # True once this process received SIGTERM
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.pending = False
        self.installed = False

    def install(self) -> None:
        """Put ``notify`` in place of Lightning's notifier in the SIGTERM handler Lightning registered (if any)."""
        self.installed = True
        connector = getattr(self.trainer, "_signal_connector", None)
        lightning_notifier = getattr(connector, "_sigterm_notifier_fn", None)
        handlers = getattr(signal.getsignal(signal.SIGTERM), "signal_handlers", None)
        if lightning_notifier is None or not isinstance(handlers, list):
            return
        for index, handler in enumerate(handlers):
            if handler == lightning_notifier:
                handlers[index] = self.notify

    def notify(self, signum: int, _frame: Any) -> None:
        log.info("lightning_zero: rank %d received signal %d", getattr(self.trainer, "global_rank", 0), signum)
        if not self.pending:  # as Lightning does: stop the processes this one launched
            launcher = getattr(self.trainer.strategy, "launcher", None)
            if launcher is not None:
                launcher.kill(signum)
        self.pending = True


def wrap_batch_start(trainer: Any, agree: Callable[[bool], BatchStart]) -> Callable[[], None] | None:
    """Run ``agree`` where Lightning's training loop starts a batch, in place of what it does there.

    [Note: the start of a training batch]
    Lightning's training loop begins every batch, before fetching it, with a ``torch.distributed.broadcast``
    of rank 0's SIGTERM flag (``_TrainingEpochLoop._broadcast_sigterm_tensor``), on the default group and
    outside any strategy hook, then reads it on the host (``.item()``: on CUDA, a wait for the device). A rank
    that has run out of batches never gets there, so the others would wait in that broadcast, out of this
    library's reach, for the process group's timeout. The strategy therefore replaces that method on the
    Trainer's loop object (an attribute of the instance, removed at teardown) with the step agreement: the
    ranks that are about to start a batch meet the rank that went on to validation or to the end of fit in
    an agreement, which names them. One exchange per batch instead of two, on the CPU side group, with no
    device read.

    The agreement carries the SIGTERM flag instead. Lightning's own handler cannot be kept as it is: on rank
    0 it issues a ``broadcast`` on the default group from inside the signal handler, wherever the main thread
    happens to be, which pairs with whatever collective the other ranks issue next (a stage-3 all-gather, a
    reduce-scatter) and corrupts or deadlocks the step; and the rank that received the signal raises
    ``SIGTERMException`` at the end of its batch while the others start the next one. So at the first batch
    ``SigtermRelay`` takes the place of Lightning's notifier in the handler Lightning registered: the signal
    is recorded in this process only (and, as Lightning does, the launched processes are stopped). The next
    step agreement carries every rank's flag, and if any rank has one, every rank marks the Trainer as having
    received SIGTERM and raises Lightning's ``SIGTERMException`` there, together, before the batch: the same
    exit as Lightning's, at the same batch on every rank, and from any rank, not rank 0 only. (Validation
    already under way finishes first.) Without that method (another Lightning version) nothing is wrapped,
    and the agreement happens in ``training_step``, after the fetch. ``agree`` takes this rank's flag and returns a
    ``BatchStart``: ``STOP`` if any rank has one, ``GO`` if none has or the answer comes later (below),
    ``UNAGREED`` when it exchanged nothing (then Lightning's broadcast runs). Returns the function that removes
    the wrapper.

    The agreement is issued here and waited for after the fetch: at the start of the strategy's
    ``batch_to_device``, before the batch's transfer and every hook from ``transfer_batch_to_device`` on, or
    before any collective or agreement of this library that comes first (``CollectiveSequence.agree_step_later``:
    the step's first collective settles it). While the dataloader produces the batch, the exchange travels.
    Waiting at once costs more than the exchange itself: on processes that share their cores, a gloo exchange
    waited for right after its issue waits for every process's gloo thread to be scheduled. (Measured through
    a real Trainer on 2 CPU ranks, 300 steps, three rounds: OPT of ``benchmarks.real_models`` 0.4 to 0.5 ms off
    an 8.6 to 9.5 ms step under stages 1 and 2; its ViT, whose batches cost less to produce, no difference
    beyond the noise.) Nothing of the step that the other ranks must join is issued before every rank is
    known to start it, so a rank that went elsewhere is still named before any of this library's collectives
    pairs wrongly, and the SIGTERM exit is still taken by every rank together, before the batch's hooks.
    Only the dataloader and ``on_before_batch_transfer`` run before the answer: a raw ``torch.distributed``
    call there (none of Lightning's) is not covered. Under stage 3 the agreement is waited for at once when
    the batch's first gathers are issued on its answer (a batch that no optimizer step precedes: see
    [Note: gathers at the start of a batch])."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    original = getattr(loop, "_broadcast_sigterm_tensor", None)
    if loop is None or original is None or "_broadcast_sigterm_tensor" in vars(loop):
        return None
    relay = SigtermRelay(trainer)

    def start_batch() -> None:
        if not relay.installed:
            relay.install()
        answer = agree(relay.pending or bool(getattr(trainer, "received_sigterm", False)))
        if answer is BatchStart.UNAGREED:
            original()
        elif answer is BatchStart.STOP:
            stop_for_sigterm(trainer)

    loop._broadcast_sigterm_tensor = start_batch

    def remove() -> None:
        vars(loop).pop("_broadcast_sigterm_tensor", None)

    return remove


class AgreementState(enum.Enum):
    """Where the agreement on the next training step stands (``StepAgreement.state``)."""

    NONE = "none"  # nothing agreed ahead: ``training_step`` agrees on its step itself
    IN_FLIGHT = "in flight"  # issued at the batch's start; its answer travels while the batch is fetched
    AGREED = "agreed"  # agreed at the batch's start: ``training_step`` continues that step's sequence


@dataclass
class StepAgreement:
    """The Trainer's agreement on the next training step, from the start of its batch (``wrap_batch_start``) to the
    ``training_step`` that runs it (see [Note: the start of a training batch]). The strategy holds one and calls it
    from the batch's start (``start_batch``), the batch's transfer (``settle``), ``training_step``
    (``begin_training_step``), the optimizer step (``gathered_ahead``) and the end of a run (``forget``).

    Example::

        agreement = StepAgreement()
        agreement.install(trainer, lambda sigterm: agreement.start_batch(sharded, trainer, step, sigterm))
        agreement.settle()                                      # in batch_to_device
        agreement.begin_training_step(sharded, trainer, step)   # in training_step
    """

    state: AgreementState = AgreementState.NONE
    step: int = 0  # the training step agreed on (``IN_FLIGHT``, ``AGREED``), counted since setup
    describe: Callable[[], str] | None = None  # what that step is, for the reports
    pending: PendingStep | None = None  # ``IN_FLIGHT``: the exchange on its way
    trainer: Any = None  # whose batch started
    # Stage 3: the last optimizer step issued the next step's first gathers (see [Note: gathers at the start of a
    # batch] in engine/sharded_model.py).
    gathered_ahead: bool = False
    uninstall: Callable[[], None] | None = None  # removes the wrapper of the batch's start

    @property
    def in_flight(self) -> bool:
        return self.state is AgreementState.IN_FLIGHT

    def install(self, trainer: Any, agree: Callable[[bool], BatchStart]) -> None:
        """Agree at the start of every training batch of ``trainer``'s loop (``wrap_batch_start``)."""
        self.uninstall = wrap_batch_start(trainer, agree)

    def remove(self) -> None:
        """Give the batch's start back to Lightning (at teardown)."""
        if self.uninstall is not None:
            self.uninstall()
            self.uninstall = None

    def start_batch(self, sharded: ShardedModel, trainer: Any, step: int, sigterm: bool) -> BatchStart:
        """Issue the agreement on training step ``step`` with this rank's SIGTERM flag. Its answer travels during
        the fetch unless stage 3 gathers on it now (a batch that no optimizer step gathered for: see [Note: gathers
        at the start of a batch]); then ``GO`` issues those gathers."""
        self.settle()  # (one a batch that ``on_train_batch_start`` never saw left pending)
        describe, pending = before_training_batch(sharded.comm, trainer, sharded.params, step, sigterm)
        self.step, self.describe, self.trainer = step, describe, trainer
        if pending.exchanges and (sharded.stage3 is None or self.gathered_ahead):
            self.state, self.pending = AgreementState.IN_FLIGHT, pending  # nothing is issued on its answer
            return BatchStart.GO
        self.state = AgreementState.AGREED
        answer = _answer(pending)
        if answer is BatchStart.GO:  # every rank starts this training step
            sharded.gather_for_next_step()
        return answer

    def settle(self) -> None:
        """Wait for the agreement if it is in flight, and stop every rank together if some rank received SIGTERM."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        self.state = AgreementState.AGREED
        if _answer(pending) is BatchStart.STOP:
            stop_for_sigterm(self.trainer)

    def begin_training_step(self, sharded: ShardedModel, trainer: Any, step: int) -> None:
        """Start the sequence of training step ``step``: the one agreed at its batch's start, or agreed now."""
        agreed = self.describe if self.state is not AgreementState.NONE and self.step == step else None
        self.state, self.describe, self.gathered_ahead = AgreementState.NONE, None, False
        accumulating = sharded.reducer.no_sync_requested
        begin_training_step(sharded.comm, trainer, sharded.params, accumulating, step, agreed)

    def forget(self, sharded: ShardedModel | None) -> None:
        """Drop an agreement still in flight when the run stops (an error, teardown): it is not waited for."""
        if self.pending is not None:
            self.pending = None
            self.state = AgreementState.NONE
            if sharded is not None:
                sharded.comm.forget_step()


def begin_eval_step(comm: Comm, phase: str, step: int, describe: Callable[[], str], joined: bool) -> None:
    """Start evaluation step ``step`` (counted from 1 in each evaluation loop; ``phase``: validation, sanity check,
    test, predict). See [Note: uneven evaluation]: ``joined`` (stage 3) agrees on it now, announcing that this rank
    runs a batch; otherwise (stages 1 and 2) it is agreed only if it issues a collective.

    [Note: uneven evaluation]
    Lightning gives each rank its own part of the evaluation data, and the parts need not have as many
    batches: ``trainer.predict`` uses ``UnrepeatedDistributedSamplerWrapper``, which does not pad (9 samples
    on 2 ranks in batches of 2: 3 batches and 2), and a sampler of the user's (``use_distributed_sampler=
    False``) or an iterable dataset may give any counts. DDP runs that, since its evaluation forward has no
    collective; so do these strategies.

    Stages 1 and 2 hold the full parameters: an evaluation step issues no collective of its own, so it is
    opened with ``Comm.defer_sequence``. Its agreement is made at its first collective, if it issues one
    (the buffer broadcast of the first batch after training steps, as DDP's; ``self.log(...,
    sync_dist=True)`` with ``on_step=True``), and dropped at the end of a step that issued none. Ranks with
    different numbers of batches then never meet per batch; a step that does communicate still finds a rank
    that has left the loop (at the teardown, the next training step, or the loop's synced logging, which is
    Lightning's reduce agreed outside a step) and names it, instead of pairing with it.

    Stage 3 gathers every unit in each forward, so a rank that has run out of batches must take part in the
    gathers of the ranks still running, for as long as they run (a *join*, as DDP's ``join()`` for
    training). Each evaluation step is agreed, as a training step is, and carries a flag: this rank runs a batch.
    At the end of its last batch (Lightning's ``batch_progress.is_last_batch``, known in advance because the loop's
    fetcher reads one batch ahead), a rank *serves* (``serve_eval_steps``): it agrees on the next step with its flag
    down; if another rank's flag is up, it replays one evaluation forward's gathers, unit by unit in the
    recorded order and with the same prefetches (``Stage3Hooks.replay_eval_forward``), which pair with that
    rank's first forward of the batch, and goes on to the next step; once no flag is up every rank has
    finished, and all leave the loop together, to what follows it (the loop's synced logging, the teardown) in
    step again. So one agreement per batch, and one more per loop. A batch that runs more forwards
    (a generation loop: one per new token) has each later one agreed, and the serving rank serves it from the
    agreement it is in (see [Note: joined forwards] in ``engine/schedule/joined.py``), as a rank that is done
    generating serves the others' within a batch. A served step is a step of the "evaluation"
    sequence like any other (see [Note: collective checks] in ``engine/comm/sequence.py``): a batch that issues
    another collective than the forward's gathers (a per-batch synced log, a callback that communicates) is
    found, at once or by the stall report, with the serving rank's line saying that it serves. Not joined: a
    rank with no batch at all (Lightning skips its loop), and a step that takes ``dataloader_iter`` (its last
    batch is not known in advance); both are refused, naming where each rank is. With
    ``collective_checks="off"`` nothing is agreed, so nothing is joined either.
    """
    row = [PHASES.index(phase), step]
    if not joined:
        comm.defer_sequence("evaluation", row, describe)
        return
    comm.agree_step(row, describe, shared=1)
    comm.begin_sequence("evaluation", None, describe)


def serve_eval_steps(
    comm: Comm, phase: str, last: int, describe: Callable[[int], str], replay: Callable[[], None]
) -> int:
    """After this rank's last evaluation batch, step ``last``: serve the gathers of the ranks that still run
    batches, one step at a time, until none does (see [Note: uneven evaluation]). ``describe(step)`` says what this
    rank does at ``step`` (it should contain ``SERVING``); ``replay()`` issues one step's gathers. Returns how many
    steps were served."""
    step = last
    while True:
        step += 1
        says = partial(describe, step)
        running = comm.agree_step([PHASES.index(phase), step], says, shared=0)
        if running is None or not any(running):
            return step - last - 1
        comm.begin_sequence("evaluation", None, says)
        replay()


def describe_serving(phase: str, batches: int, after: str, step: int) -> str:
    """What a rank that serves (``serve_eval_steps``) is doing at ``step``."""
    return f"{phase} step {step} ({after}; this rank's {batches} {phase} batches are done: it {SERVING})"


def _batch_in_epoch(trainer: object) -> int:
    try:
        return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)  # type: ignore[attr-defined]
    except AttributeError:
        return -1
