"""Pretrained weights for a sharded model: ``from_pretrained`` and ``load_weights``, read a shard per rank.

Under stage 3 the model is built on the meta device in ``configure_model`` (or ``fabric.init_module()``)
and materialized already sharded at setup. These two functions fit that: inside such a build they
record where each parameter's values are in the files, and at setup each rank reads only its shards
(see [Note: pretrained weights under meta init] in ``engine/hf/weights.py``). Anywhere else (DDP,
stages 1 and 2 without meta init, a plain script) they load as usual, so one ``configure_model``
serves every strategy.

``export_pretrained`` converts a training checkpoint into a Hugging Face one on one process. These are the user's
functions (``export_pretrained`` reads checkpoints through the driver, which the engine may not import); the
mechanics, shared with the strategies' ``save_pretrained``, are in ``engine/hf/``: ``weight_files.py`` (reading by
the slice), ``weights.py`` (loading under meta init), ``export.py`` and ``peft_export.py`` (writing).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_zero.engine.hf.weight_files import WeightFiles
from lightning_zero.engine.hf.weights import plan_weight_load
from lightning_zero.engine.meta.init_trace import active_recording

# Arguments of ``from_pretrained`` that go to the model's constructor; the others update the config, as there.
_MODEL_ARGUMENTS = ("torch_dtype", "dtype", "attn_implementation", "trust_remote_code")


# What a snapshot of a hub model needs for ``from_pretrained`` (weights, configs, tokenizer files).
_SNAPSHOT_FILES = ["*.json", "*.safetensors", "*.bin", "*.model", "*.txt", "*.py"]


def local_checkpoint(path: str | Path, revision: str | None = None) -> Path:
    """``path`` itself when it exists on disk; otherwise a Hugging Face hub id (``"meta-llama/Llama-3.2-1B"``),
    resolved to its local snapshot with ``huggingface_hub.snapshot_download`` (from the cache when it holds it,
    offline with ``HF_HUB_OFFLINE=1``; every rank resolves the same files)."""
    if Path(path).exists():
        return Path(path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(path), revision=revision, allow_patterns=_SNAPSHOT_FILES))


def from_pretrained(model_class: Any, path: str | Path, **kwargs: Any) -> nn.Module:
    """``model_class.from_pretrained(path, **kwargs)`` that stage 3 can shard without ever building it whole.

    ``model_class`` is a transformers class (``AutoModelForCausalLM``, ``LlamaForCausalLM``, ...); ``path`` a
    local directory written by ``save_pretrained`` (safetensors or ``pytorch_model.bin``, sharded or not) or a hub
    id, resolved to its local snapshot first (``local_checkpoint``).
    While a model is being built on the meta device (``configure_model`` under stage 3's ``meta_init``, or
    ``fabric.init_module()``), the model is built there with its initialization skipped, and each rank reads
    its shards of the weights when the strategy sets the model up; the values equal ``from_pretrained``'s. So do
    the files read where a directory holds several layouts (``WeightFiles.open``) and the dtype (``model_dtype``).
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

    try:  # transformers 5 moved it (and its other initialization helpers) into transformers.initialization
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights

    path = local_checkpoint(path, kwargs.pop("revision", None))
    model_kwargs = {name: kwargs.pop(name) for name in _MODEL_ARGUMENTS if name in kwargs}
    config = kwargs.pop("config", None)
    subfolder = kwargs.pop("subfolder", "")  # where in ``path`` the config and the weights are, as there
    if config is None:
        trust = model_kwargs.get("trust_remote_code", False)
        config, unused = transformers.AutoConfig.from_pretrained(
            path, return_unused_kwargs=True, trust_remote_code=trust, subfolder=subfolder, **kwargs
        )
    else:
        config, unused = copy.deepcopy(config), kwargs  # as from_pretrained: the dtype is recorded in a copy
    if unused:
        raise TypeError(
            f"lightning_zero.from_pretrained does not take {', '.join(sorted(unused))} (not a config attribute); "
            f"it takes the model arguments {', '.join(_MODEL_ARGUMENTS)}, config=..., and config attributes"
        )
    files = WeightFiles.open(Path(path) / subfolder, getattr(config, "transformers_weights", None))
    dtype = model_dtype(model_kwargs.pop("dtype", None), model_kwargs.pop("torch_dtype", None), config, files)
    # transformers' from_config takes it as ``dtype`` since 4.56 (``torch_dtype`` before, deprecated since).
    model_kwargs["dtype" if _transformers_version() >= (4, 56) else "torch_dtype"] = dtype
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
    if model.can_generate() and (Path(path) / subfolder / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(path, subfolder=subfolder)
    model.eval()  # as from_pretrained returns it
    return model


def model_dtype(dtype: Any, torch_dtype: Any, config: Any, files: WeightFiles) -> torch.dtype:
    """The dtype transformers' ``from_pretrained(path, dtype=dtype, torch_dtype=torch_dtype)`` builds the model in,
    with ``config`` updated as it updates it (``_get_dtype`` in transformers' modeling_utils.py).

    ``dtype`` wins where both are given. Neither: torch's default dtype (float32) in transformers 4, which
    records it in the config; ``"auto"`` in transformers 5, which changed that default. ``"auto"``: the dtype the
    config records (``dtype``, or ``torch_dtype`` as older versions write it), else the weights' (the first
    floating-point tensor of the first file), recorded in the config by transformers 5 only. A name
    (``"bfloat16"``) or a ``torch.dtype``: that one, recorded in the config and its sub-configs. A dict: per
    sub-config, ``""`` for the rest (float32 without it).
    """
    requested = dtype if dtype is not None else torch_dtype
    if requested is None:
        requested = "auto" if _transformers_version() >= (5, 0) else torch.get_default_dtype()
    if isinstance(requested, str) and requested == "auto":
        found = _config_dtype(config) or files.weights_dtype() or torch.get_default_dtype()
        if _transformers_version() >= (5, 0):  # which records it in the config as any other dtype
            _set_config_dtype(config, found)
        return found
    if isinstance(requested, dict):
        for sub, value in requested.items():
            if sub and hasattr(config, sub):
                _set_config_dtype(getattr(config, sub), _as_dtype(value))
        main = _as_dtype(requested[""]) if requested.get("") is not None else None
        _set_config_dtype(config, main, sub_configs=False)  # None where the dict has no "", as there
        return main or torch.float32
    main = _as_dtype(requested)
    _set_config_dtype(config, main)
    return main


def _as_dtype(value: Any) -> torch.dtype:
    found = getattr(torch, value, None) if isinstance(value, str) else value
    if not isinstance(found, torch.dtype):
        raise ValueError(
            f"dtype={value!r} is not a dtype: pass a torch.dtype (torch.bfloat16), its name ('bfloat16'), 'auto' "
            "(the checkpoint's dtype) or a dict of them per sub-config, as to from_pretrained"
        )
    return found


def _config_dtype(config: Any) -> torch.dtype | None:
    """The dtype ``config`` records, read without transformers' deprecation warning for ``torch_dtype``."""
    recorded = vars(config).get("dtype", vars(config).get("torch_dtype"))
    if isinstance(recorded, str):
        recorded = getattr(torch, recorded, None)
    return recorded if isinstance(recorded, torch.dtype) else None


def _set_config_dtype(config: Any, dtype: torch.dtype | None, sub_configs: bool = True) -> None:
    """Record ``dtype`` in ``config`` (and its sub-configs) under the attribute its version uses."""
    configs = [config]
    if sub_configs:
        configs += [getattr(config, key) for key in getattr(config, "sub_configs", {}) if hasattr(config, key)]
    for each in configs:
        if each is not None:
            old_name = "torch_dtype" in vars(each) and "dtype" not in vars(each)  # transformers before 4.56
            setattr(each, "torch_dtype" if old_name else "dtype", dtype)


def _transformers_version() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def load_weights(module: nn.Module, path: str | Path) -> nn.Module:
    """Load the weights at ``path`` into ``module`` (all of its parameters; persistent buffers found there too).

    ``path``: a ``.safetensors`` file, a ``torch.save`` of a state dict (LitGPT's ``lit_model.pth``), a
    directory written by ``save_pretrained``, or a hub id (``local_checkpoint``). While ``module`` is being built
    on the meta device (``configure_model`` under stage 3, ``fabric.init_module()``), nothing is read now: each
    rank reads only its shards when the strategy sets the model up. Anywhere else, this is
    ``module.load_state_dict(...)`` with the file's tensors, read whole. Returns ``module``.

    Example::

        def configure_model(self):
            self.model = GPT(Config.from_name("pythia-160m"))
            lightning_zero.load_weights(self.model, "checkpoints/pythia-160m/lit_model.pth")
    """
    path = local_checkpoint(path)
    files = WeightFiles.open(path)
    load = plan_weight_load(module, files, source=str(path))
    trace = active_recording(building=False)  # also after the init_module block, until setup
    if trace is not None and any(p.is_meta for p in module.parameters()):
        trace.weight_loads.append(load)
        return module
    try:
        names = {id(t): name for name, t in [*module.named_parameters(), *module.named_buffers()]}
        entries = [*load.params.items(), *load.buffers.items()]
        state = {names[ident]: files.read_whole(key) for ident, (_, key) in entries if ident in names}
        module.load_state_dict(state, strict=False)
    finally:
        files.close()
    return module


def export_pretrained(
    checkpoint: str | Path, output: str | Path, config: str | Path | Any, model_class: Any = None
) -> Path:
    """Convert a training checkpoint (a sharded directory or a full file, from any stage and world size) into a
    Hugging Face checkpoint in the directory ``output``, offline, on one process: ``model.safetensors`` and the
    model's ``config.json``, which plain ``from_pretrained`` loads. A folder that holds a checkpoint already keeps
    its other files; its weight files of another layout (an index and its shards, ``pytorch_model.bin``) are
    removed once the new file is in place, as ``strategy.save_pretrained`` does.

    ``config``: the model's config, or where to read it (the directory it was fine-tuned from);
    ``model_class``: the transformers class whose parameter names the files must use (default
    ``AutoModelForCausalLM``). The ``LightningModule``'s attribute prefix (``model.``) is found and removed, and a
    weight tied to another is stored once, as ``save_pretrained`` stores it.

    Example::

        lightning_zero.export_pretrained("runs/last.ckpt", "finetuned", config="checkpoints/llama")
        AutoModelForCausalLM.from_pretrained("finetuned")
    """
    import torch
    import transformers

    from lightning_zero.driver.checkpointing import consolidate, save_safetensors
    from lightning_zero.engine.hf.export import replace_checkpoint
    from lightning_zero.engine.io.ranks import Ranks

    model_class = model_class or transformers.AutoModelForCausalLM
    if not isinstance(config, transformers.PretrainedConfig):
        config = transformers.AutoConfig.from_pretrained(config)
    with torch.device("meta"):
        skeleton = model_class.from_config(config) if hasattr(model_class, "from_config") else model_class(config)
    tied = set(getattr(skeleton, "_tied_weights_keys", None) or [])
    groups: dict[int, list[str]] = {}
    for name, param in skeleton.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    stored = [next((n for n in names if n not in tied), names[0]) for names in groups.values()]
    buffers = [name for name in skeleton.state_dict() if name not in {n for g in groups.values() for n in g}]
    state = consolidate(checkpoint)["state_dict"]
    _refuse_peft(state)
    prefix = _prefix_for(state, stored)
    missing = [name for name in stored if prefix + name not in state]
    if missing:
        raise KeyError(
            f"the checkpoint has no {missing[0]!r} (under the prefix {prefix!r}) for {type(skeleton).__name__}: pass "
            "the config of the model that was trained, and its class as model_class"
        )
    tensors = {name: state[prefix + name] for name in stored}
    tensors.update({name: state[prefix + name] for name in buffers if prefix + name in state})
    output = Path(output)

    def write(staging: Path) -> list[str]:
        save_safetensors(tensors, staging / "model.safetensors")
        config.save_pretrained(staging)
        return sorted(child.name for child in staging.iterdir() if child.is_file() and not child.name.startswith("."))

    # Written beside the folder's checkpoint and put in its place as strategy.save_pretrained does: the weight files
    # of an earlier layout (an index and its shards, a pytorch_model.bin) are removed once the new file is in place,
    # so that from_pretrained cannot read them (see [Note: replacing a Hugging Face checkpoint]).
    replace_checkpoint(Ranks(0, 1, lambda value: value), output, write)
    return output


def _refuse_peft(state: dict[str, Any]) -> None:
    """Raise ``ValueError`` for the training checkpoint of a peft ``PeftModel``, saying how to save one."""
    key = next((k for k in state if "base_model.model." in k and (".base_layer." in k or ".lora_" in k)), None)
    if key is None:
        return
    prefix = key[: key.index("base_model.model.")]
    raise ValueError(
        f"the checkpoint holds a peft PeftModel (its keys name peft's layers, such as {key!r}), which "
        "export_pretrained does not convert: save the adapter during the run with "
        "trainer.strategy.save_pretrained(self.model, path) (peft's files; merged=True for the model with the "
        "adapter merged in), or rebuild the PeftModel on one process (peft.get_peft_model(AutoModelForCausalLM"
        ".from_pretrained(base), lora_config)), load into it lightning_zero.consolidate_checkpoint(checkpoint)"
        f"['state_dict'] with the prefix {prefix!r} removed from each key, and call its save_pretrained(path)"
    )


def _prefix_for(state: dict[str, Any], names: list[str]) -> str:
    """The prefix under which the ``LightningModule``'s checkpoint holds the model's ``names`` (``"model."``)."""
    first = names[0]
    for key in state:
        if key.endswith(first) and all(key[: len(key) - len(first)] + n in state for n in names):
            return key[: len(key) - len(first)]
    raise KeyError(f"the checkpoint holds no model whose parameters include {first!r} (keys: {list(state)[:3]} ...)")
