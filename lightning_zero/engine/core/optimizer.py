"""The user's own optimizer, stepping this rank's shards.

The optimizer keeps the module's own parameters in its ``param_groups`` and its ``state`` (so
Lightning's fine-tuning callbacks, ``toggle_optimizer`` and anything that maps optimizer
parameters to names keep working); during each step the parameters *are* their master pieces
(``ShardedModel.on_shards``, see [Note: parameters outside their unit's use] in ``unit.py``), so
the per-parameter state it creates is this rank's slice. ``bind_optimizer`` slices any state the
optimizer already holds. Everything else stays as the user made it: the class, the param groups
and their hyper-parameters (so LR schedulers work), and a per-parameter ``state_dict()``.

This is exact only for optimizers whose update of an element depends on that element alone
(SGD, Adam, AdamW, RMSprop, Adagrad, ...). ``check_elementwise`` refuses the ones known not to
be, and probes any other class by stepping it once on a whole tensor and once on two halves.
"""

from __future__ import annotations

import copy
import inspect
from collections import defaultdict
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.engine.core.layout import ParamShard
from lightning_zero.engine.errors import ShardedOptimizerStateError, UnsupportedOptimizerError

ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
)
_NOT_ELEMENTWISE_NAMES = {"LBFGS", "Adafactor", "Muon", "SparseAdam", "LAMB", "Lamb", "LARS", "Shampoo"}


def _unsupported(optimizer: Optimizer, why: str) -> UnsupportedOptimizerError:
    name = type(optimizer).__name__
    return UnsupportedOptimizerError(
        f"{name} cannot run on ZeRO shards: {why}. ZeRO steps each rank's slice of every parameter on its own, "
        "which is exact only for element-wise optimizers (SGD, Adam, AdamW, RMSprop, Adagrad, ...). "
        f"Use one of those, or train with DDPStrategy / FSDP if you need {name}."
    )


def check_elementwise(optimizer: Optimizer) -> None:
    """Raise ``UnsupportedOptimizerError`` unless ``optimizer`` updates each element independently."""
    if type(optimizer) in ELEMENTWISE:
        return
    if type(optimizer).__name__ in _NOT_ELEMENTWISE_NAMES:
        raise _unsupported(optimizer, "its update uses whole-tensor quantities (norms, factors or a line search)")
    _probe_elementwise(optimizer)


def _probe_elementwise(optimizer: Optimizer) -> None:
    accepted = inspect.signature(type(optimizer).__init__).parameters
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params" and k in accepted}
    generator = torch.Generator().manual_seed(0)
    whole = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    grads = [torch.randn(4, 6, generator=generator, dtype=torch.float64) for _ in range(3)]
    try:
        full = nn.Parameter(whole.clone())
        halves = [nn.Parameter(whole.reshape(-1)[:9].clone()), nn.Parameter(whole.reshape(-1)[9:].clone())]
        opt_full = type(optimizer)([full], **copy.deepcopy(hyper))
        opt_halves = type(optimizer)(halves, **copy.deepcopy(hyper))
        for grad in grads:
            full.grad = grad.clone()
            halves[0].grad, halves[1].grad = grad.reshape(-1)[:9].clone(), grad.reshape(-1)[9:].clone()
            opt_full.step()
            opt_halves.step()
    except Exception as err:
        raise _unsupported(optimizer, f"it could not be checked for element-wise updates ({err!r})") from err
    if not torch.allclose(full.detach().reshape(-1), torch.cat([h.detach() for h in halves]), rtol=1e-12, atol=0):
        raise _unsupported(optimizer, "stepping a tensor whole and in two slices gives different results")


def bind_optimizer(optimizer: Optimizer, shards: dict[nn.Parameter, tuple[nn.Parameter, ParamShard]]) -> None:
    """Check that ``optimizer`` can step shards and holds only the module's parameters, and slice the state
    it already holds to this rank's pieces (in place; the param groups are left as they are).

    ``shards`` maps each module parameter to its shard parameter and the ``ParamShard`` saying
    which slice of the flattened parameter it holds.
    """
    check_elementwise(optimizer)
    check_optimizer_params(optimizer, {id(p) for p in shards})
    old_state = optimizer.state
    optimizer.state = defaultdict(dict)
    for param, state in old_state.items():
        optimizer.state[param] = {k: slice_state(k, v, param, shards[param][1]) for k, v in state.items()}


def check_optimizer_params(optimizer: Optimizer, known: AbstractSet[int], module: nn.Module | None = None) -> None:
    """Raise ``ValueError`` if a param group holds a tensor that is not a parameter of the sharded module (whose
    ``id``s are ``known``; ids, not the tensors, so that no tensor ``__hash__`` runs: this runs every step), or
    one parameter twice. ``module``: the sharded module, to tell a parameter registered on it after setup."""
    ids = [id(param) for group in optimizer.param_groups for param in group["params"]]
    if len(set(ids)) == len(ids) and known.issuperset(ids):
        return  # the common case, in three C-level passes; the loop below says what is wrong otherwise
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in known:
                raise ValueError(_foreign_parameter(optimizer, param, module))
            if id(param) in seen:
                raise ValueError(
                    f"a parameter of shape {tuple(param.shape)} appears twice in {type(optimizer).__name__}"
                )
            seen.add(id(param))


def _foreign_parameter(optimizer: Optimizer, param: torch.Tensor, module: nn.Module | None) -> str:
    name = type(optimizer).__name__
    registered = next((n for n, p in module.named_parameters() if p is param), None) if module is not None else None
    if registered is not None:
        return (
            f"{name} holds the parameter {registered!r}, which was registered on the LightningModule after the "
            "strategy sharded it, so it has no shard to step. Register every parameter before training starts (in "
            "__init__ or configure_model), frozen with requires_grad=False if it should not train yet, and unfreeze "
            "it (requires_grad=True, and add_param_group if it is not in an optimizer) when it should."
        )
    return (
        f"{name} holds a parameter of shape {tuple(param.shape)} that is not a parameter of the LightningModule. "
        "configure_optimizers must only use self.parameters()."
    )


def is_param_shaped(key: str, value: object, param: torch.Tensor) -> bool:
    """Whether an optimizer state entry holds one value per parameter element (``exp_avg``) rather
    than a scalar (``step``); for 0-dim parameters only the key can tell."""
    return isinstance(value, torch.Tensor) and value.shape == param.shape and (param.dim() > 0 or key != "step")


def slice_state(key: str, value: object, param: torch.Tensor, piece: ParamShard) -> object:
    """This rank's slice of one optimizer state entry: per-element entries are flattened and sliced,
    anything else (``step`` counters, scalars) is kept whole."""
    if is_param_shaped(key, value, param):
        assert isinstance(value, torch.Tensor)
        return value.detach().reshape(-1)[piece.param_offset : piece.param_offset + piece.numel].clone()
    return value


def guard_sharded_state(optimizer: Optimizer, why: str) -> None:
    """Leave ``optimizer``'s states as this rank's shards, and make ``state_dict()`` and ``step()`` raise
    ``ShardedOptimizerStateError`` saying so, instead of returning or stepping shard-shaped states as if they were
    full; ``load_state_dict()`` of a full state makes it an ordinary optimizer again (see [Note: what fits at the
    end] in ``free_memory.py``)."""
    name = type(optimizer).__name__
    message = (
        f"{name}'s per-parameter states stayed sharded when the run ended, because {why}: gathering them would have "
        f"ended the process. Save them while the run is on, where every rank writes its own shard (ModelCheckpoint, "
        f"or trainer.save_checkpoint(...) in a callback's on_train_end); after it, save the weights with "
        f"trainer.save_checkpoint(path, weights_only=True), and build a new optimizer to train on."
    )
    handles: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ShardedOptimizerStateError(message)

    def restored(*args: Any, **kwargs: Any) -> None:
        for handle in handles:
            handle.remove()

    handles.append(optimizer.register_state_dict_pre_hook(refuse))
    handles.append(optimizer.register_step_pre_hook(refuse))
    handles.append(optimizer.register_load_state_dict_post_hook(restored))
