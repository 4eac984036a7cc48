"""`tessel support` and docs/support.md: the matrix regenerated from the installed transformers, tessel's rules and
the parity sweep's record equals the committed file (stale: run `tessel support --out docs/support.md`), and a
cell's word follows the record (trains / fails parity / untested)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from tessel.commands.cli import app
from tessel.commands.support import Cell, accepted_cell, parity_record

ROOT = Path(__file__).resolve().parents[2]


def test_docs_support_md_is_what_tessel_support_writes(tmp_path):
    out = tmp_path / "support.md"
    result = CliRunner().invoke(app, ["support", "--out", str(out)])
    assert result.exit_code == 0, result.output
    fresh, committed = out.read_text(), (ROOT / "docs" / "support.md").read_text()
    assert fresh == committed, "docs/support.md is stale: run `tessel support --out docs/support.md`"
    # the README's strategy x family table is the page's summary (its rows, below the header and the rule)
    summary = fresh.split("## Summary\n")[1].split("## Every family")[0].strip().split("\n", 2)[2]
    assert summary in (ROOT / "README.md").read_text(), "the README's family table is stale: copy docs/support.md's"
    # every cell the matrix says trains rests on a passing row of the record, and each failing row shows
    record = parity_record()
    assert "**trains**" not in fresh or any(r["status"] == "pass" for r in record.values())
    failing = [cell for cell, row in record.items() if row["status"] != "pass"]
    assert all(cell.split("/")[0] in fresh for cell in failing)


def test_a_cell_says_what_the_record_measured():
    assert accepted_cell(None) == Cell("accepted, untested")
    assert accepted_cell({"status": "pass", "loss_diff": 1e-7, "weight_diff": 1e-6}) == Cell("trains")
    off = accepted_cell({"status": "fail", "loss_diff": 0.25, "weight_diff": 1e-3})
    assert off.status == "accepted, fails parity" and "2.5e-01" in off.reason and "1.0e-03" in off.reason
    crashed = accepted_cell({"status": "error", "error": "RuntimeError: shapes"})
    assert crashed == Cell("accepted, fails parity", "RuntimeError: shapes")


def test_a_record_of_another_transformers_says_nothing(tmp_path):
    old = tmp_path / "record.json"
    old.write_text(json.dumps({"transformers": "0.0.1", "cells": {"llama/dp": {"status": "pass"}}}))
    assert parity_record(old) == {}
    assert parity_record(tmp_path / "missing.json") == {}


def test_tiny_config_shrinks_sizes_under_the_config_classes_own_names():
    from tessel.commands.support import SIZES, tiny_config
    # ERNIE-4.5-MoE stores num_experts and num_experts_per_tok as moe_num_experts and moe_k (its attribute_map):
    # left at 64 experts top-6, its router's 6th and 7th scores tied within one fp32 ulp, a choice rounding made
    ernie = tiny_config("ernie4_5_moe")
    assert (ernie["moe_num_experts"], ernie["moe_k"]) == (SIZES["num_experts"], SIZES["num_experts_per_tok"])
    # Gemma 4's full-attention layers' head_dim lives in per_layer_config (512 from global_head_dim): shrunk too
    gemma4 = tiny_config("gemma4_text")
    assert {layer["head_dim"] for layer in gemma4["per_layer_config"].values()} == {SIZES["head_dim"]}
