"""What changes under DDP and FSDP2: the strategy checks, rank-identical randomness, and the sharded
twins of the operations in :mod:`plasticity_callbacks.ops` (each acting on a ``DTensor`` shard)."""
