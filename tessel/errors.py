"""The two kinds of error a user sees as one line, without a traceback.

- ConfigError: a bad input (a recipe field, a flag, a file), found before any
  process starts where it can be; the CLI exits 2 naming the field.
- FatalError: a deterministic failure that a restart would only repeat (disk
  full, a bad input found late); the rank reports it in one line and the
  launcher does not restart the run (tessel.commands.launch).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A recipe broke a rule. `field` is the dotted path of the culprit."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class FatalError(RuntimeError):
    """A deterministic failure that a restart would only repeat (disk full, a bad input found late)."""
