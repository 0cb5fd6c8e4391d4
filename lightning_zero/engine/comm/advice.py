"""What to tell the user when an agreement fails: advice built from what each rank said it was doing (a
training step, an evaluation step, a ``state_dict()`` gather, a parameter read, a save), for the error that
``CollectiveSequence`` raises on every rank (see [Note: collective checks] in ``sequence.py``)."""

from __future__ import annotations

import re

_COLLECTIVE_TEXT = re.compile(
    r"(waiting for the other ranks to agree on: )?(all_gather|reduce_scatter|all_reduce|broadcast) of"
)
# What a rank inside an evaluation loop says (see [Note: uneven evaluation] in strategies/agreement.py): about to
# start one of its steps, or in a collective of one.
_IN_EVALUATION = re.compile(r"(?:start |collective \d+ of )(validation|sanity check|test|predict) step (\d+)")
SERVING = "serves the gathers of the ranks still running"  # what a stage-3 rank that has run out of batches says
# What a rank in a joined no-grad forward says, and one that serves it (see [Note: joined forwards] in
# engine/schedule/joined.py): "start no-grad forward 2 (from 'layers.0') of validation step 1 (...)".
NO_GRAD_FORWARD = "no-grad forward"
SERVES_FORWARD = "serves its gathers"
GENERATION_ADVICE = (
    "Under stage 3 the ranks ran different numbers of forwards under no_grad (a generation loop: model.generate(...) "
    "with a different number of new tokens per rank, or an end-of-sequence token reached on one rank first). A rank "
    "that has finished its forwards serves the gathers of the ranks still running them, from its next collective "
    "or agreement, as long as every rank ran at least the first forward of the loop, a later forward gathers only "
    "units (no other collective inside it), and the rank that serves has run a forward starting at the same unit "
    "itself; here that did not hold. Pass synced_gpus=True to model.generate(...), so that every rank runs as many "
    "forwards, or run the same forwards on every rank."
)
# What a Fabric no-grad step says when it begins with a broadcast of rank 0's buffers, which ranks elsewhere cannot
# serve (see [Note: Fabric steps] in fabric/wrapper.py), and the advice for it.
BROADCASTS_BUFFERS = "which broadcasts rank 0's buffers first"
BROADCAST_ADVICE = (
    "A forward through the model fabric.setup returned, the first after a forward with gradients, broadcasts rank "
    "0's buffers to every rank first (as DDP's forward does), so every rank must run it: here some ranks were "
    "elsewhere (under DDP they would hang). Run that forward on every rank, run a forward under no_grad on every "
    "rank before the ones that only some ranks run, or pass broadcast_buffers=False to the strategy if the buffers "
    "need no copying from rank 0 (they are the same on every rank, or are not statistics)."
)
# Per evaluation phase: the prefix of its dataloader hook and limit_*_batches, and its step hook.
_HOOKS = {
    "validation": ("val", "validation_step"),
    "sanity check": ("val", "validation_step"),
    "test": ("test", "test_step"),
    "predict": ("predict", "predict_step"),
}


# What the gathers of ``state_dict()`` and of a parameter read are named (``ShardedUnit.full_flat``, ``read_values``).
STATE_DICT_GATHER = "(state_dict())"
EXPORT_GATHER = "(save_pretrained())"
EXPORT_CALL = "strategy.save_pretrained(module, "  # what a rank in the driver's agreement before an export says
PARAMETER_READ = "outside its forward)"
# Where a rank says it is when a hook that runs after the training loop issued the collective (see
# ``strategies/agreement.py``'s ``after_training``): "in on_train_end, after the training loop".
AFTER_TRAINING = "after the training loop"
_AFTER_TRAINING_TEXT = re.compile(r"in (\w+), " + AFTER_TRAINING)
# A stage-3 gather outside any step (a unit's, or a parameter read's): where a generation loop in a hook or a
# callback gathers, forward after forward, without the join of [Note: joined forwards] in engine/schedule/joined.py.
_GATHER_OUTSIDE_STEP = re.compile(r"^(waiting for the other ranks to agree on: )?all_gather of .*outside a step")
GENERATION_OUTSIDE_STEP = (
    "If this rank was generating (model.generate(...)) outside a step, in a hook such as on_validation_epoch_end or "
    "in a callback (under Fabric: through the model fabric.setup returned without "
    "fabric_model.mark_forward_method('generate')), a rank that has finished its tokens cannot serve the gathers of "
    "the ranks still generating there: pass synced_gpus=True to model.generate(...), or generate inside "
    "training_step, validation_step, test_step or predict_step (under Fabric, mark generate as a forward method), "
    "where it can."
)


def explain_texts(texts: list[str], stage: int | None = None) -> str:
    """Advice for a failed agreement, from what the ranks said they were doing; ``stage``: the ZeRO stage of the
    run, when known (the advice differs: stages 1 and 2 have no collective in forward)."""
    advice = []
    uneven = _uneven_evaluation(texts)
    generation = any(NO_GRAD_FORWARD in t for t in texts)
    broadcast = any(BROADCASTS_BUFFERS in t for t in texts)
    if broadcast:
        advice.append(BROADCAST_ADVICE)
    elif generation:  # the ranks' forwards differ, not (only) their batches
        advice.append(GENERATION_ADVICE)
    elif uneven is not None:
        advice.append(_uneven_advice(uneven, stage, any(SERVING in t for t in texts)))
    elif any(EXPORT_GATHER in t or t.startswith(EXPORT_CALL) for t in texts):
        advice.append(
            "strategy.save_pretrained(module, path) is a collective under lightning_zero (every rank gathers the "
            "units and writes its own file): call it on every rank, not under `if trainer.is_global_zero`."
        )
    elif any(STATE_DICT_GATHER in t for t in texts):
        advice.append(
            "module.state_dict() gathers the stage-3 parameters from every rank (and save_pretrained calls it): "
            "call it on every rank, not under `if trainer.is_global_zero`; to write the files on one rank, call "
            "model.save_pretrained(path, is_main_process=trainer.is_global_zero) on every rank. (A transformers "
            "model.save_pretrained(path) stopped here has written config.json (and generation_config.json, for a "
            "model that generates) into path before its state_dict() call, and no weights: the next save into path, "
            "on every rank, completes it.)"
        )
    elif any(PARAMETER_READ in t for t in texts):
        advice.append(
            "Reading a stage-3 parameter outside its module's forward gathers its unit from every rank: make the "
            "read on every rank (not under `if trainer.is_global_zero`), or read inside "
            "`with trainer.strategy.gathered_parameters(module):` on every rank."
        )
    elif any(_COLLECTIVE_TEXT.match(t) for t in texts) and stage in (1, 2):
        advice.append(
            "Every rank must issue the same collectives in the same order. Under stages 1 and 2 the forward issues "
            "none: besides the gradient reduction and the parameter gathers of the optimizer step, these come from "
            "code that runs on some ranks only, or a different number of times per rank (self.log(..., "
            "sync_dist=True), self.all_gather, a callback or metric that communicates). Run it on every rank alike."
        )
    elif any(_COLLECTIVE_TEXT.match(t) for t in texts):
        advice.append(
            "Under stage 3 every rank must run the same submodules in the same order (a data-dependent branch, a "
            "mixture-of-experts layer, a forward under torch.no_grad() on some ranks only, or a generation loop "
            "that stops early on one rank breaks this). Run the same modules on every rank (e.g. call unused "
            "experts on an empty batch; for transformers' model.generate(...), pass synced_gpus=True), make the "
            "branch depend on all ranks, or use stage 1 or 2, which handle it."
        )
    if any("save_checkpoint" in t for t in texts):
        advice.append(
            "trainer.save_checkpoint is a collective under lightning_zero (every rank writes its part): call it on "
            "every rank, not under `if trainer.is_global_zero` (ModelCheckpoint already does this right)."
        )
    # A gather outside a step while another rank is elsewhere: perhaps a generation loop in a hook (stage 3 only).
    outside = stage in (3, None) and any(_GATHER_OUTSIDE_STEP.match(t) for t in texts)
    if outside:
        advice.append(GENERATION_OUTSIDE_STEP)
    after_training = next((m.group(1) for t in texts if (m := _AFTER_TRAINING_TEXT.search(t)) is not None), None)
    if after_training is not None:
        advice.append(
            f"This collective was issued in {after_training}, which runs once the training loop has ended, on some "
            "ranks only: the other ranks had gone on (their line above says where). Training itself ran the same "
            f"steps on every rank. Run that code in {after_training} on every rank alike; to act on one rank only "
            "(print, write a file), first do the collective part on every rank, then the rest under "
            "`if trainer.is_global_zero`."
        )
    if (
        uneven is None
        and not generation
        and not broadcast
        and not (outside and not any(t.startswith("start training step") for t in texts))
        and after_training is None
        and any(t.startswith(("start ", "teardown")) for t in texts)
        and not any("save_checkpoint" in t for t in texts)
    ):
        advice.append(
            "Every rank must run the same steps: the same number of batches per epoch (with "
            "use_distributed_sampler=False, your sampler must give every rank as many batches, e.g. "
            "DistributedSampler(drop_last=True)), and the same trainable parameters (freeze and unfreeze on every "
            "rank alike)."
        )
    if any(t.startswith(("barrier", "broadcast")) for t in texts):
        advice.append("Barriers and broadcasts must be reached by every rank.")
    return "\n".join(advice)


def _uneven_evaluation(texts: list[str]) -> str | None:
    """The evaluation phase in which some ranks still run batches while others have finished theirs (they are
    elsewhere, or serve the others' gathers), if that is what ``texts`` say; else ``None``."""
    found = [m for t in texts if (m := _IN_EVALUATION.search(t)) is not None]
    if not found:
        return None
    if len(found) == len(texts) and not any(SERVING in t for t in texts):
        return None  # every rank is inside the loop: they run different code, not different numbers of batches
    if all(m.group(2) == "1" for m in found) and any(t.startswith("start training step") for t in texts):
        return None  # one rank starts evaluating while another trains on: different numbers of training batches
    return found[0].group(1)


def _uneven_advice(phase: str, stage: int | None, serving: bool) -> str:
    loader, step = _HOOKS[phase]
    said = (
        f"The ranks have different numbers of {phase} batches: one has finished its {phase} loop while another is "
        "still in it (each rank's line above says where it is)."
    )
    per_batch = (
        "self.log(..., sync_dist=True) with on_step=True, self.all_gather, a callback or metric that communicates on "
        "every batch"
    )
    logging = (
        "Log per-batch values without sync_dist (with on_step=False a synced value is reduced once, after the last "
        "batch, when every rank has finished)"
    )
    fix = (
        f"give every rank as many {phase} batches: keep Lightning's sampler for validation and test (a "
        "DistributedSampler, which pads every rank to the same count), or with use_distributed_sampler=False use "
        f"DistributedSampler(dataset) in {loader}_dataloader(), or set limit_{loader}_batches to the smallest rank's "
        "count."
    )
    if serving:
        return (
            f"{said} Under stage 3 a rank that has finished keeps serving the parameter gathers of the ranks still "
            f"running (the gathers of every forward they run), but no other collective: here a batch also "
            f"issued one ({per_batch}). {logging}, or {fix}"
        )
    if stage == 3:
        return (
            f"{said} Under stage 3 a rank that has finished keeps serving the parameter gathers of the ranks still "
            f"running, from the end of its last batch, but a rank with no {phase} batch at all, or whose {step} takes "
            f"dataloader_iter (its last batch is not known in advance), cannot. Give every rank at least one batch "
            f"(and a {step} without dataloader_iter), or {fix}"
        )
    if stage in (1, 2):
        return (
            f"{said} Stages 1 and 2 run that as DDP does, as long as no batch issues a collective (the ranks that "
            f"have finished never join it): here one did ({per_batch}; or the buffer broadcast of the first batch "
            f"after training, with a rank that has no {phase} batch at all). {logging}, or {fix}"
        )
    return (
        f"{said} Stages 1 and 2 run that as DDP does as long as no batch issues a collective ({per_batch}), and "
        f"under stage 3 a rank that has finished serves the parameter gathers of the others. {logging}, or {fix}"
    )
