"""Recording a meta-device build past its block, until setup: what Fabric code writes between the two is the build.

[Note: writes after the build block]
Under Fabric the model is built in ``with fabric.init_module():`` and sharded at ``fabric.setup(model)``; code
between the two is the user's, and often initializes: LitGPT's ``pretrain.py`` builds under
``init_module(empty_init=True)`` and calls ``initialize_weights(fabric, model, ...)`` after the block, then sets
``model.max_seq_length`` (which rebuilds the rotary buffers) and ties the embeddings. Under DDP those writes give
the initial values. On the meta device they do nothing, so the recording of the build (``init_trace.py``) does not
end with the block: ``ContinuedRecording`` keeps its op and function recorders and its call observer on until
``stop()`` (the driver calls it at setup, at the next ``init_module`` block and at teardown), without the meta
default device, so that what the code between creates for real stays real. Every write on the model's meta
tensors, every meta tensor created from them, every ``torch.nn.init`` call and every seed in between is recorded
into the same trace, in order, and replayed at setup like the build itself: the values are DDP's.

``empty_init=True`` is honoured as Lightning's ``_EmptyInit`` honours it under DDP: inside the block, the
``torch.nn.init`` functions that pass through the torch function modes are skipped (nothing written, nothing
drawn), so that the random stream the code after the block draws from is the one DDP's draws from.

Limits, each refused at setup rather than guessed: a write that bypasses the dispatcher still shows as a changed
version (``InitTrace.changed_after_recording``); if another profiler held ``sys.setprofile`` while the recording
continued and anything was recorded then, the trace is refused as a build recorded under a profiler is. Ops on
real tensors in between cost one Python dispatch each (the recorders look at every op); none are recorded.

Example::

    with record_meta_init() as trace:
        model = GPT(config)
    continued = ContinuedRecording(trace)
    initialize_weights(model)          # recorded into trace
    continued.stop()
"""

from __future__ import annotations

import sys
from typing import Any

from torch.overrides import _get_current_function_mode_stack
from torch.overrides import _pop_mode as _pop_function_mode
from torch.overrides import _push_mode as _push_function_mode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils._python_dispatch import _pop_mode as _pop_dispatch_mode
from torch.utils._python_dispatch import _push_mode as _push_dispatch_mode

from lightning_zero.engine.meta.init_calls import InitCallObserver
from lightning_zero.engine.meta.init_trace import InitTrace, _FunctionRecorder, _OpRecorder


class ContinuedRecording:
    """Records into ``trace`` from now until ``stop()`` (see [Note: writes after the build block])."""

    def __init__(self, trace: InitTrace) -> None:
        self.trace = trace
        self.first_step = len(trace.steps)
        self.observer = InitCallObserver(trace)
        self.functions = _FunctionRecorder(trace, self.observer)
        self.ops = _OpRecorder(trace)
        self.functions.__enter__()
        self.ops.__enter__()
        observed = trace.calls_observed
        self.observer.__enter__()
        self.observed = trace.calls_observed
        trace.calls_observed = observed  # decided at stop: only what was recorded unobserved matters
        self.stopped = False

    def stop(self) -> None:
        """End the recording (idempotent); the trace then holds everything written since the build began."""
        if self.stopped:
            return
        self.stopped = True
        if self.observer._active and sys.getprofile() != self.observer._observe:
            self.observer._active = False  # another profiler replaced the hook meanwhile: calls went unobserved
            self.observed = False
        self.observer.__exit__(None, None, None)
        _remove_mode(self.ops, _get_current_dispatch_mode_stack, _pop_dispatch_mode, _push_dispatch_mode)
        _remove_mode(self.functions, _get_current_function_mode_stack, _pop_function_mode, _push_function_mode)
        steps = self.trace.steps[self.first_step :]
        if not self.observed and steps:
            self.trace.calls_observed = False
        # Versions bumped by recorded writes (through views too) are current; any other bump is a write the
        # recording did not see, refused at setup.
        self.trace.end_of_recording(written={w.storage for step in steps for w in step.writes})


def _remove_mode(mode: Any, stack: Any, pop: Any, push: Any) -> None:
    """Take ``mode`` off its thread's mode stack, wherever it is: modes the user entered after it (a
    ``with torch.device(...)`` around ``fabric.setup``) stay, in their order."""
    modes = stack()
    if not any(m is mode for m in modes):
        return
    above = []
    while modes[-1] is not mode:
        above.append(pop())
        modes = stack()
    mode.__exit__(None, None, None)  # pops it, and restores what entering it set
    for other in reversed(above):
        push(other)
