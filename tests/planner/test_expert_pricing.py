"""The expert pricer on today's MoE: shared experts counted and priced, dropless experts at the busiest rank."""

import math

import pytest

from tessel.models.gpt import GPT, count_params
from tessel.planner.cost import CostModel
from tessel.planner.layout import Layout
from tessel.planner.model_spec import from_config
from tessel.planner.pricing.base import expert_rows
from tessel.planner.traffic import dropless_rows, sent_rows_factor
from tests.planner.cases import TINY, flat_cluster

FINE = {"n_experts": 8, "moe_top_k": 2, "d_ff": 16}


def test_shared_experts_are_counted_as_built():
    cfg = TINY.model_copy(update={**FINE, "n_shared_experts": 2})
    spec = from_config(cfg, 16, 8)
    assert spec.shared_ffn == 2 * 16
    assert spec.total_params == count_params(GPT(cfg))


def test_shared_experts_cost_compute():
    plain, shared = (CostModel(from_config(TINY.model_copy(update={**FINE, "n_shared_experts": n}), 16, 8),
                               flat_cluster(), "fp32") for n in (0, 1))
    layout = Layout(ep=2, micro_batch=4)
    assert shared.estimate(layout).step_s > plain.estimate(layout).step_s


def test_dropless_rows_are_the_busiest_ranks():
    assert dropless_rows(100, 1) == 100  # one rank holds every row
    assert dropless_rows(100, 4) == pytest.approx(100 + math.sqrt(200 * math.log(4)))
    assert sent_rows_factor(1.25, 64, 4) == 1.25  # capped: the capacity's bound, as before
    assert sent_rows_factor(0.0, 100, 4) == pytest.approx(dropless_rows(100, 4) / 100)
    capped = from_config(TINY.model_copy(update=FINE), 16, 8)
    dropless = from_config(TINY.model_copy(update={**FINE, "capacity_factor": 0.0}), 16, 8)
    assert expert_rows(capped, 64, 2) == 64 * 2 * 2 / 8  # the mean: 32
    assert expert_rows(dropless, 64, 1) == 64 * 2 / 8  # one rank: every row, the mean
    assert expert_rows(dropless, 64, 2) == round((128 + math.sqrt(256 * math.log(2))) / 4)  # 128 rows, 4 experts


def test_dropless_experts_send_their_rows():
    """capacity_factor = 0 is no capacity: the all-to-all still moves every row (at the busiest rank's share)."""
    dropless = CostModel(from_config(TINY.model_copy(update={**FINE, "capacity_factor": 0.0}), 16, 8),
                         flat_cluster(), "fp32")
    fwd, _ = dropless.expert.calls(1, 64, False, 2)
    tokens = [c for c in fwd if c.nbytes > 8 * 8]
    assert tokens and all(c.nbytes >= 64 * 2 * 32 * 4 for c in tokens)
