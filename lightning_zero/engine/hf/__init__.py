"""Hugging Face checkpoints in the engine: weight files read a slice at a time (``weight_files``), pretrained weights
read into each rank's shards at setup (``weights``), and a sharded model written as a Hugging Face checkpoint by every
rank at once (``export``, peft's adapters and merged models in ``peft_export``). The user's functions
(``from_pretrained``, ``load_weights``, ``export_pretrained``) are in ``lightning_zero/pretrained.py``.

Imports ``engine.core``, ``engine.io``, ``engine.errors`` and torch; safetensors and peft only inside the functions
that use them.
"""
