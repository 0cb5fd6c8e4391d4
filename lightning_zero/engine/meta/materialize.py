"""Big-model init: a model built on the ``meta`` device becomes real one unit at a time, already sharded.

[Note: meta init]
A module built on the ``meta`` device has shapes but no memory. Its initialization, though, is code the
module's authors wrote anywhere: ``reset_parameters()``, loops in ``__init__`` (``for m in self.modules():
nn.init...``), ``post_init()``-style ``_init_weights``, buffers computed in ``__init__`` (rotary ``cos``/``sin``,
causal masks), an ``apply(init_fn)`` or a ``load_state_dict`` after construction. Rather than ask every
library to follow one convention, ``record_meta_init`` (``init_trace.py``) watches the build with a
``TorchDispatchMode`` and records, in order, every aten op that creates, writes or reads a meta tensor (and
the values of ``torch.tensor(data)``, which never reach the dispatcher; and ``torch.nn.init`` calls whole,
see [Note: init calls on meta] in ``init_calls.py``). That list is the initialization, as the library wrote
it; nothing is patched. ``materialize_units`` replays it on real memory (``init_plan.py`` decides what runs).

Replaying it whole would rebuild the full model. The replay knows better, from the list alone:

- *Versions.* An op that writes every byte of a storage without reading it (``normal_``, ``uniform_``,
  ``fill_``, ``zero_``, ``copy_`` from elsewhere) starts a new *version* of it. A parameter is the version
  that is current at the end; earlier ones (the ``kaiming_uniform_`` of ``nn.Linear.__init__`` that
  ``_init_weights`` overwrites later) are not needed.
- *Liveness.* Walking backwards from the final versions of all parameters and buffers, an op runs only if
  it writes a version that is needed, and then what it reads is needed too. Every op that draws random
  numbers runs anyway, in its recorded order, on scratch memory if its result is not needed: the random
  stream then advances exactly as in an ordinary construction, so every value equals one made with the same
  seed (the device's generator is set back to its state when recording began).
- *Lifetimes.* Each version has memory only from the first to the last op that runs on it. A parameter's
  final version is written straight into its unit's flat buffer (``[Note: unit memory]`` in ``unit.py``);
  the unit is handed to ``on_ready`` (which shards it and frees the full buffer) right after the last op
  that touches any of its parameters. Memory therefore peaks at the shards, the units whose parameters are
  being initialized (one, for libraries that initialize module by module or that overwrite everything at
  the end) and one scratch tensor, never the full model.

A parameter tied across modules (``lm_head.weight = wte.weight``) is one storage: the value of the owner
that wrote it last, as in an ordinary construction; the other module's own weight is not needed, but its
random draws are still made. Buffers (persistent or not) keep their final version in ordinary memory.

What cannot be replayed is refused at setup, on every rank, naming the tensors (``MetaInitError``): a meta
tensor that existed before recording began (or was made by code that bypasses the dispatcher), or a real
tensor read while recording and modified in place before setup. Code that *behaves differently* on meta
(transformers 5 skips its ``_init_weights``) is the subject of [Note: init calls on meta]. Limits: random
draws made on real tensors inside ``configure_model`` are not interleaved with the replayed ones; code that
reads values (``.item()``, ``.tolist()``) fails at build time (a meta tensor has no values); code that
reads every parameter after building (``model.half()``) keeps them all alive until then.

[Note: parameter identity under meta init]
A meta parameter cannot be pointed at real memory (``param.data = real`` refuses a tensor of another
device type), yet code may hold it: under Fabric, ``optimizer = AdamW(model.parameters())`` between
``fabric.init_module()`` and ``fabric.setup`` is common. So each parameter is made real in place with
``torch.utils.swap_tensors``: the Python object stays, with the new tensor (a view of its unit's flat
buffer) inside it, and every reference to it (optimizers, tied modules) sees the real parameter. Where
a swap is refused (a weak reference to the parameter, as ``nn.LSTM`` keeps), a new parameter replaces it
in its modules instead (an optimizer built over the old one before setup is refused when it is bound).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_zero.engine.core.grouping import UnitPlan
from lightning_zero.engine.core.layout import ShardLayout
from lightning_zero.engine.meta.init_calls import uninitialized_library_modules
from lightning_zero.engine.meta.init_plan import Version, plan_replay
from lightning_zero.engine.meta.init_trace import (
    TARGET_DEVICE,
    InitStep,
    InitTrace,
    MetaInitError,
    TensorRef,
    generator_state,
    set_generator_state,
    storage_key,
)


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` lives on the ``meta`` device."""
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


@dataclass
class _Memory:
    """Real memory for one version: a byte view of a storage and where the version starts in it."""

    bytes: torch.Tensor  # uint8, the whole storage from offset 0
    byte_offset: int = 0

    def view(self, ref: TensorRef) -> torch.Tensor:
        itemsize = ref.dtype.itemsize
        typed = self.bytes.view(ref.dtype)
        return torch.as_strided(typed, ref.size, ref.stride, self.byte_offset // itemsize + ref.offset)


def _without_drawing(device: torch.device, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)`` with the random generators it may draw from put back afterwards: the device's
    default one and any it is given (see ``InitStep.isolated``)."""
    generator = kwargs.get("generator")
    saved = generator_state(device), (generator.get_state() if isinstance(generator, torch.Generator) else None)
    try:
        return func(*args, **kwargs)
    finally:
        set_generator_state(device, saved[0])
        if saved[1] is not None:
            generator.set_state(saved[1])


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


@dataclass
class _ParamTarget:
    plan: int
    index: int  # in plan.params
    ref: TensorRef  # the parameter's view of its storage


def materialize_units(
    module: nn.Module,
    plans: list[UnitPlan],
    device: torch.device,
    world_size: int,
    on_ready: Callable[[int, torch.Tensor | None], None],
    trace: InitTrace | None,
) -> None:
    """Initialize ``module``'s meta parameters and buffers unit by unit (see [Note: meta init]).

    ``on_ready(i, full)`` is called once per plan, in an order that is the same on every rank, with the plan's
    full flat buffer (laid out as ``ShardLayout`` says; ``plans[i].params`` are views of it) or ``None`` for a
    plan that had no meta parameters.

    Example::

        with record_meta_init() as trace:
            model = Net()
        plans = plan_units(model)
        materialize_units(model, plans, torch.device("cpu"), 1, lambda i, full: print(plans[i].name), trace)
    """
    if trace is None:
        raise MetaInitError(
            f"{type(module).__name__} holds tensors on the meta device that were not built under "
            "record_meta_init(), so nothing says how to initialize them. Build the layers in configure_model "
            "under meta_init (the stage-3 default) or under lightning_zero.engine.record_meta_init(), or on a "
            "real device."
        )
    if not trace.calls_observed:
        raise MetaInitError(
            "Another profiler held sys.setprofile while configure_model built the model under meta_init (the stage-3 "
            "default), so the torch.nn.init and transformers initialization it runs could not be recorded (see "
            "[Note: init calls on meta] in lightning_zero/engine/meta/init_calls.py). Start the profiler after setup, "
            "or pass meta_init=False."
        )
    metas = {
        name: t for name, t in [*module.named_parameters(), *module.named_buffers()] if t is not None and t.is_meta
    }
    changed = trace.changed_after_recording(metas)
    if changed:
        raise MetaInitError(
            f"{len(changed)} tensor(s) built on the meta device were written in place by code the meta-init recording "
            f"cannot see (not a torch operation): {', '.join(changed[:8])}. On the meta device such a write does "
            "nothing, so the model would start from other values than that code gives. Write them with torch "
            "operations (tensor.copy_(...), torch.nn.init), or pass meta_init=False."
        )
    trace.versions.clear()  # its weak references would keep the parameters from keeping their identity
    if trace.generator_state_read:
        raise MetaInitError(
            "configure_model read the random generator's state (torch.get_rng_state, torch.random.fork_rng) while the "
            "model was built on the meta device (meta_init, the stage-3 default). Random values are not drawn there, "
            "so that state is not the one an ordinary construction sees, and values drawn after restoring it would "
            "differ. Seed with torch.manual_seed(...) instead of saving and restoring the state, build the model in "
            "__init__, or pass meta_init=False."
        )
    missing = uninitialized_library_modules(module, trace.library_modules)
    if missing:
        raise MetaInitError(
            f"transformers skips its weight initialization (_init_weights) on the meta device, and it did not "
            f"run for {len(missing)} module(s) built under meta_init (the stage-3 default): {', '.join(missing[:8])}"
            ". Their values would be PyTorch's defaults, not the model's. lightning_zero runs it in the library's "
            "place unless another profiler holds sys.setprofile while configure_model runs; otherwise build the "
            "model in __init__, or pass meta_init=False, or load pretrained weights after setup "
            "(self.load_state_dict(...) in on_fit_start streams them into the shards)."
        )
    _Replay(module, plans, device, world_size, on_ready, trace).run()


class _Replay:
    """Runs a ``ReplayPlan``: memory per version, units opened and handed on (see [Note: meta init])."""

    def __init__(
        self,
        module: nn.Module,
        plans: list[UnitPlan],
        device: torch.device,
        world_size: int,
        on_ready: Callable[[int, torch.Tensor | None], None],
        trace: InitTrace,
    ) -> None:
        self.plans, self.device, self.world_size, self.on_ready, self.trace = plans, device, world_size, on_ready, trace
        self.params: dict[int, list[_ParamTarget]] = {}  # storage key -> the parameters on it
        names: dict[int, str] = {}
        for i, plan in enumerate(plans):
            for j, (param, name) in enumerate(zip(plan.params, plan.param_names)):
                if param.is_meta:
                    self.params.setdefault(storage_key(param), []).append(_ParamTarget(i, j, TensorRef.of(param)))
                    names.setdefault(storage_key(param), name)
        self.holders: dict[int, list[tuple[nn.Module, str]]] = {}
        self.buffers: list[tuple[nn.Module, str, TensorRef]] = []
        for mod_name, mod in module.named_modules():
            for name, param in mod._parameters.items():
                if param is not None:
                    self.holders.setdefault(id(param), []).append((mod, name))
            for name, buf in mod._buffers.items():
                if buf is not None and buf.is_meta:
                    self.buffers.append((mod, name, TensorRef.of(buf)))
                    names.setdefault(storage_key(buf), f"{mod_name}.{name}" if mod_name else name)
        self.kept = {ref.storage for _, _, ref in self.buffers}  # final versions that stay: the buffers'
        self.plan = plan_replay(trace, set(self.params) | self.kept)
        unknown_keys = {key for key, _ in self.plan.unknown}
        unknown = [name for key, name in names.items() if key in unknown_keys]
        unknown += ["a tensor they were computed from"] * len(unknown_keys - set(names))
        if unknown:
            raise MetaInitError(
                f"{len(unknown)} tensor(s) were on the meta device before meta_init began recording, or were made "
                f"by code that bypasses the dispatcher, so their values are unknown: {', '.join(unknown[:8])}. "
                "Create them inside configure_model or the init_module block (not in __init__ under "
                "torch.device('meta')), or pass meta_init=False."
            )
        self.bound = {
            key
            for key, targets in self.params.items()
            if len(targets) == 1
            and key not in self.kept
            and targets[0].ref.covers(trace.nbytes[key])
            and targets[0].ref.dtype == plans[targets[0].plan].params[0].dtype
        }
        self.offsets = [ShardLayout.from_shapes([p.shape for p in plan.params], world_size).offsets for plan in plans]
        self.memory: dict[Version, _Memory] = {}
        self.flats: dict[int, torch.Tensor] = {}
        self.closing: dict[int, list[int]] = {}
        for i, plan in enumerate(plans):
            keys = {storage_key(p) for p in plan.params if p.is_meta}
            if keys:
                end = max(self.plan.last[(key, self.plan.final[key])] for key in keys)
                self.closing.setdefault(end, []).append(i)

    def run(self) -> None:
        for i in range(len(self.plans)):
            if not any(p.is_meta for p in self.plans[i].params):
                self.on_ready(i, None)
        if self.trace.rng_state is not None and self.trace.device.type == self.device.type:
            set_generator_state(self.device, self.trace.rng_state)
        for generator, state in self.trace.generators.items():
            generator.set_state(state)
        with torch.no_grad():
            for i, step in enumerate(self.trace.steps):
                if self.plan.execute[i]:
                    self._run(i, step)
        for mod, name, ref in self.buffers:
            mod._buffers[name] = self.memory[(ref.storage, self.plan.final[ref.storage])].view(ref)

    # ------------------------------------------------------------------ one step
    def _run(self, i: int, step: InitStep) -> None:
        versions = self.plan.steps[i]
        created = set(versions.created)
        for version in versions.touched.items():
            if self.plan.first[version] == i and version not in self.memory:
                if self._is_bound(version):
                    self.memory[version] = self._region(version[0])
                elif version not in created:
                    nbytes = self.trace.nbytes[version[0]]
                    self.memory[version] = _Memory(torch.empty(nbytes, dtype=torch.uint8, device=self.device))
        for tensor, recorded in step.real_inputs:
            if tensor._version != recorded:
                raise MetaInitError(
                    f"A real tensor of shape {tuple(tensor.shape)} that configure_model used to initialize the model "
                    f"({step.name}) was modified in place afterwards, so the recorded initialization no longer holds. "
                    "Leave tensors used to initialize the model unchanged until setup, or pass meta_init=False."
                )
        skip = step.empty and bool(created) and all(map(self._is_bound, created))
        if not skip:
            touched = versions.touched
            args, kwargs = tree_map(lambda x: self._resolve(x, touched), (step.args, step.kwargs))
            if step.func is None:
                out = step.value
            elif step.isolated:
                out = _without_drawing(self.device, step.func, args, kwargs)
            else:
                out = step.func(*args, **kwargs)
            for leaf, ref in zip(tree_flatten(out)[0], step.outputs):
                if ref is not None:
                    self._adopt(ref, leaf)
        for version in versions.touched.items():
            if self.plan.last[version] == i:
                self._finish(version)
        for index in self.closing.get(i, []):
            self.on_ready(index, self._flat(index))
            del self.flats[index]

    def _resolve(self, x: object, touched: dict[int, int]) -> object:
        if isinstance(x, TensorRef):
            return self.memory[(x.storage, touched[x.storage])].view(x)
        if x is TARGET_DEVICE:
            return self.device
        return x

    def _adopt(self, ref: TensorRef, result: torch.Tensor) -> None:
        """The memory of a version an op just created: its own output's storage when the layout matches."""
        version = (ref.storage, 0)
        if version in self.memory:  # a unit's memory
            self.memory[version].view(ref).copy_(result)
            return
        nbytes = self.trace.nbytes[ref.storage]
        layout = (result.dtype, tuple(result.shape), tuple(result.stride()), result.storage_offset())
        if result.untyped_storage().nbytes() == nbytes and layout == (ref.dtype, ref.size, ref.stride, ref.offset):
            self.memory[version] = _Memory(_bytes_of(result))
        else:
            self.memory[version] = _Memory(torch.empty(nbytes, dtype=torch.uint8, device=self.device))
            self.memory[version].view(ref).copy_(result)

    def _finish(self, version: Version) -> None:
        """After the last op on ``version``: a parameter's values into its unit (unless already there)."""
        key, number = version
        final = number == self.plan.final.get(key)
        if final and key in self.params and key not in self.bound:
            for target in self.params[key]:
                self._param_view(target).copy_(self.memory[version].view(target.ref))
        if not (final and key in self.kept):
            self.memory.pop(version, None)

    # ------------------------------------------------------------------ units
    def _is_bound(self, version: Version) -> bool:
        return version[0] in self.bound and version[1] == self.plan.final[version[0]]

    def _region(self, key: int) -> _Memory:
        target = self.params[key][0]
        flat = self._flat(target.plan)
        return _Memory(flat.view(torch.uint8), self.offsets[target.plan][target.index] * flat.element_size())

    def _param_view(self, target: _ParamTarget) -> torch.Tensor:
        flat = self._flat(target.plan)
        offset = self.offsets[target.plan][target.index]
        return flat[offset : offset + _numel(target.ref.size)].view(target.ref.size)

    def _flat(self, index: int) -> torch.Tensor:
        if index not in self.flats:
            self.flats[index] = _allocate(self.plans[index], self.device, self.world_size, self.holders)
        return self.flats[index]


def _numel(size: tuple[int, ...]) -> int:
    numel = 1
    for n in size:
        numel *= n
    return numel


def _allocate(
    plan: UnitPlan, device: torch.device, world_size: int, holders: dict[int, list[tuple[nn.Module, str]]]
) -> torch.Tensor:
    """The plan's full flat buffer; its parameters (meta or not) are replaced by views of it everywhere."""
    layout = ShardLayout.from_shapes([p.shape for p in plan.params], world_size)
    full = torch.zeros(layout.padded_numel, dtype=plan.params[0].dtype, device=device)
    for j, (param, offset, numel) in enumerate(zip(plan.params, layout.offsets, layout.numels)):
        view = full[offset : offset + numel].view(param.shape)
        if not param.is_meta:
            view.copy_(param.detach())
        # A fresh parameter pointed at the view with .data: created from the view itself it would share the
        # buffer's version counter, and every later all-gather would invalidate tensors saved for backward.
        real = nn.Parameter(torch.empty(0, dtype=full.dtype, device=device), requires_grad=param.requires_grad)
        real.data = view
        try:
            # The same Python object, now real: an optimizer built over the meta parameters (Fabric, before
            # setup) and any other reference keep working ([Note: parameter identity under meta init]).
            torch.utils.swap_tensors(param, real)
        except RuntimeError:  # a weak reference to it, or another owner of its TensorImpl: replace it instead
            for mod, name in holders[id(param)]:
                setattr(mod, name, real)  # not _parameters[name]: a module may track its parameters (nn.LSTM)
            plan.params[j] = real
    return full
