"""The parts of ``ShardedModel`` (``engine/sharded_model.py``), one concept each: the optimizers' steps on the
shards, the gradients' norms and clipping, rank 0's buffers, what fits at the end of a run, and the memory held."""
