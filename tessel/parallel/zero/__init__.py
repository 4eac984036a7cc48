"""ZeRO: optimizer state, gradients and parameters sharded over the data-parallel ranks.

Rajbhandari et al. 2020. Start at zero_parallel (the stages, their memory, usage).

- zero_parallel: the entry point, zero_parallel(module, mesh, stage, params, ...)
- engine: ZeroDataParallel, one stage composed of the two pieces below
- gradients: what backward does with gradients (stage 1 all-reduce; 2, 3 reduce-scatter)
- parameters: where parameters live (stages 1, 2 whole; stage 3 gathered around each unit)
- collectives: ZeRO's all-reduce, reduce-scatter and all-gather, named
- flat: the flat layout (buffers cut into equal shards; buckets and units)
- optim: ZeroAdamW, torch's AdamW on the owned shard, from the caller's parameter groups
- checkpoint: ZeRO state saved and loaded as logical whole tensors
- memory: the bytes a rank holds, measured against the memory table
- pipeline: ZeRO under a pipeline (stage 3 gathered once per step; tied embeddings)
"""
