"""Tensor parallelism (Megatron 1D) and sequence parallelism: layers and their collectives."""
