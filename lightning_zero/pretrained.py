"""Pretrained weights for a sharded model: ``from_pretrained`` and ``load_weights``, read a shard per rank.

Under stage 3 the model is built on the meta device in ``configure_model`` (or ``fabric.init_module()``)
and materialized already sharded at setup. These two functions fit that: inside such a build they
record where each parameter's values are in the files, and at setup each rank reads only its shards
(see [Note: pretrained weights under meta init] in ``engine/pretrained.py``). Anywhere else (DDP,
stages 1 and 2 without meta init, a plain script) they load as usual, so one ``configure_model``
serves every strategy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from lightning_zero.engine.init_trace import active_recording
from lightning_zero.engine.pretrained import plan_weight_load
from lightning_zero.engine.weight_files import WeightFiles

# Arguments of ``from_pretrained`` that go to the model's constructor; the others update the config, as there.
_MODEL_ARGUMENTS = ("torch_dtype", "dtype", "attn_implementation", "trust_remote_code")


def from_pretrained(model_class: Any, path: str | Path, **kwargs: Any) -> nn.Module:
    """``model_class.from_pretrained(path, **kwargs)`` that stage 3 can shard without ever building it whole.

    ``model_class`` is a transformers class (``AutoModelForCausalLM``, ``LlamaForCausalLM``, ...); ``path`` a
    local directory written by ``save_pretrained`` (safetensors or ``pytorch_model.bin``, sharded or not).
    While a model is being built on the meta device (``configure_model`` under stage 3's ``meta_init``, or
    ``fabric.init_module()``), the model is built there with its initialization skipped, and each rank reads
    its shards of the weights when the strategy sets the model up; the values equal ``from_pretrained``'s.
    Anywhere else this is ``model_class.from_pretrained(path, **kwargs)`` itself.

    Example::

        class FineTune(L.LightningModule):
            def configure_model(self):
                self.model = lightning_zero.from_pretrained(AutoModelForCausalLM, "checkpoints/llama-7b")

        L.Trainer(strategy="zero3", devices=8).fit(FineTune())
    """
    trace = active_recording()
    if trace is None:
        return model_class.from_pretrained(path, **kwargs)
    import transformers
    from transformers.modeling_utils import no_init_weights

    model_kwargs = {name: kwargs.pop(name) for name in _MODEL_ARGUMENTS if name in kwargs}
    config = kwargs.pop("config", None)
    if config is None:
        trust = model_kwargs.get("trust_remote_code", False)
        config, unused = transformers.AutoConfig.from_pretrained(
            path, return_unused_kwargs=True, trust_remote_code=trust, **kwargs
        )
    else:
        unused = kwargs
    if unused:
        raise TypeError(
            f"lightning_zero.from_pretrained does not take {', '.join(sorted(unused))} (not a config attribute); "
            f"it takes the model arguments {', '.join(_MODEL_ARGUMENTS)}, config=..., and config attributes"
        )
    files = WeightFiles.open(path)
    with no_init_weights():  # the values come from the files: initializing them would be wasted (and recorded)
        if hasattr(model_class, "from_config"):  # an Auto class
            model = model_class.from_config(config, **model_kwargs)
        else:
            model = model_class._from_config(config, **model_kwargs)
    model.tie_weights()  # as from_pretrained does: under no_init_weights the constructor does not tie them
    load = plan_weight_load(model, files, prefix=getattr(model, "base_model_prefix", ""), source=str(path))
    trace.weight_loads.append(load)
    for module in model.modules():  # as from_pretrained marks what it loaded (transformers >= 5 checks it)
        module._is_hf_initialized = True
    if model.can_generate() and (Path(path) / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    model.eval()  # as from_pretrained returns it
    return model


def load_weights(module: nn.Module, path: str | Path) -> nn.Module:
    """Load the weights at ``path`` into ``module`` (all of its parameters; persistent buffers found there too).

    ``path``: a ``.safetensors`` file, a ``torch.save`` of a state dict (LitGPT's ``lit_model.pth``), or a
    directory written by ``save_pretrained``. While ``module`` is being built on the meta device
    (``configure_model`` under stage 3, ``fabric.init_module()``), nothing is read now: each rank reads only its
    shards when the strategy sets the model up. Anywhere else, this is ``module.load_state_dict(...)`` with the
    file's tensors, read whole. Returns ``module``.

    Example::

        def configure_model(self):
            self.model = GPT(Config.from_name("pythia-160m"))
            lightning_zero.load_weights(self.model, "checkpoints/pythia-160m/lit_model.pth")
    """
    files = WeightFiles.open(path)
    load = plan_weight_load(module, files, source=str(path))
    trace = active_recording()
    if trace is not None and any(p.is_meta for p in module.parameters()):
        trace.weight_loads.append(load)
        return module
    try:
        state = {name: files.read_whole(key) for name, key in {**load.keys, **load.buffers}.items()}
        module.load_state_dict(state, strict=False)
    finally:
        files.close()
    return module
