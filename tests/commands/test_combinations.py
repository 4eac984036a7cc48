"""The strategy x strategy matrix (docs/combinations.md, and its table in the README): regenerated from the checks
`tessel train` runs before spawning it equals the committed page and the README's copy (stale: run
`tessel support --strategies --out docs/combinations.md` and paste the table into the README); a cell is the
verdict of those checks on the combined layout."""

from __future__ import annotations

from typer.testing import CliRunner

from tessel.commands.cli import app
from tessel.commands.combinations import (BASE, SAME_KNOB, STRATEGIES, combinations_table, combined, matrix, nested,
                                 verdict)
from tessel.config import build_config
from tests.helpers import ROOT


def by_short(short: str):
    return next(s for s in STRATEGIES if s.short == short)


def test_the_page_and_the_readme_hold_the_matrix_the_rules_give(tmp_path):
    out = tmp_path / "combinations.md"
    result = CliRunner().invoke(app, ["support", "--strategies", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text() == (ROOT / "docs" / "combinations.md").read_text(), \
        "docs/combinations.md is stale: run `tessel support --strategies --out docs/combinations.md`"
    rows, _ = matrix()
    assert combinations_table(rows) in (ROOT / "README.md").read_text(), \
        "the README's strategy table is stale: copy it from docs/combinations.md"


def test_a_cell_is_the_verdict_of_the_checks_on_both_strategies_at_once():
    rows, reasons = matrix()
    index = {s.short: i for i, s in enumerate(STRATEGIES)}
    cell = lambda a, b: rows[index[a]][index[b]]  # noqa: E731
    assert all(rows[i][j] == rows[j][i] for i in range(len(rows)) for j in range(len(rows)))  # order-free rules
    assert all(rows[i][i] == "ok" for i in range(len(rows)))  # every strategy runs alone
    assert cell("tp", "Z3") == "ok" and cell("ep", "1F1B") == "ok"
    assert cell("1F1B", "GP") == SAME_KNOB and combined(by_short("1F1B"), by_short("GP")) is None
    refusal = reasons[int(cell("Z3", "CM")[1:]) - 1]
    assert refusal.startswith("train.compile: 'model'")
    assert verdict(combined(by_short("Z3"), by_short("CM"))) == refusal
    build_config(nested({**BASE, **by_short("Z3").fields, **by_short("CB").fields}))  # its neighbour is accepted
