"""train.precision = "fp8" (tessel.parallel.float8): float8 matmuls in the blocks' linear layers, through
torchao's float8 matmul. Where a layout multiplies outside those layers' matmul, the recipe is refused rather
than silently trained in bf16."""

from __future__ import annotations

from tessel.config.rule import Rule

RULES = [
    Rule("train.precision",
         lambda c: c.parallel.tp_mode == "1d" or c.parallel.tp == 1,
         lambda c: f"'fp8' with parallel.tp_mode = '{c.parallel.tp_mode}' is not built: the grid's SUMMA and cube "
                   "layers multiply outside the float8 matmul; use tp_mode '1d' or precision 'bf16'",
         when=lambda c: c.train.precision == "fp8"),
    Rule("train.precision",
         lambda c: c.parallel.dp_arch != "ps",
         "'fp8' is not built for parallel.dp_arch = 'ps' (the parameter server's workers build their model "
         "without the apply steps); use 'bf16'", when=lambda c: c.train.precision == "fp8"),
    Rule("train.precision",
         lambda c: not c.parallel.tp_overlap,
         "'fp8' with parallel.tp_overlap is not built: the overlapped ring multiplies outside the float8 matmul; "
         "use one of them", when=lambda c: c.train.precision == "fp8"),
]
