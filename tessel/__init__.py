"""tessel: one training system for every parallel layout.

The library's entry points, for a training loop of one's own (README, "Use tessel from your own
training loop"): `tessel.make_mesh`, `tessel.parallelize` and the ParallelJob it returns
(tessel.api). They load on first use, so that `import tessel` (and the CLI behind it) stays free of
torch until a command needs it.

`tessel.parallelize` is the public function, tessel.api.parallelize. The module of the same name
(the layout's apply steps, which the trainer calls) is imported by its full name, `from
tessel.parallelize import ...`, which reads it from sys.modules; the import system would also bind
it as this package's attribute, hiding the function, so the package's class declines that one
binding.
"""

from __future__ import annotations

import importlib
import sys
import types

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


class _Package(types.ModuleType):
    """This package, whose attribute `parallelize` stays the public function (see the docstring)."""

    def __setattr__(self, name: str, value) -> None:
        if name in PUBLIC and isinstance(value, types.ModuleType):
            return  # the import system binding the submodule tessel.parallelize: it stays in sys.modules
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
