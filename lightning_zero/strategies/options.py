"""Validation of the strategies' options: wrong values fail at construction, on every rank, with a
message that says what to pass instead."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
from torch.nn import Module

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
CheckpointFormat = Literal["full", "sharded"]
START_METHODS = ("popen", "spawn", "fork", "forkserver")
CHECKPOINT_FORMATS = ("full", "sharded")
BACKENDS = ("gloo", "nccl", "mpi", "ucc")
NONFINITE_POLICIES = ("raise", "skip", "ignore")
COLLECTIVE_CHECKS = ("auto", "all", "off")


def check_option_names(cls: type, kwargs: dict[str, Any]) -> None:
    """Refuse keyword arguments ``cls.__init__`` does not take, listing the ones it does."""
    valid = [name for name in inspect.signature(cls.__init__).parameters if name != "self"]
    unknown = [name for name in kwargs if name not in valid]
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, valid, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise TypeError(f"{cls.__name__} has no option {', '.join(hints)}. Valid options: {', '.join(valid)}.")


def validate_options(
    unit_modules: Any,
    broadcast_buffers: Any,
    process_group_backend: Any,
    timeout: Any,
    checkpoint_format: Any,
    start_method: Any,
    log_stats: Any,
    nonfinite_grads: Any,
    collective_checks: Any,
    offload_optimizer: Any = False,
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
    for name, value in (
        ("broadcast_buffers", broadcast_buffers),
        ("log_stats", log_stats),
        ("offload_optimizer", offload_optimizer),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
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
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{option} must be float32, bfloat16 or float16, got {dtype}")
    return dtype


def validate_overlap_options(stage: int, bucket_size_mb: Any, prefetch: Any, reshard_after_forward: Any) -> None:
    """The communication options, each for the stages it applies to."""
    if bucket_size_mb is not None:
        if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)) or bucket_size_mb < 0:
            raise ValueError(f"bucket_size_mb must be a number of megabytes >= 0, got {bucket_size_mb!r}")
        if stage == 3:
            raise ValueError(
                "bucket_size_mb applies to stages 1 and 2; stage 3 gathers parameters per unit, so choose its units "
                "with unit_modules (e.g. unit_modules=['Block'])"
            )
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an integer >= 0 (units gathered ahead), got {prefetch!r}")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be True or False, got {reshard_after_forward!r}")
    if stage < 3 and (prefetch != 1 or not reshard_after_forward):
        raise ValueError(
            f"prefetch and reshard_after_forward apply to stage 3 (stage {stage} never frees parameters); "
            "remove them or use ZeRO3Strategy"
        )


def default_bucket_size_mb(stage: int, unit_modules: Any, bucket_size_mb: float | None) -> float | None:
    """``bucket_size_mb`` as the strategies use it: 25 MB by default for stages 1 and 2 where the units are ours to
    choose (``unit_modules`` given means exactly those units), otherwise what was passed."""
    if bucket_size_mb is None and stage < 3 and unit_modules is None:
        return 25.0
    return bucket_size_mb


def bucket_numel(bucket_size_mb: float | None, module: Module) -> int:
    """The engine's ``bucket_numel`` for ``bucket_size_mb`` megabytes of ``module``'s parameters (0: no buckets)."""
    if not bucket_size_mb:
        return 0
    element = next((p.element_size() for p in module.parameters()), 4)
    return int(bucket_size_mb * 2**20) // element
