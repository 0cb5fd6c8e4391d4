"""Side-by-side benchmarks of lightning_zero against DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed.

See ``benchmarks/README.md``; the entry point is ``python -m benchmarks.run``.
"""
