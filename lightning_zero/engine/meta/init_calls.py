"""Initialization code whose ops on the ``meta`` device do not say what it does on real memory.

[Note: init calls on meta]
Recording aten ops (``init_trace.py``) captures most initialization, but not code that looks at values or
at the device before it acts:

- ``torch.nn.init`` functions may draw a number of random values that depends on the values drawn
  (``trunc_normal_`` samples by rejection in recent torch), or skip the work on meta altogether
  (``trunc_normal_``, ``orthogonal_``, ``sparse_``, ``dirac_``). A call of any ``torch.nn.init`` function
  on a meta tensor is therefore recorded as one step, the function itself with its arguments, and replayed
  by calling it on real memory; the ops it dispatches on meta are not recorded.
- From version 5, Hugging Face ``transformers`` decides in ``PreTrainedModel.init_weights`` (which
  ``post_init()`` calls at the end of every model's ``__init__``) to skip ``initialize_weights()`` when the
  default device is meta, since ``from_pretrained`` loads the weights afterwards. A model built by user code
  would keep PyTorch's default initialization instead of its ``_init_weights``: wrong values, silently.
  When ``init_weights`` asks which device it is on (its first torch call, ``torch.tensor([])``),
  the model's own ``initialize_weights()`` is run, as it would be off meta: the same calls at the same point
  of the random stream, before the weights are tied, recorded like the rest (a model's
  ``initialize_weights`` skips the modules that a nested model's already initialized, as off meta).

Both need to see Python calls. ``InitCallObserver`` sees them with ``sys.setprofile``, the interpreter's hook
for observing calls: nothing of torch or transformers is replaced. A profile function cannot run observed
code itself (profiling is off inside it), so the pending ``initialize_weights()`` runs from the recorder's
``TorchFunctionMode``, at the next torch call; if ``init_weights`` returns first, it is not run late. The
observer is active only while recording. It never displaces another profiler: a trace recorded while one held
the hook is refused at setup. ``uninitialized_library_modules`` names any transformers module left
uninitialized anyway (a later transformers changed its decision), and ``materialize_units`` refuses the model
rather than let it train from wrong values.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from types import CodeType, FrameType
from typing import Any, Protocol

import torch
from torch import nn

# [Note: seeds while recording]
# Random ops on meta draw nothing, so the replay draws them all, from the generator's state when recording began.
# A seed set while recording (``torch.manual_seed(0)`` or ``L.seed_everything`` inside ``configure_model``) would be
# lost, and every value drawn after it would differ from an ordinary construction's: wrong values, silently. The
# observer sees the generator methods that set a state return (``c_return`` events of ``manual_seed``,
# ``set_state``, ``seed``) and records a step that sets the generator to the state it then has; the replay runs it in
# order, like a random op.
_SEEDING = {"manual_seed", "set_state", "seed"}
# Reading the default generator's state while recording cannot work: meta draws do not advance it, so a state saved
# and restored (``torch.random.fork_rng``) would send the replay back to the wrong point. Such a trace is refused.
_ENGINE = str(Path(__file__).resolve().parent)


def _is_default_generator(generator: torch.Generator) -> bool:
    """Whether ``generator`` is its device's default generator (the one random ops use unless given another)."""
    if generator is torch.default_generator:
        return True
    if generator.device.type == "cpu":
        return False
    module = torch.get_device_module(generator.device)
    return any(generator is g for g in getattr(module, "default_generators", ()))


# torch.nn.init functions that fill a tensor with constants: replayed only when their result is needed.
_DETERMINISTIC = {"constant_", "ones_", "zeros_", "eye_", "dirac_"}
_NOT_NEEDED = object()  # transformers < 5 initializes on meta by itself


def _skipped_when_empty(functions: dict[CodeType, Any]) -> set[CodeType]:
    """The ``torch.nn.init`` functions that hand themselves to the torch function modes (``handle_torch_function``),
    which Lightning's ``_EmptyInit`` (``init_module(empty_init=True)``) therefore skips."""
    return {code for code in functions if "handle_torch_function" in code.co_names}


def _init_functions() -> dict[CodeType, Any]:
    functions = {}
    for name in dir(nn.init):
        function = getattr(nn.init, name)
        if name.endswith("_") and not name.startswith("_") and inspect.isfunction(function):
            functions[inspect.unwrap(function).__code__] = function
    return functions


class CallRecorder(Protocol):
    """What the observer records into: an ``InitTrace`` (``init_trace.py``), named here by its shape so that the
    two modules do not import each other."""

    device: torch.device
    calls_observed: bool
    generator_state_read: bool
    empty_init: bool
    suppressed: int
    library_modules: Any  # a WeakSet of modules

    def add_call(self, function: Any, arguments: dict[str, Any], random: bool, isolated: bool = False) -> None: ...

    def add_seed(self, generator: torch.Generator) -> None: ...


class InitCallObserver:
    """While recording, records ``torch.nn.init`` calls on meta tensors whole and runs transformers'
    ``initialize_weights()`` where it skips it (see [Note: init calls on meta]).

    Example::

        with torch.device("meta"), InitCallObserver(trace):
            model = Net()
    """

    def __init__(self, trace: CallRecorder) -> None:
        self.trace = trace
        self.init_functions = _init_functions()
        self.skipped_when_empty = _skipped_when_empty(self.init_functions)
        self._init_weights_code: Any = None
        self._recording: list[FrameType] = []  # frames of the init calls being recorded whole
        self.pending: list[tuple[FrameType, Any]] = []  # (init_weights frame, its model) to initialize
        self._active = False

    def __enter__(self) -> InitCallObserver:
        if sys.getprofile() is None:
            sys.setprofile(self._observe)
            self._active = True
        else:  # a profiler's hook cannot be shared from Python: the trace is incomplete, and refused at setup
            self.trace.calls_observed = False
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        if self._active:
            sys.setprofile(None)
            self._active = False

    def run_pending(self) -> None:
        """``initialize_weights()`` of the transformers models whose ``init_weights`` is running (called by the
        recorder's ``TorchFunctionMode``: not from the profile function, where nothing is observed)."""
        while self.pending:
            _, model = self.pending.pop(0)
            model.initialize_weights()

    def _observe(self, frame: FrameType, event: str, arg: Any) -> None:
        if event in ("c_call", "c_return"):
            owner = getattr(arg, "__self__", None)
            if not isinstance(owner, torch.Generator):
                return
            name = getattr(arg, "__name__", None)
            if event == "c_return" and name in _SEEDING:
                self.trace.add_seed(owner)  # see [Note: seeds while recording]
            elif event == "c_call" and name == "get_state" and not frame.f_code.co_filename.startswith(_ENGINE):
                if owner.device.type == self.trace.device.type and _is_default_generator(owner):
                    self.trace.generator_state_read = True
            return
        if event == "return":
            if self._recording and frame is self._recording[-1]:
                self._recording.pop()
                self.trace.suppressed -= 1
            elif self.pending and frame is self.pending[-1][0]:
                self.pending.pop()  # returned before any torch call: too late to run it in order; refused later
            return
        if event != "call":
            return
        code = frame.f_code
        function = self.init_functions.get(code)
        if function is not None:
            if not self._recording and _is_meta(frame.f_locals.get("tensor")):
                names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
                arguments = {n: frame.f_locals[n] for n in names}
                isolated = self.trace.empty_init and code in self.skipped_when_empty  # see InitStep.isolated
                self.trace.add_call(function, arguments, random=code.co_name not in _DETERMINISTIC, isolated=isolated)
            if self._recording or _is_meta(frame.f_locals.get("tensor")):
                self._recording.append(frame)
                self.trace.suppressed += 1
            return
        if code is self._transformers_init_weights():
            model = frame.f_locals["self"]
            self.pending.append((frame, model))
            self.trace.library_modules.update(model.modules())

    def _transformers_init_weights(self) -> Any:
        if self._init_weights_code is None:
            # Looked up once transformers is imported (perhaps while recording: not while half-imported).
            model_class = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
            if model_class is None:
                return None
            self._init_weights_code = model_class.init_weights.__code__ if _skips_init_on_meta() else _NOT_NEEDED
        return self._init_weights_code


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta


def _skips_init_on_meta() -> bool:
    transformers = sys.modules.get("transformers")
    version = getattr(transformers, "__version__", "0")
    return int(version.split(".")[0]) >= 5


def uninitialized_library_modules(module: nn.Module, library_modules: Any) -> list[str]:
    """Modules of a transformers (>= 5) model inside ``module`` that hold meta tensors and that the library's
    ``initialize_weights`` never reached (see [Note: init calls on meta]). ``library_modules``: the modules the
    models held when their ``init_weights`` ran; modules added later (peft's adapters, a user's head) are
    initialized by their own recorded code and are not the library's to initialize."""
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None or not _skips_init_on_meta():
        return []
    missing: dict[str, None] = {}  # ordered, without repeats (nested models share modules)
    for name, mod in module.named_modules():
        if not isinstance(mod, modeling.PreTrainedModel):
            continue
        for sub_name, sub in mod.named_modules(prefix=name):
            if sub not in library_modules or getattr(sub, "_is_hf_initialized", False):
                continue
            if any(t.is_meta for t in [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]):
                missing[sub_name or type(sub).__name__] = None
    return list(missing)
