"""Choose a parallel layout from a cost model, and simulate it.

cluster (hardware presets, or the Cluster tessel.calibrate measured on "this
machine") + model_spec (the reference GPT's sizes) + layout (dp, tp, pp, ep,
ZeRO, micro-batching) -> cost (FLOPs, memory, alpha-beta communication,
bubble) -> search (rank what fits) and simulate (discrete events); fit: does a
recipe's layout fit a memory budget. A pure cost model: nothing here imports
torch, the trainer, the CLI or tessel.calibrate, nor measures or spawns
anything (pyproject.toml's import contracts, tests/test_layers.py).
"""
