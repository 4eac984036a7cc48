"""The config as a package (issue 32): torch-free, its cross-section rules in one file per strategy, each a
list of Rule entries that tessel.config.check runs in one fixed order."""

import importlib
import pkgutil
import subprocess
import sys

import pytest

import tessel.config.rules
from tessel.config import ConfigError, build_config
from tessel.config.check import ORDER
from tessel.config.rule import Rule, check_rules


def test_import_loads_neither_torch_nor_transformers():
    code = "import sys, tessel.config; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "[]"


def _rule_lists(module) -> dict[str, list]:
    return {k: v for k, v in vars(module).items()
            if isinstance(v, list) and v and all(isinstance(r, Rule) for r in v)}


def test_every_rule_of_every_rule_file_is_checked_once():
    ordered = [id(rule) for rules in ORDER for rule in rules]
    assert len(ordered) == len(set(ordered))
    names = [m.name for m in pkgutil.iter_modules(tessel.config.rules.__path__)]
    assert len(names) >= 10
    for name in names:
        module = importlib.import_module(f"tessel.config.rules.{name}")
        assert any(module.RULES is rules for rules in ORDER), name
        for list_name, rules in _rule_lists(module).items():
            if (name, list_name) == ("data", "TOKENIZER"):
                continue  # a DataConfig's rules (check_tokenizer), lifted into data.RULES by on_part
            assert all(id(r) in set(ordered) for r in rules), f"{name}.{list_name}"


def test_the_first_broken_rule_is_reported_with_its_field_and_message():
    rules = [Rule("a.x", lambda c: c["x"] > 0, "must be positive"),
             Rule(lambda c: "a.y", lambda c: c["y"] > 0, lambda c: f"({c['y']}) must be positive",
                  when=lambda c: c["x"] > 1)]
    check_rules(rules, {"x": 1, "y": -1})  # the second rule does not apply
    with pytest.raises(ConfigError) as err:
        check_rules(rules, {"x": 2, "y": -1})
    assert (err.value.field, err.value.message) == ("a.y", "(-1) must be positive")
    with pytest.raises(ConfigError, match="parallel.rank_order"):
        build_config({"parallel": {"rank_order": ["tp", "tp", "dp", "ep", "cp"]}})
