"""``ZeROConfig``: every option of both front doors, validated once, at construction, on every rank.

The Trainer's ``ZeROStrategy`` and Fabric's ``ZeROFabricStrategy`` take the same keyword arguments (their names and
errors are the public surface: Lightning CLI and YAML configs pass them as they are) and build one frozen
``ZeROConfig`` from them. A wrong value fails there with a message that says what to pass instead; defaults that
depend on the stage (``meta_init``, ``bucket_size_mb``) are resolved there too, and the engine's own rules (which
stage takes which option, what implies what) are those of the ``EnginePolicy`` it builds (see [Note: one policy] in
``engine/core/policy.py``), so the rest of the code reads settled values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
from torch.nn import Module

from lightning_zero.engine.comm.mesh import ShardSize
from lightning_zero.engine.comm.quantized import Quantization
from lightning_zero.engine.comm.sequence import CollectiveChecks
from lightning_zero.engine.core.policy import Accumulate, EnginePolicy, Offload, check_offload_flag
from lightning_zero.engine.schedule.recompute import check_policy

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
CheckpointFormat = Literal["full", "sharded"]
START_METHODS = ("popen", "spawn", "fork", "forkserver")
CHECKPOINT_FORMATS = ("full", "sharded")
BACKENDS = ("gloo", "nccl", "mpi", "ucc")
NONFINITE_POLICIES = ("raise", "skip", "ignore")
COLLECTIVE_CHECKS = ("auto", "all", "off")
NonFinitePolicy = Literal["raise", "skip", "ignore"]
PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's and Lightning's default_pg_timeout


def validate_options(
    unit_modules: Any,
    process_group_backend: Any,
    timeout: Any,
    checkpoint_format: Any,
    start_method: Any,
    log_stats: Any,
    nonfinite_grads: Any,
    collective_checks: Any,
    meta_init: Any = None,
) -> None:
    if unit_modules is not None:
        if isinstance(unit_modules, (str, type)) or not isinstance(unit_modules, Sequence):
            raise TypeError(
                f"unit_modules must be a list of module classes or class names, got {unit_modules!r}; "
                "for example unit_modules=[Block] or unit_modules=['Block']"
            )
        for entry in unit_modules:
            if not (isinstance(entry, str) or (isinstance(entry, type) and issubclass(entry, Module))):
                raise TypeError(f"unit_modules entries must be nn.Module subclasses or class names, got {entry!r}")
    if meta_init is not None and not isinstance(meta_init, bool):
        raise TypeError(f"meta_init must be True, False or None (the stage's default), got {meta_init!r}")
    if not isinstance(log_stats, bool):
        raise TypeError(f"log_stats must be True or False, got {log_stats!r}")
    if process_group_backend is not None and (
        not isinstance(process_group_backend, str) or not _valid_backend(process_group_backend)
    ):
        raise ValueError(
            f"process_group_backend={process_group_backend!r} is not a torch.distributed backend; use one of "
            f"{BACKENDS} (or a device map such as 'cpu:gloo,cuda:nccl'), or leave it unset"
        )
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, got {checkpoint_format!r}")
    if nonfinite_grads not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite_grads must be one of {NONFINITE_POLICIES}, got {nonfinite_grads!r}")
    if collective_checks not in COLLECTIVE_CHECKS:
        raise ValueError(f"collective_checks must be one of {COLLECTIVE_CHECKS}, got {collective_checks!r}")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")


def _valid_backend(backend: str) -> bool:
    parts = [p.split(":")[-1] for p in backend.split(",")]
    return all(p in BACKENDS for p in parts)


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "16": torch.float16,
}


def parse_dtype(option: str, value: Any) -> torch.dtype | None:
    """``torch.bfloat16`` from ``torch.bfloat16``, ``"bfloat16"``, ``"bf16"`` or ``"torch.bfloat16"`` (YAML configs
    pass strings); ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str) and value.removeprefix("torch.").lower() in DTYPES:
        dtype = DTYPES[value.removeprefix("torch.").lower()]
    else:
        raise ValueError(
            f"{option}={value!r} is not a dtype; use torch.float32, torch.bfloat16 or torch.float16 (or 'float32', "
            "'bfloat16', 'float16')"
        )
    return dtype  # (which dtypes the engine computes in is the policy's rule: EnginePolicy)


def default_bucket_size_mb(stage: int, unit_modules: Any, bucket_size_mb: float | None) -> float | None:
    """``bucket_size_mb`` as the strategies use it: 25 MB by default for stages 1 and 2 where the units are ours to
    choose (``unit_modules`` given means exactly those units), otherwise what was passed."""
    if bucket_size_mb is None and stage < 3 and unit_modules is None:
        return 25.0
    return bucket_size_mb


@dataclass(frozen=True)
class ZeROConfig:
    """The options of one ZeRO strategy, validated and resolved (see the strategies' docstrings for each option's
    meaning). Built by either front door from its constructor's arguments; also usable on its own.

    Example::

        config = ZeROConfig(stage=3, unit_modules=["Block"], offload_params=True)
        config.offload_optimizer  # True: implied by offload_params
        config.meta_init          # True: stage 3's default
    """

    stage: int
    unit_modules: tuple[type[Module] | str, ...] | None = None
    broadcast_buffers: bool = True
    process_group_backend: str | None = None
    timeout: timedelta = DEFAULT_TIMEOUT
    checkpoint_format: CheckpointFormat = "full"
    log_stats: bool = False
    nonfinite_grads: NonFinitePolicy = "raise"
    collective_checks: CollectiveChecks = "auto"
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    offload_optimizer: bool = False
    offload_params: bool = False
    meta_init: bool | None = None
    bucket_size_mb: float | None = None
    prefetch: int = 1
    reshard_after_forward: bool = True
    shard_size: ShardSize = None
    start_method: StartMethod = "popen"
    activation_checkpointing_policy: Any = None
    accumulate: Accumulate | None = None
    async_save: bool = False
    quantize_weights: Quantization | None = None
    quantize_grads: Quantization | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.async_save, bool):
            raise TypeError(f"async_save must be True or False, got {self.async_save!r}")
        check_offload_flag("offload_optimizer", self.offload_optimizer)
        check_offload_flag("offload_params", self.offload_params)
        # The engine's rules (which stage takes which option, what implies what): see [Note: one policy] in
        # engine/core/policy.py.
        policy = EnginePolicy(
            stage=self.stage,
            param_dtype=parse_dtype("param_dtype", self.param_dtype),
            reduce_dtype=parse_dtype("reduce_dtype", self.reduce_dtype),
            offload=Offload.of(self.offload_optimizer, self.offload_params),
            quantize_weights=self.quantize_weights,
            quantize_grads=self.quantize_grads,
            prefetch=self.prefetch,
            reshard_after_forward=self.reshard_after_forward,
            accumulate=self.accumulate,
            bucket_size_mb=default_bucket_size_mb(self.stage, self.unit_modules, self.bucket_size_mb),
            shard_size=self.shard_size,
            broadcast_buffers=self.broadcast_buffers,
        )
        validate_options(
            unit_modules=self.unit_modules,
            process_group_backend=self.process_group_backend,
            timeout=self.timeout,
            checkpoint_format=self.checkpoint_format,
            start_method=self.start_method,
            log_stats=self.log_stats,
            nonfinite_grads=self.nonfinite_grads,
            collective_checks=self.collective_checks,
            meta_init=self.meta_init,
        )
        check_policy(self.activation_checkpointing_policy)
        checkpointing = self.activation_checkpointing_policy
        resolved = {
            "accumulate": policy.accumulate,
            "activation_checkpointing_policy": (
                frozenset(checkpointing) if isinstance(checkpointing, (set, list, tuple)) else checkpointing
            ),
            "unit_modules": None if self.unit_modules is None else tuple(self.unit_modules),
            "param_dtype": policy.param_dtype,
            "reduce_dtype": policy.reduce_dtype,
            "offload_optimizer": policy.offload.optimizer,
            "meta_init": self.stage == 3 if self.meta_init is None else self.meta_init,
            "bucket_size_mb": policy.bucket_size_mb,
        }
        for name, value in resolved.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_policy", policy)

    def engine_policy(self, param_dtype: torch.dtype | None, shard_size: int | None = None) -> EnginePolicy:
        """The engine's policy for a run whose precision computes in ``param_dtype`` (the door resolves it from
        the precision plugin and this config's ``param_dtype``), sharding over ``shard_size`` ranks (resolved from
        this config's ``shard_size`` at the run's topology; ``None``: every rank)."""
        policy: EnginePolicy = self._policy  # type: ignore[attr-defined]
        return policy.replace(param_dtype=param_dtype, shard_size=shard_size)

    def replace(self, **changes: Any) -> ZeROConfig:
        """A copy with ``changes``, validated again."""
        return dataclasses.replace(self, **changes)
