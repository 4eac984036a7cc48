"""train.compile = "model" traces what runs inside the model into its graph (tessel.parallel.compile). ZeRO-3
without a pipeline gathers and frees each block's parameters in hooks on the block (storage resizes, parameter
class switches), which dynamo cannot trace; 'blocks' compiles each block inside those hooks."""

from __future__ import annotations

from tessel.config.rule import Rule

RULES = [
    Rule("train.compile",
         lambda c: c.train.compile != "model" or c.parallel.zero_stage != 3 or c.parallel.pp > 1,
         "'model' would trace ZeRO-3's per-block gathers and frees into the graph; use 'blocks' (each block "
         "compiled, the gathers around it)"),
]
