"""The parity sweep, sampled: every family the support matrix accepts on some axis, and every axis some family
is accepted on, trained against the unmodified transformers model (tests/hf_matrix/sweep.py), each sampled
cell's verdict equal to the one the committed record (docs/support_parity.json, `make hf-matrix`) holds, which
is what `tessel support` prints. A cell the record lacks fails here: the record is stale (run `make hf-matrix`).

The sample (tests.hf_matrix.sweep.sample) is the cheapest covering one, deterministic for a given matrix: one
cell per family (the fewest that cover them all), each axis once on a rotating family, every other family on
its cheapest axis (one rank: recompute or the fused loss). The full matrix is `make hf-matrix`. Families whose
unmodified transformers model cannot train on the tiny config (or whose tiny config is not tiny) are checked
for that, in this process, instead of being run.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from tessel.commands.support import parity_record
from tests.hf_matrix.sweep import (LOSS_TOL, accepted_cells, sample, sweep, too_large,
                                   transformers_fails, write_config)

TRANSFORMERS_FAILS = "transformers' own model fails"
# 87 cells (one a family), 77 of them on one rank: under the suite's 300 s per test on a busy host, but the
# whole sample is one fixture, so it keeps a margin
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def record() -> dict[str, dict]:
    return parity_record()


@pytest.fixture(scope="module")
def cells() -> list[tuple[str, str]]:
    return sample(accepted_cells())


@pytest.fixture(scope="module")
def swept(cells, record) -> dict[tuple[str, str], dict]:
    """The sampled cells' rows; those the record blames on transformers (or on size) checked in this process."""
    local = [c for c in cells if _checked_here(record.get(f"{c[0]}/{c[1]}"))]
    rows = sweep([c for c in cells if c not in local], quiet=True, precheck=False)
    with tempfile.TemporaryDirectory() as folder:
        for kind, axis in local:
            path = write_config(kind, Path(folder))
            why = too_large(path) or transformers_fails(path)
            rows[kind, axis] = {"status": "error" if why else "pass?", "error": why}
    return rows


def _checked_here(row: dict | None) -> bool:
    return row is not None and row["status"] == "error" and row["error"].startswith((TRANSFORMERS_FAILS, "not swept"))


def test_the_sample_covers_every_family_and_axis(cells):
    every = accepted_cells()
    assert {kind for kind, _ in cells} == {kind for kind, _ in every}
    assert {axis for _, axis in cells} == {axis for _, axis in every}
    assert len(cells) == len(set(cells))


def test_sampled_cells_match_the_record(swept, record):
    stale = sorted(f"{kind}/{axis}" for kind, axis in swept if f"{kind}/{axis}" not in record)
    assert not stale, f"the parity record has no row for {stale}: run `make hf-matrix` and commit the record"
    for (kind, axis), row in swept.items():
        want = record[f"{kind}/{axis}"]
        where = f"{kind}/{axis}: swept now {json.dumps(row)}, recorded {json.dumps(want)}"
        assert row["status"] == want["status"], where
        if row["status"] == "pass":  # what "trains" in the matrix rests on, within the axis's tolerances
            assert row["loss_diff"] <= LOSS_TOL[axis] and row["moved"] > 10 * row["weight_diff"], where
        if row["status"] == "error":  # the same failure, not merely some failure
            assert row["error"].split(":")[0] == want["error"].split(":")[0], where
