"""Model-state memory in theory: the ZeRO paper's table (see ``docs/stages.md``, "Memory (fp32, Adam)").

``Ψ`` parameters, ``N`` ranks, ``K`` bytes of optimizer state per parameter (8 for fp32 Adam:
two moments). Persistent bytes per rank:

========  ============  ==========  ==============
 stage     parameters    gradients   optimizer
========  ============  ==========  ==============
 DDP       4Ψ            4Ψ          KΨ
 1         4Ψ            4Ψ          KΨ/N
 2         4Ψ            4Ψ/N        KΨ/N
 3         4Ψ/N          4Ψ/N        KΨ/N
========  ============  ==========  ==============
"""

from __future__ import annotations

from typing import NamedTuple


class ModelStateBytes(NamedTuple):
    """Bytes per rank of parameters, gradients and optimizer states."""

    params: float
    grads: float
    optimizer_states: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer_states


def theory_bytes(
    stage: int | None,
    numel: int,
    world_size: int,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    optimizer_bytes: int = 8,
) -> ModelStateBytes:
    """Persistent model-state bytes per rank for ZeRO ``stage`` (``None`` = DDP), without padding.

    Example::

        >>> theory_bytes(3, 7_000_000_000, 8).total / 1e9    # 7B params, fp32 Adam, 8 GPUs
        14.0
        >>> round(theory_bytes(1, 7_000_000_000, 8).total / 1e9, 1)
        63.0
    """
    if stage not in (None, 1, 2, 3):
        raise ValueError(f"stage must be None (DDP), 1, 2 or 3, got {stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    shard = numel / world_size
    params = numel * param_bytes if stage in (None, 1, 2) else shard * param_bytes
    grads = numel * grad_bytes if stage in (None, 1) else shard * grad_bytes
    states = numel * optimizer_bytes if stage is None else shard * optimizer_bytes
    return ModelStateBytes(params, grads, states)


def theory_comm_bytes(stage: int | None, numel: int, world_size: int, element_bytes: int = 4) -> float:
    """Bytes each rank sends per optimizer step (ring collectives): ``2Ψ`` for DDP and stages 1 and 2,
    ``3Ψ`` for stage 3, times ``(N - 1) / N`` and the element size."""
    factor = 3 if stage == 3 else 2
    return factor * numel * element_bytes * (world_size - 1) / world_size
