"""Checkpoints: layout-independent, atomic, checksummed, validated, owned by their run."""
