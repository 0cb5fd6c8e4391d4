"""What the engine refuses before it shards anything: parameters it cannot shard with DDP's meaning.

Every check runs on every rank alike, on the module as the user built it, before the first parameter
is touched, so a refused model is left as it was and every rank raises the same error.
"""

from __future__ import annotations

import torch
from torch import nn


def check_unit_params(name: str, params: list[nn.Parameter], names: list[str]) -> None:
    """One unit's parameters can share one flat buffer: real floating point, one dtype, one device."""
    if not params:
        raise ValueError(f"unit {name!r} has no parameters")
    for param, pname in zip(params, names):
        if param.is_complex():
            raise ValueError(
                f"parameter {pname!r} in unit {name!r} is complex ({param.dtype}); ZeRO shards real floating-point "
                "parameters only. Store it as a real parameter with a trailing dimension of 2 "
                "(nn.Parameter(torch.view_as_real(value))) and use torch.view_as_complex(self.param) in forward: "
                "the optimizer then steps the same numbers."
            )
        if not param.is_floating_point():
            raise ValueError(
                f"parameter {pname!r} in unit {name!r} has dtype {param.dtype}; ZeRO shards floating-point "
                "parameters only. Register integer tensors as buffers (module.register_buffer) instead."
            )
        other_device = param.device != params[0].device and not (param.is_meta or params[0].is_meta)
        if param.dtype != params[0].dtype or other_device:
            raise ValueError(
                f"unit {name!r} mixes dtypes/devices: {names[0]!r} is {params[0].dtype} on {params[0].device}, "
                f"{pname!r} is {param.dtype} on {param.device}. Put them in separate units (unit_modules=...) "
                "or cast the module to one dtype and device before training."
            )


def _byte_span(param: torch.Tensor) -> tuple[int, int]:
    """The bytes a tensor's elements occupy, as ``[start, end)`` addresses."""
    last = sum((size - 1) * abs(stride) for size, stride in zip(param.shape, param.stride()))
    start = param.data_ptr()
    return start, start + (last + 1) * param.element_size()


def check_no_shared_memory(module: nn.Module) -> None:
    """No two parameters overlap in memory (one a view of the other's storage, as ``nn.Parameter(w.data[:8])``
    makes): under DDP a step on one changes the other, and sharding each into its own storage would break that
    silently. The same parameter under several names (tied weights) is one parameter and is fine."""
    spans: list[tuple[int, int, int, str]] = []  # start, end, position in the module, name
    for name, param in module.named_parameters():  # each parameter once, tied names under the first
        if not param.is_meta and param.numel():
            start, end = _byte_span(param)
            spans.append((start, end, len(spans), name))
    spans.sort()
    furthest: tuple[int, int, str] | None = None  # the furthest end so far, and whose it is
    for start, end, position, name in spans:
        if furthest is not None and start < furthest[0]:
            first, second = sorted([(furthest[1], furthest[2]), (position, name)])
            raise ValueError(
                f"parameters {first[1]!r} and {second[1]!r} share memory (one is a view of the other's storage): under "
                "DDP an optimizer step on one also changes the other, and ZeRO, which keeps each parameter's shard in "
                "storage of its own, cannot keep that. Make them one parameter and take the view in forward (e.g. "
                "a property returning self.weight[:8]), or give each its own storage "
                "(nn.Parameter(tensor.detach().clone())) if they are meant to train apart."
            )
        if furthest is None or end > furthest[0]:
            furthest = (end, position, name)


def check_no_sparse_gradients(module: nn.Module) -> None:
    """No embedding produces sparse gradients, which cannot be reduce-scattered into flat shards."""
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            raise ValueError(
                f"{name or type(module).__name__!r} is a {type(sub).__name__} with sparse=True, whose gradients are "
                "sparse tensors; ZeRO reduce-scatters dense gradients into flat shards. Build it with sparse=False "
                "(the default; dense Adam or SGD then step it), or train it with DDPStrategy."
            )
