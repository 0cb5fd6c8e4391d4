"""Files: crash-safe writes and commits (``files``), reads that refuse hostile or corrupt files (``safe_read``,
``checksums``), the ``torch.save`` format written in parallel (``torch_file``), safetensors headers checked
(``safetensors_header``), the weight files of a Hugging Face checkpoint folder replaced (``weight_folder``), and the
ranks that take part in a save or a load (``ranks``).

Imports only ``engine.errors`` and torch; knows nothing about shards.
"""
