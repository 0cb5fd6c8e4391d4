"""The options both front doors take, declared once: ``ZeROOptions.__init__`` is the constructor of the Trainer's
strategies and of Fabric's alike.

Each door mixes ``ZeROOptions`` in before its Lightning ``ParallelStrategy``; what the constructor does not know
(``accelerator``, ``cluster_environment``, ``precision_plugin`` / ``precision``, ...) goes on to Lightning's own
constructor. The arguments become one validated ``ZeROConfig`` (``strategy.config``) held by the strategy's
``ZeRODriver`` (``strategy.driver``); each option stays readable, and assignable with validation, under its name
(``strategy.checkpoint_format``). A door says what differs for it in class attributes: ``default_checkpoint_format``
and ``unsupported_options`` (Fabric's strategies log nothing themselves, so they take no ``log_stats``).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, ClassVar, get_type_hints

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch.nn import Module

from lightning_zero.driver.checkpointing import check_checkpoint_io
from lightning_zero.driver.config import Accumulate, CheckpointFormat, NonFinitePolicy, StartMethod, ZeROConfig
from lightning_zero.driver.driver import ZeRODriver
from lightning_zero.engine.comm.mesh import ShardSize
from lightning_zero.engine.comm.quantized import Quantization
from lightning_zero.engine.comm.sequence import CollectiveChecks
from lightning_zero.engine.sharded_model import ShardedModel


class Option:
    """A strategy attribute that reads one field of the strategy's ``config``; assigning it replaces the config
    with a validated copy (``strategy.checkpoint_format = "sharded"`` keeps working, and a bad value fails)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj.config, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.config = obj.config.replace(**{self.name: value})


class ListOption(Option):
    """An ``Option`` stored as a tuple in the (frozen) config and read as a new list, as the constructor took it."""

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        value = super().__get__(obj, owner)
        return list(value) if isinstance(value, tuple) else value


def option_names(cls: type) -> list[str]:
    """The keyword arguments ``cls`` takes, in the order of its signature (see [Note: one signature per door])."""
    return [name for name in inspect.signature(cls.__init__).parameters if name != "self"]


# FSDPStrategy's arguments, as scripts written for it pass them (LitGPT's: auto_wrap_policy={Block},
# state_dict_type="full", ...), and what says the same here.
FSDP_EQUIVALENTS = {
    "state_dict_type": "checkpoint_format='full' or 'sharded'",
    "auto_wrap_policy": "unit_modules=[Block] (the default finds the repeated blocks)",
    "cpu_offload": "offload_params=True",
    "sharding_strategy": "ZeRO1Strategy, ZeRO2Strategy or ZeRO3Strategy, and shard_size for hybrid sharding",
    "mixed_precision": "Fabric(precision=...) or param_dtype and reduce_dtype",
    "limit_all_gathers": "prefetch (the number of units gathered ahead; gathers are always limited)",
    "sync_module_states": "nothing: every rank starts from the same values",
}


def check_option_names(cls: type, kwargs: dict[str, Any]) -> None:
    """Refuse keyword arguments ``cls`` does not take, listing the ones it does (a subclass whose constructor takes
    ``**kwargs`` is left to its ``super().__init__``)."""
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values()):
        return
    valid = option_names(cls)
    unknown = [name for name in kwargs if name not in valid]
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, valid, n=1)
        if name in FSDP_EQUIVALENTS:
            hints.append(f"{name!r} (FSDPStrategy's; here: {FSDP_EQUIVALENTS[name]})")
        else:
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise TypeError(f"{cls.__name__} has no option {', '.join(hints)}. Valid options: {', '.join(valid)}.")


# [Note: one signature per door]
# The options are declared once, by ``ZeROOptions.__init__``. A door's constructor is that function under a
# signature made for the door when its class is created (``__init_subclass__``): the options, with the door's
# default ``checkpoint_format`` and without its ``unsupported_options``, then the keyword arguments of the Lightning
# strategy it extends, with their types and defaults. ``inspect.signature``, IDEs, the Lightning CLI and YAML
# configs (jsonargparse reads ``__signature__``) all see exactly what the door takes, and ``check_option_names``
# refuses anything else before ``__init__`` runs, so the shared implementation never sees an option its door
# does not take.


class ZeROOptions:
    """Mixed into both front doors before their Lightning ``ParallelStrategy``: the options, validated at
    construction on every rank (see the module docstring; each option's meaning is in ``ZeROStrategy``'s
    docstring and ``docs/options.md``).

    Example::

        class MyStrategy(ZeROOptions, ProcessTopology, ParallelStrategy):
            stage = 3
            default_checkpoint_format = "full"
    """

    stage: ClassVar[int]
    default_checkpoint_format: ClassVar[CheckpointFormat] = "full"
    unsupported_options: ClassVar[tuple[str, ...]] = ()
    set_up_by: ClassVar[str] = "trainer.fit/validate/..."  # what makes the sharded model, for the error
    driver: ZeRODriver

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in vars(cls) or (not hasattr(cls, "stage") and "default_checkpoint_format" not in vars(cls)):
            return  # a door sets its class attributes; its stages inherit the door's signature

        def __init__(self: ZeROOptions, *args: Any, **kwargs: Any) -> None:
            ZeROOptions.__init__(self, *args, **kwargs)

        __init__.__signature__ = _door_signature(cls)  # type: ignore[attr-defined]
        __init__.__qualname__ = f"{cls.__qualname__}.__init__"
        __init__.__doc__ = f"See ``{cls.__name__}``'s docstring for the arguments."
        cls.__init__ = __init__  # type: ignore[method-assign]

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Before __init__, so that a misspelt option lists the valid ones instead of Python's bare TypeError.
        check_option_names(cls, kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        unit_modules: Sequence[type[Module] | str] | None = None,
        broadcast_buffers: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta = default_pg_timeout,
        checkpoint_format: CheckpointFormat | None = None,
        log_stats: bool = False,
        nonfinite_grads: NonFinitePolicy = "raise",
        collective_checks: CollectiveChecks = "auto",
        param_dtype: torch.dtype | str | None = None,
        reduce_dtype: torch.dtype | str | None = None,
        offload_optimizer: bool = False,
        offload_params: bool = False,
        meta_init: bool | None = None,
        bucket_size_mb: float | None = None,
        prefetch: int = 1,
        reshard_after_forward: bool = True,
        shard_size: ShardSize = None,
        start_method: StartMethod = "popen",
        activation_checkpointing_policy: set[type[Module] | str] | Callable[..., bool] | None = None,
        accumulate: Accumulate | None = None,
        async_save: bool = False,
        quantize_weights: Quantization | None = None,
        quantize_grads: Quantization | None = None,
        **lightning_arguments: Any,
    ) -> None:
        self.driver = ZeRODriver(
            ZeROConfig(
                stage=self.stage,
                unit_modules=unit_modules,
                broadcast_buffers=broadcast_buffers,
                process_group_backend=process_group_backend,
                timeout=timeout,
                checkpoint_format=checkpoint_format or self.default_checkpoint_format,
                log_stats=log_stats,
                nonfinite_grads=nonfinite_grads,
                collective_checks=collective_checks,
                param_dtype=param_dtype,
                reduce_dtype=reduce_dtype,
                offload_optimizer=offload_optimizer,
                offload_params=offload_params,
                meta_init=meta_init,
                bucket_size_mb=bucket_size_mb,
                prefetch=prefetch,
                reshard_after_forward=reshard_after_forward,
                shard_size=shard_size,
                start_method=start_method,
                activation_checkpointing_policy=activation_checkpointing_policy,
                accumulate=accumulate,
                async_save=async_save,
                quantize_weights=quantize_weights,
                quantize_grads=quantize_grads,
            )
        )
        super().__init__(**lightning_arguments)
        if check_checkpoint_io(getattr(self, "_checkpoint_io", None)):  # passed as checkpoint_io=...
            self.config = self.config.replace(async_save=True)
        self._num_nodes = 1
        self.init_door()

    def init_door(self) -> None:
        """The door's own state, set up at the end of construction."""

    @property
    def checkpoint_io(self) -> Any:
        """Lightning's default ``TorchCheckpointIO``, or the ``AsyncCheckpointIO`` that was set: the strategies write
        checkpoints themselves; ``AsyncCheckpointIO`` turns ``async_save`` on, and any other plugin is refused when
        it is set (``Trainer(plugins=[...])``), rather than left unused (see ``check_checkpoint_io``)."""
        return super().checkpoint_io  # type: ignore[misc]

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        if check_checkpoint_io(io):
            self.config = self.config.replace(async_save=True)
        self._checkpoint_io = io

    @property
    def sharded_model(self) -> ShardedModel:
        """The engine that holds the shards of this run's model (after setup)."""
        if self.driver.sharded is None:
            raise RuntimeError(f"{type(self).__name__} has no sharded model yet: call {self.set_up_by} first")
        return self.driver.sharded

    @property
    def config(self) -> ZeROConfig:
        """The validated options (``ZeROConfig``)."""
        return self.driver.config

    @config.setter
    def config(self, config: ZeROConfig) -> None:
        self.driver.config = config

    unit_modules = ListOption()
    broadcast_buffers = Option()
    timeout = Option()
    checkpoint_format = Option()
    log_stats = Option()
    nonfinite_grads = Option()
    collective_checks = Option()
    param_dtype = Option()
    reduce_dtype = Option()
    offload_optimizer = Option()
    offload_params = Option()
    meta_init = Option()
    bucket_size_mb = Option()
    prefetch = Option()
    reshard_after_forward = Option()
    shard_size = Option()
    start_method = Option()
    activation_checkpointing_policy = Option()
    accumulate = Option()
    async_save = Option()
    quantize_weights = Option()
    quantize_grads = Option()


def _door_signature(cls: type) -> inspect.Signature:
    """``ZeROOptions.__init__``'s options as ``cls`` takes them, then its Lightning base's arguments."""
    hints = get_type_hints(ZeROOptions.__init__)
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for name, parameter in inspect.signature(ZeROOptions.__init__).parameters.items():
        if name == "self" or parameter.kind is inspect.Parameter.VAR_KEYWORD or name in cls.unsupported_options:
            continue
        default = cls.default_checkpoint_format if name == "checkpoint_format" else parameter.default
        annotation = CheckpointFormat if name == "checkpoint_format" else hints[name]
        parameters.append(parameter.replace(default=default, annotation=annotation))
    after = cls.__mro__[cls.__mro__.index(ZeROOptions) + 1 :]
    lightning_init = next(base.__init__ for base in after if "__init__" in vars(base))
    lightning_hints = get_type_hints(lightning_init)
    for name, parameter in inspect.signature(lightning_init).parameters.items():
        if name != "self" and parameter.kind is not inspect.Parameter.VAR_KEYWORD:
            annotation = lightning_hints.get(name, parameter.annotation)
            parameters.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=annotation))
    return inspect.Signature(parameters)
