"""Choose a parallel layout from a cost model, and simulate it.

cluster (hardware presets, "this machine") + model_spec (the reference GPT's
sizes) + layout (dp, tp, pp, ep, ZeRO, micro-batching) -> cost (FLOPs, memory,
alpha-beta communication, bubble) -> search (rank what fits) and simulate
(discrete events). probe measures this machine; nothing here imports
torch.distributed at module level or spawns processes unless asked to probe.
"""
