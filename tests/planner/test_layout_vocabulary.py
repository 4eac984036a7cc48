"""One vocabulary for a layout (issue 32): the planner's Layout is a projection of the recipe with the
recipe's names; short keys live only in tessel.planner.layout.ALIASES, resolved at parsing."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from tessel.config import ParallelConfig, TrainConfig
from tessel.planner.layout import ALIASES, CHOICES, KEY_HELP, Layout, parse_fix, parse_layout

ROOT = Path(__file__).resolve().parents[2] / "tessel"
LAYOUT_FIELDS = [f.name for f in dataclasses.fields(Layout)]
# ParallelConfig's fields the planner does not choose: a Layout has none of them (tessel.planner.layout.config_layout)
NOT_PLANNED = {"allow_async", "vertical_sync", "pp_layout", "pp_balance", "dp_split", "dp_shares", "bucket_mb",
               "dp_algorithm", "dp_arch", "ps_mode", "ps_staleness", "ps_servers", "rank_order", "zero_reduce_dtype"}
SHORT = {"zero", "mb", "m", "ga", "v", "sp", "rc", "param_dtype"}


def _schema_field(name):
    return ParallelConfig.model_fields.get(name) or TrainConfig.model_fields.get(name)


def test_layout_fields_are_config_fields_with_the_config_defaults():
    """Every Layout field is parallel.<name> or train.<name> with the same default; micro_batch alone is
    derived (train.global_batch over the batch shards, accumulation and micro-batches)."""
    for name in LAYOUT_FIELDS:
        if name == "micro_batch":
            continue
        field = _schema_field(name)
        assert field is not None, f"Layout.{name} is no config field"
        assert getattr(Layout(), name) == field.default, name


def test_every_parallel_knob_is_a_layout_field_or_named_as_not_planned():
    assert set(ParallelConfig.model_fields) == (set(LAYOUT_FIELDS) & set(ParallelConfig.model_fields)) | NOT_PLANNED
    assert not NOT_PLANNED & set(LAYOUT_FIELDS)
    assert set(Layout().parallel_fields()) == set(LAYOUT_FIELDS) - {"micro_batch", "grad_accum"}


def test_help_and_choices_come_from_the_schema():
    for name in LAYOUT_FIELDS:
        if name != "micro_batch":
            assert KEY_HELP[name] == _schema_field(name).description
    assert CHOICES["schedule"] == ParallelConfig.model_fields["schedule"].annotation.__args__
    assert set(CHOICES) == {"schedule", "recompute", "zero_param_dtype", "tp_mode", "cp_mode"}


def test_aliases_resolve_at_parsing_to_the_long_names():
    assert set(ALIASES) == SHORT and set(ALIASES.values()) <= set(LAYOUT_FIELDS)
    short = "dp=2,pp=2,zero=1,mb=2,m=4,ga=2,v=2,param_dtype=fp32,rc=full"
    long = ("dp=2,pp=2,zero_stage=1,micro_batch=2,micro_batches=4,grad_accum=2,virtual_stages=2,"
            "zero_param_dtype=fp32,recompute=full")
    assert parse_layout(short) == parse_layout(long)
    assert parse_fix("tp=2,sp=1") == {"tp": 2, "sequence_parallel": True}


def _layout_receiver(node: ast.AST, annotated: set[str]) -> bool:
    """A name that holds a Layout in tessel's code: lay, lay2, lay_x, layout, given, a parameter annotated
    Layout, or an attribute .layout (an estimate's)."""
    if isinstance(node, ast.Name):
        return bool(re.fullmatch(r"lay(\d*|_\w+)|layout|given", node.id)) or node.id in annotated
    return isinstance(node, ast.Attribute) and node.attr == "layout"


def _short_reads(source: str, where: str) -> list[str]:
    tree = ast.parse(source)
    annotated = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)
                 and isinstance(a.annotation, ast.Name) and a.annotation.id == "Layout"}
    imports_layout = any(isinstance(n, ast.ImportFrom) and any(a.name == "Layout" for a in n.names)
                         for n in ast.walk(tree))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in SHORT and _layout_receiver(node.value, annotated):
            found.append(f"{where}:{node.lineno}: .{node.attr}")
        if isinstance(node, ast.Call):
            func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            # replace() on anything in a module that imports Layout: its receivers have many names (p, base)
            on_layout = func == "Layout" or (func == "replace" and (imports_layout or node.args and
                                                                    _layout_receiver(node.args[0], annotated)))
            found += [f"{where}:{node.lineno}: {k.arg}=" for k in node.keywords
                      if on_layout and k.arg in SHORT]
    return found


def test_no_module_reads_a_layout_knob_by_a_short_name():
    """Outside the config package and the alias table (tessel/planner/layout.py's ALIASES), no tessel module
    reads or sets a Layout's knob by a short name."""
    files = [p for p in ROOT.rglob("*.py") if "config" not in p.relative_to(ROOT).parts[:1]]
    assert len(files) > 100
    found = [hit for p in files for hit in _short_reads(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))]
    assert not found, found


@pytest.mark.parametrize("source", ["lay.zero", "x.layout.mb", "Layout(m=2)", "replace(lay, ga=2)",
                                    "from tessel.planner.layout import Layout\nreplace(p, sp=True)"])
def test_the_scan_sees_a_short_read(source):
    assert _short_reads(source, "probe")
