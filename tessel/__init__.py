"""tessel: one training system for every parallel layout.

The library's entry points, for a training loop of one's own (README, "Use tessel from your own
training loop"): `tessel.make_mesh`, `tessel.parallelize` and the ParallelJob it returns
(tessel.api). They load on first use, so that `import tessel` (and the CLI behind it) stays free of
torch until a command needs it.
"""

from __future__ import annotations

import importlib

PUBLIC = {"parallelize": "tessel.api", "ParallelJob": "tessel.api", "make_mesh": "tessel.mesh", "Mesh": "tessel.mesh",
          "Layout": "tessel.planner.layout", "ConfigError": "tessel.errors"}
__all__ = sorted(PUBLIC)


def __getattr__(name: str):
    """The public names, imported on first use (PEP 562): their modules pull in torch."""
    if name not in PUBLIC:
        raise AttributeError(f"module 'tessel' has no attribute {name!r}")
    value = vars(importlib.import_module(PUBLIC[name]))[name]
    globals()[name] = value  # once bound, Python finds it without calling here again
    return value
