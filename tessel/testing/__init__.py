"""Harnesses that only tests and benchmarks import: the multi-node network emulator, the dry run at
scale, measured activation peaks, a tp grid's traffic recorder. Nothing else in tessel imports it."""
