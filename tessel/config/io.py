"""Recipes in and out: a TOML file or a dict, `--set section.field=value` overrides, and a config written back
as TOML. Every recipe is validated by the schema (tessel.config.schema), then by the cross-section rules
(tessel.config.check), before anything is spawned.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomllib
from pydantic import ValidationError

from tessel.config.check import check_layout
from tessel.config.schema import Config
from tessel.errors import ConfigError


def parse_override(text: str) -> tuple[list[str], Any]:
    """'parallel.dp=2' -> (['parallel', 'dp'], 2); values are parsed as TOML."""
    if "=" not in text:
        raise ConfigError(text, "an override must look like section.field=value")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is a string: --set data.source=synthetic
    return key.strip().split("."), value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(".".join(path), f"'{part}' is not a section")
        node[path[-1]] = value
    return raw


def _first_error(err: ValidationError) -> ConfigError:
    e = err.errors()[0]
    field = ".".join(str(x) for x in e["loc"]) or "config"
    msg = e["msg"]
    if e["type"] == "extra_forbidden":
        msg = "unknown key"
    if e["type"] == "value_error" and msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
        head, _, rest = msg.partition(" ")
        if head.endswith(":") and "." in head:  # "model.hf_config: why": the field, then the message
            field, msg = head[:-1], rest
        elif "." in head:
            field = head  # the validator named a deeper field itself
    return ConfigError(field, msg)


def build_config(raw: dict, overrides: list[str] = ()) -> Config:
    raw = apply_overrides(dict(raw), list(overrides))
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as err:
        raise _first_error(err) from None
    check_layout(cfg)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("recipe", f"no such file: {path}")
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as err:
            raise ConfigError("recipe", f"{path} is not valid TOML: {err}") from None
        except UnicodeDecodeError as err:
            raise ConfigError("recipe", f"{path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
        except OSError as err:
            raise ConfigError("recipe", f"cannot read {path}: {err.strerror or err}") from None
    return build_config(raw, overrides)


def to_toml(cfg: Config, exclude_defaults: bool = False) -> str:
    """Write a config back as a recipe (used by `tessel plan --out`); exclude_defaults: only the fields that
    differ from their defaults (`tessel launch`'s frozen recipes)."""
    lines = []
    for section, body in cfg.model_dump(exclude_none=True, exclude_defaults=exclude_defaults).items():
        lines.append(f"[{section}]")
        for key, value in body.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)
