"""Which strategy combines with which: every pair of strategies put, as one small layout of the reference GPT,
through the checks `tessel train` runs before it spawns anything (tessel.config.build_config: the schema and
check_layout), and recorded as accepted or refused with the check's own one-line reason. Nothing is spawned
and nothing is listed by hand but the strategies themselves, so the matrix follows the rules as they change
(`tessel support --strategies --out docs/combinations.md`; tests/commands/test_combinations.py fails when the committed
page, or the README's copy of the table, is stale)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessel.config import build_config
from tessel.errors import ConfigError

# A dense reference GPT every strategy can split on its own: 8 layers (pp2 x 2 virtual stages), 16 heads and
# d_model 128 (tp up to 8 with two heads a rank for Ulysses' cp2, a 2x2 grid, a 2x2x2 cube), 64-token sequences (cp2 x tp2's four chunks), a batch of 64
# (dp2 x ep2 x 4 micro-batches, each rank's micro-batch split in a grid's 4 batch chunks), synthetic tokens.
BASE: dict[str, Any] = {
    "model.vocab_size": 256, "model.n_layer": 8, "model.n_head": 16, "model.d_model": 128, "model.max_seq_len": 64,
    "train.seq_len": 64, "train.global_batch": 64, "train.steps": 10, "train.warmup_steps": 2,
    "data.source": "synthetic",
}
PIPE = {"parallel.pp": 2, "parallel.micro_batches": 4}
ASYNC = {**PIPE, "parallel.allow_async": True}


@dataclass(frozen=True)
class Strategy:
    short: str  # the column heading
    name: str  # the row heading
    fields: dict[str, Any]  # what the strategy sets on top of BASE


STRATEGIES = (
    Strategy("dp", "data parallel (dp2)", {"parallel.dp": 2}),
    Strategy("Z1", "ZeRO-1", {"parallel.dp": 2, "parallel.zero_stage": 1}),
    Strategy("Z2", "ZeRO-2", {"parallel.dp": 2, "parallel.zero_stage": 2}),
    Strategy("Z3", "ZeRO-3", {"parallel.dp": 2, "parallel.zero_stage": 3}),
    Strategy("Zbf", "ZeRO-3, bf16 parameters", {"parallel.dp": 2, "parallel.zero_stage": 3,
                                                "parallel.zero_param_dtype": "bf16"}),
    Strategy("PS", "parameter server (BSP)", {"parallel.dp": 2, "parallel.dp_arch": "ps"}),
    Strategy("dpS", "dp split by device speed", {"parallel.dp": 2, "parallel.dp_split": "speed"}),
    Strategy("tp", "tensor parallel (1D, tp2)", {"parallel.tp": 2}),
    Strategy("SP", "tp2 + sequence parallel", {"parallel.tp": 2, "parallel.sequence_parallel": True}),
    Strategy("2D", "2D tp (SUMMA, 2x2)", {"parallel.tp": 4, "parallel.tp_mode": "2d"}),
    Strategy("2.5D", "2.5D tp (2x2x2)", {"parallel.tp": 8, "parallel.tp_mode": "2.5d", "parallel.tp_depth": 2}),
    Strategy("3D", "3D tp (2x2x2 cube)", {"parallel.tp": 8, "parallel.tp_mode": "3d"}),
    Strategy("ring", "cp ring (cp2)", {"parallel.cp": 2}),
    Strategy("Uly", "cp Ulysses (cp2)", {"parallel.cp": 2, "parallel.cp_mode": "ulysses"}),
    Strategy("GP", "pp2 GPipe", {**PIPE, "parallel.schedule": "gpipe"}),
    Strategy("1F1B", "pp2 1F1B", {**PIPE, "parallel.schedule": "1f1b"}),
    Strategy("I", "pp2 interleaved (2 virtual)", {**PIPE, "parallel.schedule": "interleaved",
                                                   "parallel.virtual_stages": 2}),
    Strategy("H1", "pp2 ZB-H1", {**PIPE, "parallel.schedule": "zb-h1"}),
    Strategy("H2", "pp2 ZB-H2", {**PIPE, "parallel.schedule": "zb-h2"}),
    Strategy("ZBV", "pp2 ZBV", {**PIPE, "parallel.schedule": "zbv", "parallel.virtual_stages": 2}),
    Strategy("2BW", "pp2 PipeDream-2BW", {**ASYNC, "parallel.schedule": "2bw"}),
    Strategy("PD", "pp2 PipeDream", {**ASYNC, "parallel.schedule": "pipedream", "train.grad_clip": 0.0}),
    Strategy("ep", "MoE, expert parallel (ep2)", {"model.n_experts": 4, "parallel.ep": 2}),
    Strategy("RC", "full recompute", {"parallel.recompute": "full"}),
    Strategy("RS", "selective recompute", {"parallel.recompute": "selective"}),
    Strategy("CB", "compiled blocks", {"train.compile": "blocks"}),
    Strategy("CM", "compiled model", {"train.compile": "model"}),
    Strategy("FL", "fused loss", {"train.fused_loss": True}),
    Strategy("F8", "FP8 matmuls (train.precision fp8)", {"train.precision": "fp8"}),
)

SAME_KNOB = "-"  # two settings of one knob (two schedules, two tp sizes): alternatives, not a combination


def combined(a: Strategy, b: Strategy) -> dict[str, Any] | None:
    """BASE with both strategies' fields, or None where they set one field to different values."""
    clash = [key for key in a.fields.keys() & b.fields.keys() if a.fields[key] != b.fields[key]]
    return None if clash else {**BASE, **a.fields, **b.fields}


def verdict(fields: dict[str, Any]) -> str | None:
    """None if `tessel train` would accept the layout; else its one-line refusal, 'field: message'."""
    try:
        build_config(nested(fields))
    except ConfigError as err:
        return str(err)
    return None


def nested(fields: dict[str, Any]) -> dict:
    raw: dict = {}
    for key, value in fields.items():
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = value
    return raw


def matrix() -> tuple[list[list[str]], list[str]]:
    """Each row's cells ('ok', 'R<n>' or SAME_KNOB; the diagonal is the strategy alone) and the reasons."""
    reasons: list[str] = []
    rows = []
    for a in STRATEGIES:
        row = []
        for b in STRATEGIES:
            fields = combined(a, b)
            why = None if fields is None else verdict(fields)
            if fields is None:
                row.append(SAME_KNOB)
            elif why is None:
                row.append("ok")
            else:
                reasons += [why] if why not in reasons else []
                row.append(f"R{reasons.index(why) + 1}")
        rows.append(row)
    return rows, reasons


def combinations_table(rows: list[list[str]]) -> str:
    """The matrix as a markdown table: a row per strategy, a column per strategy's short name."""
    head = "| | " + " | ".join(s.short for s in STRATEGIES) + " |"
    lines = [head, "|---" * (len(STRATEGIES) + 1) + "|"]
    for strategy, row in zip(STRATEGIES, rows):
        lines.append(f"| {strategy.short}: {strategy.name} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


INTRO = """\
# Which strategies combine

Generated by `tessel support --strategies --out docs/combinations.md` from the checks `tessel train` runs before
it spawns anything (`tessel/config/`: the schema and the rules in `tessel/config/rules/`); `tests/commands/test_combinations.py` fails when
this page, or the README's copy of the table, is stale. Do not edit it by hand.

Each cell puts one small layout of the reference GPT (8 layers, 16 heads, d_model 128, 64-token sequences, a
batch of 64) that combines the row's strategy with the column's through those checks: **ok** (accepted), **R*n***
(refused, for reason *n* below: the line `tessel train` prints), or **-** (two settings of the same knob: two
schedules, two tp sizes). The diagonal is the strategy alone. Accepted means the rules let it run; what each
combination was tested against one process is in [strategies.md](strategies.md) and the tests. Hugging Face
families, axis by axis: [support.md](support.md).
"""


def combinations_markdown() -> str:
    rows, reasons = matrix()
    notes = [f"{i}. `{why}`" for i, why in enumerate(reasons, 1)]
    return "\n".join([INTRO, combinations_table(rows), "Reasons:", "", *notes]) + "\n"
