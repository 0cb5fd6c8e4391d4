"""Files: crash-safe writes and commits (``files``), reads that refuse hostile or corrupt files (``safe_read``,
``checksums``), the ``torch.save`` format written in parallel (``torch_file``) and pretrained weight files
(``weight_files``, their safetensors headers checked by ``safetensors_header``; ``weight_folder`` replaces those of
a Hugging Face checkpoint folder).

Imports only ``engine.errors`` and torch; knows nothing about shards.
"""
