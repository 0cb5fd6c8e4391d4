"""Recording how a model built on the ``meta`` device was initialized, so it can be replayed for real.

See [Note: meta init] in ``materialize.py`` for the design; this file only records. Vocabulary:

- a *storage key* identifies one meta storage (a tensor and all its views share it);
- a ``TensorRef`` is one meta tensor as an op saw it: its storage key and its view of that storage
  (dtype, size, stride, offset), frozen at that moment;
- an ``InitStep`` is one aten op that read, wrote or created meta tensors, with ``TensorRef`` in place
  of every meta tensor; or one call of a ``torch.nn.init`` function (see [Note: init calls on meta] in
  ``init_calls.py``); or a constant (``torch.tensor([...])``, whose data never reaches the dispatcher).

Example::

    with record_meta_init() as trace:
        model = Net()                 # on the meta device, every init op recorded
    len(trace.steps), trace.nbytes    # what replaying it will run, and the storages it creates
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_zero.engine.errors import MetaInitError
from lightning_zero.engine.meta.init_calls import InitCallObserver


class _TargetDevice:
    """Stands for the meta device in recorded arguments: the device the model is materialized on."""

    def __repr__(self) -> str:
        return "<target device>"


TARGET_DEVICE = _TargetDevice()


@dataclass(frozen=True)
class TensorRef:
    """One meta tensor as an op saw it (geometry in elements of ``dtype``)."""

    storage: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorRef:
        return TensorRef(
            storage_key(tensor), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()
        )

    def covers(self, nbytes: int) -> bool:
        """Whether this view is every byte of a storage of ``nbytes``, each once (dense, no overlap)."""
        numel = 1
        for n in self.size:
            numel *= n
        if self.offset != 0 or numel * self.dtype.itemsize != nbytes:
            return False
        expected = 1
        for n, s in sorted(((n, s) for n, s in zip(self.size, self.stride) if n != 1), key=lambda p: p[1]):
            if s != expected:
                return False
            expected *= n
        return True


def storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata  # one StorageImpl per tensor and all its views


@dataclass
class InitStep:
    """One recorded op or init call: ``func(*args, **kwargs)`` with ``TensorRef`` for meta tensors,
    ``TARGET_DEVICE`` for the meta device; or a constant (``func`` None) whose ``value`` fills ``outputs[0]``."""

    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[TensorRef | None]  # per leaf of the op's output: the new storage it creates, else None
    writes: list[TensorRef]  # arguments the op writes in place
    reads: list[TensorRef]  # the other meta arguments
    random: bool  # draws from a random generator: replayed even when its result is not needed
    overwrites: bool = False  # writes without reading what it writes (normal_, fill_, copy_, an init call)
    empty: bool = False  # creates memory without values (torch.empty)
    real_inputs: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (tensor, its version then)
    value: torch.Tensor | None = None
    # A ``torch.nn.init`` call that ``init_module(empty_init=True)`` skips (as Lightning's ``_EmptyInit`` does under
    # DDP): replayed only if nothing overwrites what it writes, with the random generators' states put back after
    # it, so the random stream later code draws from is the one DDP's draws from (see [Note: writes after the build
    # block] in ``continued.py``).
    isolated: bool = False

    @property
    def name(self) -> str:
        return "a constant (torch.tensor)" if self.func is None else str(self.func)


@dataclass
class InitTrace:
    """Everything ``record_meta_init`` saw, in order."""

    device: torch.device
    steps: list[InitStep] = field(default_factory=list)
    nbytes: dict[int, int] = field(default_factory=dict)  # storage key -> bytes
    rng_state: torch.Tensor | None = None  # the device's default generator when recording began
    generators: dict[torch.Generator, torch.Tensor] = field(default_factory=dict)  # explicit ones, first seen
    keepalive: dict[int, torch.Tensor] = field(default_factory=dict)  # one tensor per storage: no key is reused
    suppressed: int = 0  # > 0 inside an init call recorded whole: its ops are not recorded
    calls_observed: bool = True  # False: another profiler held sys.setprofile, init calls were not seen
    generator_state_read: bool = False  # the default generator's state was read while recording (init_calls.py)
    # Each meta tensor an op saw, with its version counter after the op: a later in-place write (after the build
    # ended, where it is not recorded) shows as a higher version at setup (``changed_after_recording``).
    versions: dict[int, tuple[weakref.ref, int]] = field(default_factory=dict)
    # Parameters and buffers whose values come from weight files, read a shard at a time at setup instead of
    # replayed (see [Note: reading weights by the slice] in hf/weight_files.py): ``hf/weights.py``'s ``WeightLoad``s.
    weight_loads: list[Any] = field(default_factory=list)
    # The modules of the transformers models whose ``init_weights`` ran while recording: the ones their library
    # initializes. A module added later (peft's LoRA layers) is initialized by its own code, recorded as any other.
    library_modules: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    building: bool = False  # inside the build (meta is the default device), not in its continuation
    # ``fabric.init_module(empty_init=True)``: the ``torch.nn.init`` calls Lightning's ``_EmptyInit`` skips are
    # skipped while building, as DDP's build skips them (see [Note: writes after the build block] in continued.py).
    empty_init: bool = False

    def add_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if self.suppressed:
            return
        leaves = tree_flatten((args, kwargs))[0]
        metas = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_meta]
        out_leaves = tree_flatten(out)[0]
        out_metas = [t for t in out_leaves if isinstance(t, torch.Tensor) and t.is_meta]
        if not metas and not out_metas:
            return
        written = _written_arguments(func, args, kwargs)
        inputs = {storage_key(t) for t in metas}
        outputs = [
            TensorRef.of(t) if isinstance(t, torch.Tensor) and t.is_meta and storage_key(t) not in inputs else None
            for t in out_leaves
        ]
        if not any(w.is_meta for w in written) and not any(outputs):
            return  # a view or a metadata query: later steps see its geometry in their own references
        self._see(leaves + out_metas)
        written_ids = {id(w) for w in written}
        self.steps.append(
            InitStep(
                func=func,
                args=tree_map(_recorded, args),
                kwargs=tree_map(_recorded, kwargs),
                outputs=outputs,
                writes=[TensorRef.of(t) for t in written if t.is_meta],
                reads=[TensorRef.of(t) for t in metas if id(t) not in written_ids],
                random=torch.Tag.nondeterministic_seeded in func.tags,
                overwrites=func.overloadpacket in _OVERWRITES,
                empty=func.overloadpacket in _EMPTY,
                real_inputs=_real_inputs(leaves),
            )
        )

    def add_call(self, function: Any, arguments: dict[str, Any], random: bool, isolated: bool = False) -> None:
        """A ``torch.nn.init`` function called on the meta tensor ``arguments["tensor"]``, recorded whole
        (``isolated``: one that ``empty_init=True`` skips, see ``InitStep.isolated``)."""
        leaves = tree_flatten(arguments)[0]
        self._see(leaves)
        written = TensorRef.of(arguments["tensor"])
        reads = [TensorRef.of(t) for t in leaves if isinstance(t, torch.Tensor) and t.is_meta]
        self.steps.append(
            InitStep(
                func=function,
                args=(),
                kwargs=tree_map(_recorded, arguments),
                outputs=[],
                writes=[written],
                reads=[r for r in reads if r != written],
                random=random and not isolated,
                overwrites=True,
                real_inputs=_real_inputs(leaves),
                isolated=isolated,
            )
        )

    def add_seed(self, generator: torch.Generator) -> None:
        """``generator`` was seeded (``torch.manual_seed``, ``set_rng_state``, ``seed_everything``) while recording:
        the replay sets it to the state it has now, at this point of the steps, so the random values drawn after it
        are those an ordinary construction draws (see [Note: seeds while recording])."""
        state = generator.get_state()
        if generator.device == self.device or (generator.device.type == self.device.type == "cpu"):
            self.steps.append(InitStep(set_generator_state, (TARGET_DEVICE, state), {}, [], [], [], random=True))
        else:
            self.steps.append(InitStep(torch.Generator.set_state, (generator, state), {}, [], [], [], random=True))

    def note_versions(self, leaves: list[Any]) -> None:
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.is_meta:
                self.versions[id(leaf)] = (weakref.ref(leaf), leaf._version)

    def changed_after_recording(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """The names of ``tensors`` (meta parameters and buffers of the model) written in place since the recording
        last saw them: after the build ended, where nothing is recorded."""
        changed = []
        for name, tensor in tensors.items():
            seen = self.versions.get(id(tensor))
            if seen is not None and seen[0]() is tensor and tensor._version != seen[1]:
                changed.append(name)
        return changed

    def end_of_recording(self, written: set[int] | None = None) -> None:
        """The versions as the build leaves them (a write through a view during the build bumps its base's too);
        ``written``: only for the tensors on these storages (the ones recorded steps wrote)."""
        for key, (ref, _) in list(self.versions.items()):
            tensor = ref()
            if tensor is None:
                del self.versions[key]
            elif written is None or storage_key(tensor) in written:
                self.versions[key] = (ref, tensor._version)

    def add_constant(self, meta: torch.Tensor, value: torch.Tensor) -> None:
        self._see([meta])
        self.steps.append(InitStep(None, (), {}, [TensorRef.of(meta)], [], [], random=False, value=value))

    def _see(self, leaves: list[Any]) -> None:
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.is_meta:
                key = storage_key(leaf)
                self.nbytes[key] = leaf.untyped_storage().nbytes()
                self.keepalive.setdefault(key, leaf)
            elif isinstance(leaf, torch.Generator) and leaf not in self.generators:
                self.generators[leaf] = leaf.get_state()


aten = torch.ops.aten
# In-place ops whose result does not depend on the old contents of what they write.
_OVERWRITES = {
    aten.normal_,
    aten.uniform_,
    aten.fill_,
    aten.zero_,
    aten.copy_,
    aten.random_,
    aten.bernoulli_,
    aten.exponential_,
    aten.geometric_,
    aten.log_normal_,
    aten.cauchy_,
}
# Factories whose values are garbage: their output may simply be a unit's memory.
_EMPTY = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided}


def _real_inputs(leaves: list[Any]) -> list[tuple[torch.Tensor, int]]:
    return [(t, t._version) for t in leaves if isinstance(t, torch.Tensor) and not t.is_meta]


def _recorded(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_meta:
        return TensorRef.of(x)
    if isinstance(x, torch.device) and x.type == "meta":
        return TARGET_DEVICE
    return x


def _written_arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    written = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        written.extend(v for v in values if isinstance(v, torch.Tensor))
    return written


class _OpRecorder(TorchDispatchMode):
    def __init__(self, trace: InitTrace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.trace.add_op(func, args, kwargs, out)
        return out


# Their data is copied to the device below the dispatcher: an op recorder never sees the values.
_DATA_CONSTRUCTORS = (torch.tensor, torch.as_tensor, torch.asarray)


class _FunctionRecorder(TorchFunctionMode):
    """Keeps the values of ``torch.tensor(data)`` made on the meta device (a buffer filled from a Python list),
    and runs the initialization ``observer`` found pending (see [Note: init calls on meta] in ``init_calls.py``)."""

    def __init__(self, trace: InitTrace, observer: InitCallObserver) -> None:
        super().__init__()
        self.trace = trace
        self.observer = observer

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.trace.empty_init and getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]  # as Lightning's _EmptyInit (InitStep.isolated)
        if self.observer.pending:
            with self:  # this mode is off while it handles a call: on again for what the initialization calls
                self.observer.run_pending()
        out = func(*args, **kwargs)
        self.trace.note_versions(tree_flatten((args, kwargs))[0])
        if (
            func in _DATA_CONSTRUCTORS
            and isinstance(out, torch.Tensor)
            and out.is_meta
            and not any(isinstance(x, torch.Tensor) for x in tree_flatten((args, kwargs))[0])
        ):
            self.trace.add_constant(out, func(*args, **{**kwargs, "device": "cpu"}))
        return out


def generator_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device).get_rng_state(device)


def set_generator_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device).set_rng_state(state, device)


_PLAIN_FROM_PRETRAINED = "with a meta device context manager"


@contextmanager
def refuse_plain_from_pretrained() -> Iterator[None]:
    """Around a build on meta: transformers' ``from_pretrained`` refuses to run there; say what does instead."""
    try:
        yield
    except RuntimeError as error:
        if "from_pretrained" not in str(error) or _PLAIN_FROM_PRETRAINED not in str(error):
            raise
        raise MetaInitError(
            "transformers' from_pretrained cannot run while the model is built on the meta device (meta_init, the "
            "stage-3 default, in configure_model or fabric.init_module()). Call "
            "lightning_zero.from_pretrained(AutoModelForCausalLM, path, **kwargs) instead: it builds the model there "
            "and each rank reads only its shards of the weights at setup (elsewhere it is the plain call)."
        ) from error


def active_recording(building: bool = True) -> InitTrace | None:
    """The trace of the ``record_meta_init`` in progress on this thread, if any: a model being built on meta
    (``building``), or also one whose build ended and whose recording continues until setup (``building=False``,
    see [Note: writes after the build block] in ``continued.py``)."""
    from torch.overrides import _get_current_function_mode_stack

    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, _FunctionRecorder) and (mode.trace.building or not building):
            return mode.trace
    return None


@contextmanager
def record_meta_init(
    device: torch.device | None = None, trace: InitTrace | None = None, empty_init: bool = False
) -> Iterator[InitTrace]:
    """Build on the meta device and record how the model is initialized, for ``materialize_units`` to replay
    on ``device`` (default: the CPU) one unit at a time (see [Note: meta init] in ``materialize.py``).
    Given the ``trace`` of an earlier recording, record more of the same build into it (a cast at setup).
    ``empty_init``: skip the ``torch.nn.init`` calls that Lightning's ``init_module(empty_init=True)`` skips."""
    if trace is None:
        trace = InitTrace(device=torch.device(device or "cpu"))
        trace.rng_state = generator_state(trace.device)
    observer = InitCallObserver(trace)
    with ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        # Not a no-op here: the copy is recorded and replayed.
        warnings.filterwarnings("ignore", message=r".*copying from a non-meta parameter in the checkpoint to a meta")
        stack.enter_context(torch.device("meta"))
        stack.enter_context(_FunctionRecorder(trace, observer))
        stack.enter_context(_OpRecorder(trace))
        stack.enter_context(observer)
        trace.building, trace.empty_init = True, empty_init
        try:
            yield trace
        finally:
            trace.building = trace.empty_init = False
    trace.end_of_recording()
