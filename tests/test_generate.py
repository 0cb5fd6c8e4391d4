"""``model.generate(...)`` with a different number of new tokens per rank (a different ``max_new_tokens``, or an
end-of-sequence token reached on one rank first): under stage 3 the ranks then run different numbers of forwards,
and a rank that is done serves the gathers of those still generating (see [Note: joined forwards] in
``lightning_zero/engine/schedule/joined.py``), so the tokens are DDP's without ``synced_gpus=True``, in
``training_step``, ``validation_step``, ``test_step`` and ``predict_step`` and through Fabric (stages 1 and 2:
DDP's too), also as LitGPT generates there: its own ``generate(model, prompt, ...)``, one Fabric forward per token
under ``inference_mode``, on rank 0 only, served by rank 1 from its next call of the strategy (see [Note: Fabric
steps] in ``lightning_zero/fabric/wrapper.py``). Outside a step (``on_validation_epoch_end``) nothing is joined:
``synced_gpus=True`` gives DDP's tokens, and without it the error says so on every rank; so does the error for a
forward that a finished rank cannot serve (one of a model it never ran, a Fabric no-grad step that broadcasts
buffers or that no earlier one announced). The models have several units (their blocks), as a real model's
default units do: a tiny model is one unit by default (see [Note: default units] in ``engine/core/grouping.py``),
held for the whole step, so nothing would need serving."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeRO3Strategy
from tests.distributed import spawn
from tests.models import quiet_trainer
from tests.real_models import build

pytest.importorskip("transformers")
pytest.importorskip("litgpt")

BLOCKS = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer"}


def _strategy(name: str, model: str) -> Any:
    return ZeRO3Strategy(unit_modules=[BLOCKS[model]]) if name == "zero3" else name


def _units(trainer: L.Trainer) -> list[str]:
    """The units of a run under way (none under DDP)."""
    strategy = trainer.strategy
    return [unit.name for unit in strategy.sharded_model.units] if isinstance(strategy, ZeRO3Strategy) else []


class Generate(L.LightningModule):
    """GPT-2 (3 blocks), 3 validation batches per rank: greedy generation of ``1 + 4 * rank`` new tokens per prompt
    (``synced``: with ``synced_gpus=True``)."""

    def __init__(self, synced: bool) -> None:
        super().__init__()
        self.synced = synced
        self.generated: list[torch.Tensor] = []
        self.units: list[str] = []

    def configure_model(self) -> None:
        torch.manual_seed(0)  # inside configure_model: under stage 3 this is recorded and replayed in order
        self.model = build("gpt2", layers=3)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        out = self.model.generate(
            batch[0], max_new_tokens=1 + 4 * self.global_rank, do_sample=False, pad_token_id=0, synced_gpus=self.synced
        )
        self.generated.append(out)
        self.units = _units(self.trainer)

    def val_dataloader(self) -> DataLoader:
        prompts = torch.randint(1, 64, (6, 3), generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(prompts), batch_size=1)


class LlamaGenerate(L.LightningModule):
    """A Llama with 4 decoder layers, one prompt per batch, greedy generation with the KV cache: 4 new tokens on
    rank 0 and 12 on rank 1 in ``training_step`` (under ``no_grad``, then a loss on what was generated) and
    ``validation_step``, one batch per rank; in ``test_step`` 12 on both, up to ``eos``, which rank 0 reaches
    early; in ``predict_step`` 12 on rank 0, which has 2 batches, and 4 on rank 1, which has 1 (Lightning's
    predict sampler does not pad): rank 1 serves all of rank 0's second batch."""

    def __init__(self) -> None:
        super().__init__()
        self.eos: int | None = None
        self.generated: dict[str, list[torch.Tensor]] = {}
        self.loss: torch.Tensor | None = None
        self.units: list[str] = []

    def configure_model(self) -> None:
        torch.manual_seed(0)
        self.model = build("llama", layers=4)

    def _generate(self, phase: str, prompt: torch.Tensor, first: int = 4, then: int = 12) -> torch.Tensor:
        new = first if self.global_rank == 0 else then
        eos = {"eos_token_id": self.eos} if phase == "test" else {}
        out = self.model.generate(prompt, max_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=0, **eos)
        self.generated.setdefault(phase, []).append(out)
        self.units = _units(self.trainer)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        with torch.no_grad():
            out = self._generate("train", batch[0])
        self.loss = self.model(input_ids=out, labels=out).loss
        return self.loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._generate("validation", batch[0])

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._generate("test", batch[0], 12, 12)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._generate("predict", batch[0], 12, 4)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def _prompts(self, count: int = 2) -> DataLoader:
        prompts = torch.randint(2, 64, (count, 3), generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(prompts), batch_size=1)

    train_dataloader = val_dataloader = test_dataloader = _prompts

    def predict_dataloader(self) -> DataLoader:
        return self._prompts(3)


class LlamaInHook(LlamaGenerate):
    """Generation in ``on_validation_epoch_end``, outside any step, 4 new tokens on rank 0 and 12 on rank 1: not
    joined there, so it needs ``synced_gpus=True`` under stage 3 (``synced``), and without it the error says so."""

    def __init__(self, synced: bool) -> None:
        super().__init__()
        self.synced = synced

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.model(batch[0])

    def on_validation_epoch_end(self) -> None:
        prompt = torch.tensor([[5 + self.global_rank, 6, 7]])
        new = 4 if self.global_rank == 0 else 12
        out = self.model.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0, synced_gpus=self.synced)
        self.generated["hook"] = [out]


def _in_hook(rank: int, world_size: int) -> None:
    from lightning_zero.engine import CollectiveMismatchError

    tokens = {}
    for strategy, synced in (("ddp", False), ("zero3", True)):
        module = LlamaInHook(synced)
        quiet_trainer(strategy=_strategy(strategy, "llama"), devices=world_size, limit_val_batches=1).validate(
            module, verbose=False
        )
        tokens[strategy] = module.generated["hook"][0]
    assert tokens["ddp"].shape[1] == (7 if rank == 0 else 15)
    assert torch.equal(tokens["zero3"], tokens["ddp"])
    trainer = quiet_trainer(strategy=_strategy("zero3", "llama"), devices=world_size, limit_val_batches=1)
    with pytest.raises(CollectiveMismatchError) as caught:  # on every rank
        trainer.validate(LlamaInHook(synced=False), verbose=False)
    message = str(caught.value)
    assert "rank 1: all_gather of" in message and "outside a step" in message, message
    assert "If this rank was generating (model.generate(...)) outside a step" in message, message
    assert "pass synced_gpus=True to model.generate(...)" in message, message
    assert "batches per epoch" not in message, message  # (the advice for uneven training batches)


class SecondModelOnRank1(L.LightningModule):
    """``validation_step`` runs the model on every rank, then generates with a second model on rank 1 only: rank 0
    never ran a forward of that model, so it cannot serve one."""

    def configure_model(self) -> None:
        torch.manual_seed(0)
        self.model, self.draft = build("llama", layers=2), build("llama", layers=2)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.model(batch[0])
        if self.global_rank == 1:
            self.draft.generate(batch[0], max_new_tokens=2, do_sample=False, pad_token_id=0)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randint(2, 64, (2, 3), generator=torch.Generator().manual_seed(1))))


def _cannot_serve(world_size: int) -> None:
    from lightning_zero.engine import CollectiveMismatchError

    trainer = quiet_trainer(strategy=_strategy("zero3", "llama"), devices=world_size, limit_val_batches=1)
    with pytest.raises(CollectiveMismatchError) as caught:  # on every rank
        trainer.validate(SecondModelOnRank1(), verbose=False)
    message = str(caught.value)
    assert "rank 0 cannot serve the gathers of the no-grad forward that rank(s) 1 run" in message, message
    assert "Pass synced_gpus=True to model.generate(...)" in message, message


def _eos_for_rank0(generated: torch.Tensor) -> int:
    """A token that rank 0 generates in validation (not first) and rank 1 never does: with it as the end-of-sequence
    token, rank 0 stops early in ``test_step`` (the same prompts and weights), rank 1 goes on to 12 new tokens."""
    everyone: list[Any] = [None, None]
    dist.all_gather_object(everyone, generated[0, 3:].tolist())
    first, second = everyone
    return next(t for t in first[1:] if t not in second)


def _llama(strategy: str, world_size: int, eos: int | None) -> dict[str, Any]:
    module = LlamaGenerate()
    trainer = quiet_trainer(strategy=_strategy(strategy, "llama"), devices=world_size, max_steps=1, limit_val_batches=1)
    trainer.fit(module)
    module.eos = eos if eos is not None else _eos_for_rank0(module.generated["validation"][0])
    trainer.test(module, verbose=False)
    trainer.predict(module)
    assert module.loss is not None
    return {"tokens": dict(module.generated), "loss": module.loss.item(), "eos": module.eos, "units": module.units}


def _fabric(strategy: str, world_size: int) -> torch.Tensor:
    """``fabric.setup(model)``, then ``model.generate`` marked as a forward method (as Fabric asks of any strategy
    that wraps the model), under ``no_grad``: 4 new tokens on rank 0, 12 on rank 1."""
    from lightning_zero.fabric import ZeRO3Strategy as FabricZeRO3

    chosen = FabricZeRO3(unit_modules=[BLOCKS["llama"]]) if strategy == "zero3" else strategy
    fabric = L.Fabric(strategy=chosen, accelerator="cpu", devices=world_size)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup(build("llama", layers=4))
    model.mark_forward_method("generate")
    prompt = torch.randint(2, 64, (2, 3), generator=torch.Generator().manual_seed(1))[fabric.global_rank :][:1]
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=4 if fabric.global_rank == 0 else 12, do_sample=False)
    if strategy == "zero3":
        assert len(fabric.strategy.sharded_model.units) == 5
    fabric.barrier()
    fabric.strategy.teardown()
    return out


def _litgpt(strategy: str, world_size: int, broadcast_buffers: bool = True) -> tuple[L.Fabric, Any, Any]:
    """A LitGPT ``GPT`` with 2 blocks (its units under stage 3) and SGD, set up by Fabric."""
    from lightning.fabric.strategies import DDPStrategy
    from litgpt import GPT, Config

    from lightning_zero.fabric import ZeRO2Strategy as FabricZeRO2
    from lightning_zero.fabric import ZeRO3Strategy as FabricZeRO3

    if strategy == "zero3":
        chosen: Any = FabricZeRO3(unit_modules=["Block"], broadcast_buffers=broadcast_buffers)
    elif strategy == "zero2":
        chosen = FabricZeRO2(broadcast_buffers=broadcast_buffers)
    else:
        chosen = DDPStrategy(broadcast_buffers=broadcast_buffers)
    fabric = L.Fabric(strategy=chosen, accelerator="cpu", devices=world_size)
    fabric.launch()
    torch.manual_seed(0)
    module = GPT(Config(n_layer=2, n_embd=32, n_head=4, padded_vocab_size=64, block_size=32))
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    return fabric, model, optimizer


def _litgpt_tokens(model: Any, rank: int, new: int) -> torch.Tensor:
    """As LitGPT's ``generate_example``: its own ``generate(model, prompt, ...)`` (``litgpt/generate/base.py``), which
    calls the model once per new token under ``torch.inference_mode()``, with the KV cache, inside ``no_grad``."""
    from litgpt.generate.base import generate

    model.eval()
    with torch.no_grad():
        model.set_kv_cache(batch_size=1)
        tokens = generate(model, torch.tensor([3 + rank, 5, 7]), max_returned_tokens=3 + new, temperature=0.0)
        model.clear_kv_cache()
    model.train()
    return tokens


def _litgpt_fabric(strategy: str, world_size: int) -> dict[str, Any]:
    """LitGPT's generation through Fabric, each new token a forward through the model ``fabric.setup`` returned: 3
    new tokens on rank 0 and 7 on rank 1, then ``fabric.barrier()``, a training step and ``fabric.all_reduce``; as
    ``litgpt finetune_lora`` evaluates, a forward under ``no_grad`` on every rank, then generation on rank 0 only and a
    barrier; a micro-batch under ``no_backward_sync``, then generation on rank 0 only, a no-grad step that rank 1
    serves from the start of its next training step (as LitGPT generates at the end of an epoch); the parameters
    after a last optimizer step."""
    fabric, model, optimizer = _litgpt(strategy, world_size)
    rank = fabric.global_rank
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    out: dict[str, Any] = {"tokens": [], "losses": [], "reduced": []}

    def train(step: bool = True) -> None:
        with fabric.no_backward_sync(model, enabled=not step):
            loss = model(x).pow(2).mean()
            fabric.backward(loss)
        out["losses"].append(loss.item())
        if step:
            optimizer.step()
            optimizer.zero_grad()
            out["reduced"].append(fabric.all_reduce(loss.detach().clone(), reduce_op="mean").item())

    out["tokens"].append(_litgpt_tokens(model, rank, 3 if rank == 0 else 7))
    fabric.barrier()
    train()
    with torch.no_grad():
        model(x)
    if rank == 0:
        out["tokens"].append(_litgpt_tokens(model, rank, 4))
    fabric.barrier()
    train(step=False)
    if rank == 0:
        out["tokens"].append(_litgpt_tokens(model, rank, 4))
    train()
    out["params"] = [p.clone() for p in model.state_dict().values()]
    if strategy == "zero3":
        out["units"] = len(fabric.strategy.sharded_model.units)
    fabric.strategy.teardown()
    return out


def _litgpt_after_a_step(strategy: str, world_size: int) -> dict[str, Any]:
    """Generation on rank 0 only right after an optimizer step, with ``broadcast_buffers=False``: rank 1 serves the
    no-grad step from the start of its next training step, where (as on rank 0 when it began it) the root unit and
    the first block are gathered already for that step, and the step after it gathers them again on both."""
    fabric, model, optimizer = _litgpt(strategy, world_size, broadcast_buffers=False)
    rank = fabric.global_rank
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        model(x)  # (every rank has run a no-grad step, so it knows the forward it serves)
    losses, tokens = [], None
    for step in range(2):
        loss = model(x).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step == 0 and rank == 0:
            tokens = _litgpt_tokens(model, rank, 4)
    params = [p.clone() for p in model.state_dict().values()]
    fabric.strategy.teardown()
    return {"tokens": tokens, "losses": losses, "params": params}


def _litgpt_cannot_serve(world_size: int) -> None:
    """Generation on rank 0 only where rank 1, at a barrier, cannot serve it, an error on every rank that says why:
    right after a training step, its first forward broadcasts rank 0's buffers (LitGPT's ``GPT`` has ``cos`` and
    ``sin``), as DDP's does, which rank 1 cannot join (DDP would hang); after a micro-batch under
    ``no_backward_sync`` (no broadcast) but before any no-grad step, rank 1 cannot know its first forward's units."""
    from lightning_zero.engine import CollectiveMismatchError

    for synced in (True, False):
        fabric, model, _ = _litgpt("zero3", world_size)
        with fabric.no_backward_sync(model, enabled=not synced):
            fabric.backward(model(torch.randint(0, 64, (2, 8))).pow(2).mean())
        with pytest.raises(CollectiveMismatchError) as caught:  # on every rank
            if fabric.global_rank == 0:
                _litgpt_tokens(model, 0, 2)
            fabric.barrier()
        message = str(caught.value)
        if synced:
            assert "rank 0: start no-grad step 1 (forwards under no_grad outside a training step, which broadcasts" in (
                message
            ), message
            assert "rank 1: barrier(None)" in message, message
            assert "broadcasts rank 0's buffers to every rank first (as DDP's forward does)" in message, message
            assert "pass broadcast_buffers=False to the strategy" in message, message
        else:
            assert (
                "they expected its first no-grad forward to gather no unit, since it had run no no-grad step before "
                "(run one on every rank first), and it starts at 'transformer.h.0'"
            ) in message, message
        fabric.strategy.teardown()


def _generate(rank: int, world_size: int) -> None:
    results = {}
    for strategy, synced in (("ddp", False), ("zero3", False), ("zero3", True)):
        module = Generate(synced)
        trainer = quiet_trainer(strategy=_strategy(strategy, "gpt2"), devices=world_size, limit_val_batches=None)
        trainer.validate(module, verbose=False)
        results[strategy, synced] = module.generated
        if strategy == "zero3":
            assert len(module.units) == 4, module.units  # the root and the 3 blocks
    reference = results["ddp", False]
    assert len(reference) == 3 and max(t.shape[1] for t in reference) > (3 + 1 if rank == 1 else 3)  # rank 1: more
    for key in (("zero3", False), ("zero3", True)):
        assert all(torch.equal(a, b) for a, b in zip(reference, results[key], strict=True)), key

    ddp = _llama("ddp", world_size, None)
    runs = {name: _llama(name, world_size, ddp["eos"]) for name in ("zero1", "zero2", "zero3")}
    zero3 = runs["zero3"]
    assert zero3["units"] == ["<root>", *(f"model.model.layers.{i}" for i in range(4))], zero3["units"]
    new = {phase: [t.shape[1] - 3 for t in tokens] for phase, tokens in ddp["tokens"].items()}
    first, predict = (4, [12, 12]) if rank == 0 else (12, [4])
    ending = {"train": [first], "validation": [first], "predict": predict}
    assert {phase: n for phase, n in new.items() if phase != "test"} == ending, new
    assert new["test"][0] < 12 if rank == 0 else new["test"] == [12], new  # rank 0 reached the end-of-sequence token
    for name, run in runs.items():
        for phase, tokens in ddp["tokens"].items():
            got = run["tokens"][phase]
            assert len(got) == len(tokens) and all(map(torch.equal, got, tokens)), (name, phase, got, tokens)
        assert run["loss"] == ddp["loss"], (name, run["loss"], ddp["loss"])

    fabric = {strategy: _fabric(strategy, world_size) for strategy in ("ddp", "zero3")}
    assert fabric["ddp"].shape[1] == (7 if rank == 0 else 15)
    assert torch.equal(fabric["zero3"], fabric["ddp"])

    litgpt = {strategy: _litgpt_fabric(strategy, world_size) for strategy in ("ddp", "zero2", "zero3")}
    ddp = litgpt["ddp"]
    assert [t.numel() for t in ddp["tokens"]] == ([6, 7, 7] if rank == 0 else [10]), ddp["tokens"]
    assert litgpt["zero3"]["units"] == 3  # the root and the 2 blocks
    after = {strategy: _litgpt_after_a_step(strategy, world_size) for strategy in ("ddp", "zero2", "zero3")}
    assert (after["ddp"]["tokens"] is None) == (rank == 1)
    for name in ("zero2", "zero3"):  # (stage 2: a no-grad step is agreed only if it issues a collective)
        got = litgpt[name]
        assert len(got["tokens"]) == len(ddp["tokens"]) and all(map(torch.equal, got["tokens"], ddp["tokens"])), name
        assert got["losses"] == ddp["losses"] and got["reduced"] == ddp["reduced"], (name, got, ddp)
        assert all(map(torch.equal, got["params"], ddp["params"])), name
        assert after[name]["losses"] == after["ddp"]["losses"], name
        assert rank == 1 or torch.equal(after[name]["tokens"], after["ddp"]["tokens"]), name
        assert all(map(torch.equal, after[name]["params"], after["ddp"]["params"])), name

    _in_hook(rank, world_size)  # these end with an error
    _cannot_serve(world_size)
    _litgpt_cannot_serve(world_size)


def test_generate_with_lengths_that_differ_per_rank() -> None:
    spawn(_generate, world_size=2, timeout=300)
