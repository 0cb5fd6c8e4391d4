"""Meta init in one process, pure torch: ``record_meta_init`` then ``materialize_units`` (no sharding).

- Whatever the initialization looks like (``reset_parameters``, loops over ``self.modules()`` after
  construction, ``torch.nn.init`` functions that sample by rejection or do nothing on meta, weights
  tied after construction, partial writes, ``torch.tensor`` constants, computed non-persistent
  buffers, ``load_state_dict`` or ``.to(dtype)`` inside the build, ``nn.LSTM``'s tracked weights),
  every parameter and buffer equals an ordinary construction with the same seed, and the random
  generator ends where an ordinary construction leaves it.
- Weights overwritten at the end of construction (as transformers' ``post_init`` does) cost no unit
  memory until then: the peak is one unit and one scratch tensor, not the model.
- What cannot be replayed is refused with ``MetaInitError``, naming it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_zero.engine import MetaInitError, default_unit_policy, plan_units, record_meta_init
from lightning_zero.engine.meta.materialize import materialize_units
from tests.memory_tracker import LiveStorageBytes


class Zoo(nn.Module):
    """torch layers, initialized in ``__init__`` in every way a library might."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8, padding_idx=0)
        self.lstm = nn.LSTM(8, 8, num_layers=2)
        self.mha = nn.MultiheadAttention(8, 2)
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(8, 10)
        self.head.weight = self.emb.weight  # tied after construction: the embedding's values win
        nn.init.trunc_normal_(self.emb.weight, std=0.02)  # rejection sampling; nothing at all on meta
        nn.init.orthogonal_(self.conv.weight)
        nn.init.sparse_(self.mha.out_proj.weight, 0.5)
        for m in self.modules():  # a loop after construction
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.normal_(m.bias, std=0.1)
        with torch.no_grad():
            self.conv.bias[:2].mul_(3)  # a partial, read-modify-write
            self.bn.running_mean.copy_(torch.arange(4.0))
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))  # a constant: its data bypasses the dispatcher
        inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
        self.register_buffer("cos", torch.outer(torch.arange(4.0), inv_freq).cos(), persistent=False)


class Cast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(torch.float64)


torch.manual_seed(7)
PRETRAINED = nn.Linear(4, 3).state_dict()


class SeedsInside(nn.Module):
    """Seeds while it is built (as ``torch.manual_seed`` or ``L.seed_everything`` inside ``configure_model`` would):
    the values drawn after the seed must be the seed's (see [Note: seeds while recording])."""

    def __init__(self) -> None:
        super().__init__()
        self.before = nn.Linear(4, 4)
        torch.manual_seed(11)
        self.after = nn.Linear(4, 4)
        torch.set_rng_state(torch.Generator().manual_seed(5).get_state())  # a state made elsewhere
        self.again = nn.Linear(3, 1)


def loaded() -> nn.Module:
    model = nn.Linear(4, 3)
    model.load_state_dict(PRETRAINED)  # copies real tensors into meta ones: replayed
    return model


def _materialize(build: Callable[[], nn.Module]) -> nn.Module:
    with record_meta_init() as trace:
        model = build()
    plans = plan_units(model)
    materialize_units(model, plans, torch.device("cpu"), 2, lambda i, full: None, trace)
    return model


@pytest.mark.parametrize(
    "build", [Zoo, Cast, loaded, SeedsInside], ids=["zoo", "cast", "load_state_dict", "seeds_inside"]
)
def test_replay_equals_an_ordinary_construction(build: Callable[[], nn.Module]) -> None:
    torch.manual_seed(0)
    reference = build()
    expected = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    generator_after = torch.get_rng_state()
    torch.manual_seed(0)
    with record_meta_init() as trace:
        model = build()
    torch.manual_seed(1)  # draws between recording and replay change nothing
    materialize_units(model, plan_units(model), torch.device("cpu"), 2, lambda i, full: None, trace)
    got = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    assert torch.equal(torch.get_rng_state(), generator_after)
    if isinstance(model, Zoo):
        assert model.head.weight is model.emb.weight
        assert all(w is p for w, p in zip(model.lstm._flat_weights, model.lstm.parameters()))
        model.lstm(torch.randn(3, 1, 8))  # its weights are the real ones


class PostInit(nn.Module):
    """Overwrites every weight once everything is built, as transformers' ``post_init`` does."""

    def __init__(self, blocks: int = 6, dim: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(blocks))
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)


def test_weights_overwritten_at_the_end_need_one_unit_at_a_time() -> None:
    with record_meta_init() as trace:
        model = PostInit()
    plans = plan_units(model, default_unit_policy(model, whole_model_below=0))  # one unit per Linear
    shards: list[torch.Tensor] = []

    def shard(index: int, full: torch.Tensor | None) -> None:
        assert full is not None
        shards.append(full[: full.numel() // 2].clone())  # what a rank of 2 keeps
        full.untyped_storage().resize_(0)

    with LiveStorageBytes() as tracker:
        materialize_units(model, plans, torch.device("cpu"), 2, shard, trace)
    unit = 4 * (64 * 64 + 64)
    assert len(shards) == 6
    # All shards and the unit being initialized (4 units; measured exactly that). The kaiming_uniform_ each
    # nn.Linear draws in its constructor is overwritten later: it runs in scratch memory before any unit
    # exists. Keeping each unit from its constructor to the final loop would take the whole model (6 units).
    assert tracker.peak <= 6 * unit // 2 + unit + 1024, (tracker.peak, unit)


class EarlyMeta(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.early = nn.Linear(4, 4)


def test_what_cannot_be_replayed_is_refused_by_name() -> None:
    model = EarlyMeta()  # before recording, as a LightningModule's __init__ runs before configure_model
    with record_meta_init() as trace:
        model.late = nn.Linear(4, 4)
    with pytest.raises(MetaInitError, match=r"2 tensor\(s\) were on the meta device before .*: early.weight, early"):
        materialize_units(model, plan_units(model), torch.device("cpu"), 1, lambda i, full: None, trace)

    source = torch.ones(4)
    with record_meta_init() as trace:
        model = nn.Linear(4, 1)
        with torch.no_grad():
            model.weight[0].copy_(source)
    source.add_(1)
    with pytest.raises(MetaInitError, match=r"modified in place afterwards"):
        materialize_units(model, plan_units(model), torch.device("cpu"), 1, lambda i, full: None, trace)

    sys.setprofile(lambda *args: None)  # another profiler: init calls cannot be observed
    try:
        with record_meta_init() as trace:
            model = nn.Linear(4, 1)
    finally:
        sys.setprofile(None)
    with pytest.raises(MetaInitError, match=r"Another profiler held sys.setprofile"):
        materialize_units(model, plan_units(model), torch.device("cpu"), 1, lambda i, full: None, trace)

    with record_meta_init() as trace, torch.random.fork_rng():  # saves and restores the state: cannot be replayed
        model = nn.Linear(4, 1)
    with pytest.raises(MetaInitError, match=r"read the random generator's state \(torch.get_rng_state"):
        materialize_units(model, plan_units(model), torch.device("cpu"), 1, lambda i, full: None, trace)

    with torch.device("meta"):
        model = nn.Linear(4, 1)
    with pytest.raises(MetaInitError, match=r"not built under record_meta_init"):
        materialize_units(model, plan_units(model), torch.device("cpu"), 1, lambda i, full: None, None)
