"""Third-party models in tiny configurations (random init, random data, no downloads) for the tests.

GPT-2, Llama, BERT, OPT, ResNet and ViT come from Hugging Face ``transformers``, and a GPT from LitGPT
(both in the ``models`` extra). ResNet-18-style (BatchNorm) and ViT models are transformers'
implementations, not torchvision's or timm's: the registry's torchvision wheel for torch 2.13 is
linked against the CUDA build of torch, and with the CPU build its import fails and takes
``import lightning`` down with it (timm requires torchvision). transformers' ``ResNetModel`` and
``ViTModel`` are the same architectures.

``RealModelNet(name)`` trains one of them through a ``Trainer``: built in ``configure_model`` (so that
stage 3 builds it on the meta device by default), next-token or class cross-entropy, AdamW.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ, IMAGE, CLASSES = 64, 8, 16, 5
LANGUAGE_MODELS = ("gpt2", "llama", "bert", "opt", "litgpt")
NAMES = (*LANGUAGE_MODELS, "resnet", "vit")


def build(name: str, layers: int = 2, width: int = 32) -> nn.Module:
    """A tiny ``name`` model with its library's own initialization (call under a seed)."""
    if name == "litgpt":
        from litgpt import GPT, Config

        return GPT(Config(n_layer=layers, n_embd=width, n_head=4, padded_vocab_size=VOCAB, block_size=SEQ))
    import transformers as tf

    heads, hidden = 4, 2 * width
    if name == "gpt2":
        config = tf.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=VOCAB, n_positions=SEQ)
        config.bos_token_id = config.eos_token_id = 0  # inside the tiny vocabulary (no warning)
        return tf.GPT2LMHeadModel(config)
    if name == "llama":
        return tf.LlamaForCausalLM(
            tf.LlamaConfig(
                num_hidden_layers=layers,
                hidden_size=width,
                num_attention_heads=heads,
                num_key_value_heads=2,
                intermediate_size=hidden,
                vocab_size=VOCAB,
                max_position_embeddings=SEQ,
                bos_token_id=0,
                eos_token_id=1,
            )
        )
    if name == "bert":
        return tf.BertForMaskedLM(
            tf.BertConfig(
                num_hidden_layers=layers,
                hidden_size=width,
                num_attention_heads=heads,
                intermediate_size=hidden,
                vocab_size=VOCAB,
                max_position_embeddings=SEQ,
            )
        )
    if name == "opt":
        return tf.OPTForCausalLM(
            tf.OPTConfig(
                num_hidden_layers=layers,
                hidden_size=width,
                num_attention_heads=heads,
                ffn_dim=hidden,
                vocab_size=VOCAB,
                max_position_embeddings=SEQ,
                word_embed_proj_dim=width,
                bos_token_id=0,
                eos_token_id=1,
                pad_token_id=2,
            )
        )
    if name == "resnet":
        config = tf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
        config.num_labels = CLASSES
        return tf.ResNetForImageClassification(config)
    if name == "vit":
        return tf.ViTForImageClassification(
            tf.ViTConfig(
                image_size=IMAGE,
                patch_size=8,
                hidden_size=width,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                intermediate_size=hidden,
                num_labels=CLASSES,
            )
        )
    raise ValueError(name)


def dataset(name: str, n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    if name in LANGUAGE_MODELS:
        tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return TensorDataset(torch.randn(n, 3, IMAGE, IMAGE, generator=g), torch.randint(0, CLASSES, (n,), generator=g))


def logits(name: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if name == "litgpt":
        return model(x)
    if name in LANGUAGE_MODELS:
        return model(input_ids=x).logits
    return model(pixel_values=x).logits


class RealModelNet(L.LightningModule):
    """Trains ``build(name)``, created in ``configure_model``."""

    def __init__(self, name: str, batch_size: int = 2, checkpointing: str | None = None) -> None:
        super().__init__()
        self.name = name
        self.batch_size = batch_size
        self.checkpointing = checkpointing  # transformers' activation checkpointing: "reentrant", "non-reentrant"
        self.model: nn.Module | None = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build(self.name)
            if self.checkpointing is not None:
                reentrant = {"reentrant": True, "non-reentrant": False}[self.checkpointing]
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        assert self.model is not None
        out = logits(self.name, self.model, x)
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(self.name, 6 * self.batch_size), batch_size=self.batch_size)  # 3 steps on 2 ranks


def save_pretrained(model: Any, folder: Any, safe_serialization: bool = True, max_shard_size: str = "5GB") -> None:
    """``model.save_pretrained(folder, ...)`` as transformers 4 writes it, with every transformers: transformers 5
    writes safetensors only (it dropped ``safe_serialization``, and loads ``pytorch_model.bin`` still), so the
    ``.bin`` layouts (``pytorch_model.bin``, or ``pytorch_model-0000k-of-0000n.bin`` and their index) are made here
    from what it wrote, the same tensors under the same names, split at ``max_shard_size`` as it splits them."""
    import json
    from pathlib import Path

    import transformers
    from safetensors.torch import load_file

    if safe_serialization or int(transformers.__version__.split(".")[0]) < 5:
        model.save_pretrained(folder, safe_serialization=safe_serialization, max_shard_size=max_shard_size)
        return
    folder = Path(folder)
    model.save_pretrained(folder)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("model*.safetensors")):
        tensors.update(load_file(file))
        file.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    limit = float(max_shard_size.upper().replace("GB", "e9").replace("MB", "e6").replace("KB", "e3").rstrip("B"))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    if len(shards) == 1:
        torch.save(shards[0], folder / "pytorch_model.bin")
        return
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        name = f"pytorch_model-{number:05d}-of-{len(shards):05d}.bin"
        torch.save(shard, folder / name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))
