"""ZeRO: optimizer state, gradients and parameters sharded over the data-parallel ranks."""
