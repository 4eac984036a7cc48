"""Command-line arguments are checked with the same error as recipe fields: `field` is then the flag."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tessel.errors import ConfigError


def at_least(field: str, value: int | None, low: int) -> None:
    """A count flag below its minimum (None means not given: its default applies)."""
    if value is not None and value < low:
        raise ConfigError(field, f"must be at least {low} (got {value})")


def output_file(field: str, path: str | Path) -> None:
    """An output path is checked before the work that fills it: not a folder, and its nearest
    existing ancestor a folder we can write in. Writing is tried (a scratch file, removed at once)
    because os.access answers yes to root even where nothing can be created, such as /proc."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(field, f"{path} is a folder; give a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(field, f"cannot write {path}: permission denied")
    folder = next(p for p in path.absolute().parents if p.exists())
    if not folder.is_dir():
        raise ConfigError(field, f"cannot write {path}: {folder} is not a folder")
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as err:
        reason = f"nothing can be created in {folder} ({err.strerror})"
        raise ConfigError(field, f"cannot write {path}: {reason}") from None

