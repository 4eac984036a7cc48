"""Pipeline parallelism, one module per concept; importing this package imports nothing heavy.

- schedules: the schedules as data (torch-free; the planner reads them too)
- partition: stage layouts, and a stage as the model with the modules it does not own removed
- comm: the stages' point-to-point messages
- runner: the Runner the trainer calls, composed of the pieces below
- pipeline_parallel: the apply step tessel.parallelize calls (layout, chunks, runner)
"""
