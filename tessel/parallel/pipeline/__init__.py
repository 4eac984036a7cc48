"""Pipeline parallelism, one module per concept; importing this package imports nothing heavy.

- schedules: GPipe, 1F1B, interleaved 1F1B and the zero-bubble ZB-H1, ZB-H2, ZBV as
  per-rank Action lists (torch-free; the planner reads the same lists); action: one
  entry of a list; zero_bubble: the zero-bubble schedules' compute orders
- split_backward: a backward as B (the input's gradient) and W (the weights'), for
  the zero-bubble schedules; split_plan: where it cuts a graph, found once per shape of graph
- partition: stage layouts, and a stage as the model with the modules it does not own removed
- comm: the point-to-point messages between stages
- executor: runs this rank's Action list on its chunks (the step's typed StepState)
- grad_sync: dp per chunk, ZeRO over all chunks, the tied embedding's sum
- recorder, clock, saved: the step's bubble, saved-activation peak, trace and Gantt chart
- aux: MoE router losses back-propagated on their own stage (a StageLoss per chunk; a loss that spans
  stages brings its own: tessel.parallel.expert.cross_stage)
- runner: the Runner the trainer calls, composed of the above (spec: what it runs)
- apply: the apply step tessel.apply calls (layout, chunks) and the runner built from what the steps hand on
"""
