"""Measuring this machine: link probes, the model profile, collective benchmarks, the multi-node emulator."""
