"""What user code asks of the whole model while the Trainer's strategy holds it sharded: its parameters gathered,
the global gradient norm, a Hugging Face export, and the memory a rank holds against the estimate.

Each is a collective over the shards (``memory_report`` excepted), called from a ``LightningModule`` or callback
hook on every rank; the weight-averaging callbacks get ``gathered_parameters`` by themselves (see [Note: callbacks
that need full parameters] in ``strategies/callbacks.py``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_zero.driver.config import ZeROConfig
from lightning_zero.driver.driver import ZeRODriver
from lightning_zero.engine.sharded_model import ShardedModel
from lightning_zero.strategies.memory_report import MemoryReport, memory_report


class FullModelAccess:
    """Mixed into ``ZeROStrategy`` (which provides the attributes below): the whole model, seen from the shards.

    Example::

        class ZeROStrategy(ZeROOptions, EvaluationSteps, FullModelAccess, ..., ParallelStrategy): ...
    """

    driver: ZeRODriver
    config: ZeROConfig
    sharded_model: ShardedModel
    model: Module | None
    lightning_module: Any
    optimizers: list[Optimizer]
    precision_plugin: Any
    num_processes: int
    num_nodes: int
    global_rank: int

    @property
    def unwrapped_optimizers(self) -> list[Optimizer]:
        return [unwrap_optimizer(o) for o in self.optimizers]

    def gathered_parameters(self, module: Module | None = None, writable: bool = True) -> AbstractContextManager:
        """A context in which the parameters of ``module`` (default: the whole ``LightningModule``) hold their full
        values, in the master dtype, as under ``DDPStrategy``; with ``writable`` (default), what user code writes
        into them is kept. Outside a forward, a stage-3 parameter gathers its unit for each read and refuses
        writes (see ``docs/troubleshooting.md``): this context gathers once and keeps writes. A collective: call
        it on every rank. Lightning's weight-averaging callbacks get this automatically; ``module.state_dict()``
        gathers by itself.

        Example::

            def on_train_epoch_end(self):
                with self.trainer.strategy.gathered_parameters(self.encoder):
                    self.log("encoder_norm", torch.cat([p.flatten() for p in self.encoder.parameters()]).norm())
        """
        return self.driver.gathered_parameters(module, writable)

    def grad_norm(self, optimizer: Optimizer | None = None, norm_type: float = 2.0) -> Tensor:
        """The global norm of the current (sharded) gradients; call it on every rank.

        Lightning's ``grad_norm`` utility reads ``param.grad`` of the module, which ZeRO frees; use
        this instead, e.g. in ``on_before_optimizer_step``::

            self.log("grad_norm", self.trainer.strategy.grad_norm())
        """
        optimizers = [unwrap_optimizer(optimizer)] if optimizer is not None else self.unwrapped_optimizers
        norms = [self.sharded_model.grad_norm(o, norm_type) for o in optimizers]
        if len(norms) == 1:
            return norms[0]
        return torch.linalg.vector_norm(torch.stack(norms), norm_type)

    def save_pretrained(self, module: Module, path: str | Path, merged: bool = False) -> None:
        """Write ``module`` (the transformers model the ``LightningModule`` holds, or any part of it) to the folder
        ``path`` as a Hugging Face checkpoint that plain ``from_pretrained`` loads: sharded safetensors with their
        index and the model's ``config.json``, each rank writing the tensors dealt to it, never the whole model on
        one rank (see [Note: writing a Hugging Face checkpoint] in ``engine/hf/export.py``). The files
        replace the weights the folder held, if any: a crash or a failure leaves it read as the earlier checkpoint or
        as the new one, and files that are not weights (a README, a tokenizer) are kept (see [Note: save_pretrained
        into a folder]). A collective: call it on every rank. When the module is not sharded (after ``fit``),
        rank 0's ``module.save_pretrained`` writes the files, put in place the same way.

        A peft ``PeftModel`` is saved as peft saves it: its adapter (``adapter_model.safetensors``,
        ``adapter_config.json``), which ``PeftModel.from_pretrained(base, path)`` loads, or with ``merged=True``
        (LoRA) the model with the adapter merged in, which plain ``from_pretrained`` loads (see [Note: saving a
        peft model] in ``engine/hf/peft_export.py``).

        Example::

            def on_train_end(self):
                self.trainer.strategy.save_pretrained(self.model, "finetuned")
        """
        assert self.model is not None
        self.driver.save_pretrained(self.model, module, path, merged)

    def memory_report(self) -> MemoryReport:
        """The memory ``lightning_zero.estimate_memory`` predicts for this model, world size, precision and
        options, next to the bytes this rank holds now (``print(strategy.memory_report())``). Rank 0 logs it
        at setup. Call after setup, on any rank (no collective).

        Example::

            class Report(Callback):
                def on_train_batch_end(self, trainer, *args):
                    if trainer.global_step == 1:
                        print(trainer.strategy.memory_report())
        """
        assert self.lightning_module is not None
        precision = self.precision_plugin
        return memory_report(
            self.lightning_module,
            self.sharded_model,
            self.config,
            precision.precision,
            precision.is_mixed,
            self.unwrapped_optimizers,
            self.num_processes,
            self.num_nodes,
            self.global_rank,
        )


def unwrap_optimizer(optimizer: Optimizer | LightningOptimizer) -> Optimizer:
    """The user's optimizer inside the ``LightningOptimizer`` the Trainer hands the strategy."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
