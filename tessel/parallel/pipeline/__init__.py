"""Pipeline parallelism, one module per concept; importing this package imports nothing heavy.

- schedules: GPipe, 1F1B and interleaved 1F1B as per-rank Action lists (torch-free;
  the planner reads the same lists)
- partition: stage layouts, and a stage as the model with the modules it does not own removed
- comm: the point-to-point messages between stages
- executor: runs this rank's Action list on its chunks (the step's typed StepState)
- grad_sync: dp per chunk, ZeRO over all chunks, the tied embedding's sum
- recorder, clock, saved: the step's bubble, saved-activation peak, trace and Gantt chart
- aux: MoE router losses back-propagated on their own stage (a StageLoss per chunk; a loss that spans
  stages brings its own: tessel.parallel.expert.cross_stage)
- runner: the Runner the trainer calls, composed of the above (spec: what it runs)
- pipeline_parallel: the apply step tessel.apply calls (layout, chunks, runner)
"""
