"""``EnginePolicy``: what the engine does with a model, as one frozen, validated value.

[Note: one policy]
Every option that changes how the engine shards, moves or communicates state lives in ``EnginePolicy``, and every
rule that relates options (a stage that cannot apply one, one that implies another, a default that depends on the
stage) is checked or resolved once, in its ``__post_init__``: a wrong combination fails there, on every rank
alike, before any process group is touched. The strategies' ``ZeROConfig`` builds one from the user's arguments;
``ShardedModel`` and ``ShardedUnit`` take it and read settled values (``offload.optimizer`` is ``True`` when the
parameters are offloaded, ``accumulate`` is ``"local"`` under stage 1). Adding an option means adding a field here
(with its rule), the argument that fills it, and the code that acts on it.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lightning_zero.engine.comm.mesh import ShardSize, check_shard_size
from lightning_zero.engine.comm.quantized import Quantization, check_quantization

Accumulate = Literal["sharded", "local"]
STAGES = (1, 2, 3)
HALF_DTYPES = (torch.float16, torch.bfloat16)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Offload(enum.Enum):
    """Which state lives in host memory: nothing, the optimizer's (master shards, sharded gradients, optimizer
    states), or the parameter shards too (stage 3; see [Note: parameter offload] in ``compute_shard.py``)."""

    NONE = "none"
    OPTIMIZER = "optimizer"
    PARAMS = "params"

    @classmethod
    def of(cls, optimizer: bool, params: bool) -> Offload:
        """The offload the two public flags ask for: parameters on the host imply the optimizer there too, as
        FSDP2's ``CPUOffloadPolicy`` does (a device-side master would outweigh the compute shard it feeds)."""
        return cls.PARAMS if params else cls.OPTIMIZER if optimizer else cls.NONE

    @property
    def optimizer(self) -> bool:
        """Master shards, sharded gradients and optimizer states in host memory, the step on the CPU."""
        return self is not Offload.NONE

    @property
    def params(self) -> bool:
        """The parameter shards in host memory as well."""
        return self is Offload.PARAMS


@dataclass(frozen=True)
class EnginePolicy:
    """How ``ShardedModel`` shards one model (see [Note: one policy]).

    - ``stage``: 1 (optimizer states), 2 (and gradients) or 3 (and parameters).
    - ``param_dtype`` / ``reduce_dtype``: the compute dtype of gathered parameters and the dtype gradients are
      reduced in (``None``: the module's own; half-precision parameters reduce in fp32 unless told otherwise).
    - ``offload``: an ``Offload`` (``Offload.of(offload_optimizer, offload_params)``).
    - ``quantize_weights`` (stage 3) / ``quantize_grads`` (stages 2 and 3): ``"int8"`` collectives.
    - ``prefetch``, ``reshard_after_forward``: stage 3's schedule (see [Note: prefetch] in ``stage3.py``).
    - ``accumulate``: ``"sharded"`` or ``"local"`` (see [Note: local accumulation] in ``grads.py``); ``None`` is the
      stage's default, and stage 1 is always ``"local"``.
    - ``bucket_size_mb``: stages 1 and 2 merge small units into buckets of this many megabytes (``None``: no buckets).
    - ``shard_size``: hybrid sharding (see [Note: hybrid sharding] in ``mesh.py``).
    - ``broadcast_buffers``: rank 0's buffers before each forward, on DDP's schedule.

    Example::

        policy = EnginePolicy(stage=3, param_dtype=torch.bfloat16, offload=Offload.PARAMS)
        policy.offload.optimizer   # True: the parameters' offload implies the optimizer's
        policy.accumulate          # "sharded": stage 3's default
        EnginePolicy(stage=2, offload=Offload.PARAMS)  # ValueError: offload_params=True needs stage 3: ...
    """

    stage: int
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    offload: Offload = Offload.NONE
    quantize_weights: Quantization | None = None
    quantize_grads: Quantization | None = None
    prefetch: int = 1
    reshard_after_forward: bool = True
    accumulate: Accumulate | None = None
    bucket_size_mb: float | None = None
    shard_size: ShardSize = None
    broadcast_buffers: bool = True

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"stage must be 1, 2 or 3, got {self.stage!r}")
        for name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and dtype not in DTYPES:
                raise ValueError(f"{name} must be float32, bfloat16 or float16, got {dtype}")
        if not isinstance(self.offload, Offload):
            raise TypeError(f"offload must be an Offload (e.g. Offload.of(True, False)), got {self.offload!r}")
        if self.offload.params and self.stage != 3:
            raise ValueError(
                f"offload_params=True needs stage 3: stage {self.stage} keeps the full parameters on every device for "
                "its forward and backward, so there is no parameter shard to offload. Use offload_optimizer=True to "
                "move the master shards, gradients and optimizer states to the CPU, or stage 3 (ZeRO3Strategy) to "
                "offload the parameters as well."
            )
        _check_quantize(self.stage, self.quantize_weights, self.quantize_grads)
        _check_schedule(self.stage, self.bucket_size_mb, self.prefetch, self.reshard_after_forward)
        if not isinstance(self.broadcast_buffers, bool):
            raise TypeError(f"broadcast_buffers must be True or False, got {self.broadcast_buffers!r}")
        check_shard_size(self.shard_size)
        object.__setattr__(self, "accumulate", _resolve_accumulate(self.stage, self.accumulate))

    @property
    def frees_parameters(self) -> bool:
        """Whether units are gathered for use and freed after it (stage 3), rather than kept whole."""
        return self.stage == 3

    def replace(self, **changes: Any) -> EnginePolicy:
        """A copy with ``changes``, validated again."""
        return dataclasses.replace(self, **changes)

    def bucket_numel(self, element_size: int) -> int:
        """Elements per bucket for parameters of ``element_size`` bytes (0: no buckets)."""
        if not self.bucket_size_mb:
            return 0
        return int(self.bucket_size_mb * 2**20) // element_size


def check_offload_flag(name: str, value: object) -> None:
    """Refuse an offload flag (``offload_optimizer``, ``offload_params``) that is not a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _check_quantize(stage: int, quantize_weights: object, quantize_grads: object) -> None:
    """Refuse a quantization the stage cannot apply, saying which stage can (see [Note: quantized collectives] in
    ``comm/quantized.py``)."""
    check_quantization("quantize_weights", quantize_weights)
    check_quantization("quantize_grads", quantize_grads)
    if quantize_weights is not None and stage != 3:
        raise ValueError(
            f"quantize_weights={quantize_weights!r} needs stage 3: stage {stage} gathers the parameters once after "
            "each optimizer step and keeps them, exactly, so no gather moves weights for compute. Use "
            "ZeRO3Strategy, or quantize_grads for the reduce-scatter of stage 2."
        )
    if quantize_grads is not None and stage == 1:
        raise ValueError(
            f"quantize_grads={quantize_grads!r} needs stage 2 or 3 (the gradients' reduce-scatter from backward); "
            "stage 1 reduces once per step, exactly. Use ZeRO2Strategy or ZeRO3Strategy."
        )


def _check_schedule(stage: int, bucket_size_mb: object, prefetch: object, reshard_after_forward: object) -> None:
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


def _resolve_accumulate(stage: int, accumulate: object) -> Accumulate:
    """``accumulate`` as the engine uses it: stage 1 always adds up full gradients locally (``"local"``); stages 2
    and 3 reduce-scatter every micro-batch unless told ``"local"`` (see [Note: local accumulation] in
    ``engine/schedule/grads.py``)."""
    if accumulate is not None and accumulate not in ("sharded", "local"):
        raise ValueError(f"accumulate must be 'sharded' or 'local' (or None: the stage's default), got {accumulate!r}")
    if stage == 1:
        if accumulate == "sharded":
            raise ValueError(
                "stage 1 keeps full gradients and reduce-scatters them once per optimizer step (what "
                "accumulate='local' means); accumulate='sharded' needs ZeRO2Strategy or ZeRO3Strategy"
            )
        return "local"
    return accumulate or "sharded"
