"""The weights of a Hugging Face checkpoint folder replaced by a new set of files, in an order that never lets a
loader read a mix of the two.

[Note: replacing a Hugging Face checkpoint]
``from_pretrained(folder)`` reads the first of ``model.safetensors``, ``model.safetensors.index.json`` (with the
shards it names), ``pytorch_model.bin`` and ``pytorch_model.bin.index.json`` that the folder holds (the last two
first with ``use_safetensors=False``). So shards and an index written beside an earlier ``model.safetensors``
are never read: the earlier weights are. transformers' own ``save_pretrained`` removes the shards of its own
naming pattern that the new save does not write; a save here removes, besides those, every file of those four
layouts that the new save does not write (``LOADED_NAMES``, ``SHARD_NAME``), so that every loader, with any
``use_safetensors``, reads the new weights. Every other file is left as it is: a README, a tokenizer, adapters,
a variant such as ``model.fp16.safetensors`` (read only when asked for by name), shards of other names.

The new files are written first where no loader looks (a hidden staging folder inside the target: see [Note:
save_pretrained into a folder] in ``engine/hf/export.py``); ``replacement_steps`` then orders the
renames and removals so that after any one of them (a crash, a failure) the folder is read as the earlier
checkpoint, or as the new one:

1. the new ``config.json``, ``generation_config.json``: each one rename, as transformers writes them first too;
2. the new shards, each one rename, then the new index: from here the new checkpoint is read, unless an earlier
   single file is there (``model.safetensors``; ``pytorch_model.bin`` with ``use_safetensors=False``), which
   ``from_pretrained`` still reads first;
3. the earlier files the new save does not write, single files first: removing ``model.safetensors`` is the
   moment the new checkpoint is read where one was there. Then the ``.bin`` index and the earlier shards.

One case has a window in which neither is read: when the folder holds shards under the names the new ones take
(an earlier save at the same world size), its ``model.safetensors.index.json`` is removed before step 2, so that
during the renames the folder is refused (``no file named model.safetensors...``, or read from an earlier single
file still there) instead of read as earlier and new shards under the earlier index. Every step is followed by
an ``fsync`` of the folder, so a power loss keeps their order.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple

from lightning_zero.engine.io.files import fsync_directory

SAFETENSORS_INDEX = "model.safetensors.index.json"
# What from_pretrained reads without a variant, in its order (use_safetensors=False: the last two only).
LOADED_NAMES = ("model.safetensors", SAFETENSORS_INDEX, "pytorch_model.bin", "pytorch_model.bin.index.json")
# The shards of transformers' own naming (``split_torch_state_dict_into_shards``), as its indexes name them.
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors|pytorch_model-\d{5}-of-\d{5}\.bin")
# The order in which earlier files are removed: the single files a loader prefers to any index first, an index
# before the shards it names (so that no index is left naming a removed shard), then the shards.
_REMOVAL_ORDER = ("model.safetensors", "pytorch_model.bin", SAFETENSORS_INDEX, "pytorch_model.bin.index.json")


class Step(NamedTuple):
    """One rename (``source`` into ``target``) or, with ``source=None``, the removal of ``target``."""

    source: Path | None
    target: Path

    def apply(self) -> None:
        if self.source is None:
            self.target.unlink(missing_ok=True)
        else:
            self.target.parent.mkdir(exist_ok=True)  # a subfolder (peft's adapters other than "default")
            os.replace(self.source, self.target)
        fsync_directory(self.target.parent)


def is_weight_file(name: str) -> bool:
    """Whether a file called ``name`` in a checkpoint folder is one that ``from_pretrained`` may read."""
    return name in LOADED_NAMES or SHARD_NAME.fullmatch(name) is not None


def read_by_loader(folder: Path, use_safetensors: bool = True) -> str | None:
    """The file ``from_pretrained(folder)`` reads first (the single file or the index), or ``None``."""
    order = LOADED_NAMES if use_safetensors else LOADED_NAMES[2:]
    return next((name for name in order if (folder / name).is_file()), None)


def replacement_steps(folder: Path, new: dict[str, Path]) -> list[Step]:
    """The renames and removals, in order, that put ``new`` (final name -> the hidden file holding it, beside it in
    ``folder``) in place of the Hugging Face checkpoint ``folder`` holds (see the note above)."""
    present = {child.name for child in folder.iterdir() if child.is_file() or child.is_symlink()}
    configs = sorted(name for name in new if not is_weight_file(name))
    shards = sorted(name for name in new if SHARD_NAME.fullmatch(name))
    rest = [name for name in LOADED_NAMES[::-1] if name in new]  # indexes before single files: see step 2
    steps = [Step(new[name], folder / name) for name in configs]
    if SAFETENSORS_INDEX in present and any(name in present for name in shards):
        steps.append(Step(None, folder / SAFETENSORS_INDEX))
    steps += [Step(new[name], folder / name) for name in [*shards, *rest]]
    stale = [name for name in present if is_weight_file(name) and name not in new]
    order = {name: position for position, name in enumerate(_REMOVAL_ORDER)}
    stale.sort(key=lambda name: (order.get(name, len(order)), name))
    steps += [Step(None, folder / name) for name in stale]
    return steps
