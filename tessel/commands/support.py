"""`tessel support`: which Hugging Face family trains on which axis, from tessel's own rules.

The families are those of the installed transformers whose config class declares a `base_model_tp_plan` or
`base_model_pp_plan` and that AutoModelForCausalLM builds (what `tessel train` builds), and the ones tessel
knows without a plan (GPT-2). For each, a tiny config is made from the family's own config class, its
defaults with the sizes shrunk (SIZES), and each axis's layout (AXES) is put through the checks `tessel
train` runs before it spawns anything (tessel.config.build_config: the model's shape, check_layout and the
Hugging Face checks in it). A cell says:

- "trains": the rules accept it and the parity sweep (tests/hf_matrix, `make hf-matrix`) found it matching the
  unmodified transformers model under the installed transformers (PARITY_RECORD);
- "accepted, fails parity": the rules accept it and the sweep found it off (the differences, or the error);
- "accepted, untested": the rules accept it and the sweep has not measured it, so no parity is claimed;
- "refused": the rules' one line (the same `tessel train` prints), collected under the table;
- "n/a": expert parallelism of a dense family.

Generated, never written by hand: the rules change, the matrix follows (tests/commands/test_support.py regenerates it
and fails when docs/support.md is stale). Nothing is spawned and no model is built: the config classes only
and the sweep's record.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tessel.config import build_config
from tessel.errors import ConfigError
from tessel.hf.blocks import KNOWN, read_model
from tessel.hf.shape import HFConfigError

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # config classes only, never the network

# an axis -> the recipe overrides that put a model on it (two ranks of it; the grid four)
AXES: dict[str, list[str]] = {
    "dp": ["parallel.dp=2"],
    "ZeRO-3": ["parallel.dp=2", "parallel.zero_stage=3"],
    "recompute": ['parallel.recompute="full"'],
    "tp": ["parallel.tp=2"],
    "tp+SP": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "2D grid": ["parallel.tp=4", 'parallel.tp_mode="2d"'],
    "pp": ["parallel.pp=2", "parallel.micro_batches=2"],
    "ep": ["parallel.ep=2"],
    "cp ring": ["parallel.cp=2"],
    "cp Ulysses": ["parallel.cp=2", 'parallel.cp_mode="ulysses"'],
    "compile": ['train.compile="blocks"'],
    "fused loss": ["train.fused_loss=true"],
}
# the recipe around the model: synthetic tokens (any vocabulary), short sequences, a batch every axis splits
BASE = {"data": {"source": "synthetic"},
        "train": {"seq_len": 32, "global_batch": 8, "steps": 2, "warmup_steps": 0, "eval_every": 0,
                  "sample_tokens": 0}}
# a family's defaults shrunk: each key its config has is set to this (heads and widths that 2 and a 2 x 2 grid
# divide, 4 layers for two pipeline stages after a first dense one, experts that ep = 2 splits)
SIZES = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128,
         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "n_routed_experts": 4,
         "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
         "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
         "first_k_dense_replace": 1, "sliding_window": 64, "vocab_size_per_layer_input": 128, "index_head_dim": 16,
         # no dropout, as the parity tests train (context parallelism refuses attention dropout)
         "attention_dropout": 0.0, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
         # GPT-2's own names
         "n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 128}
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")
EXPERT_COUNTS = ("n_routed_experts", "num_experts", "num_local_experts")
# how the config keys of training's randomness end: dropout probabilities, a router's jitter noise (PhiMoE)
DROPOUT = ("dropout", "pdrop", "dropout_rate", "dropout_prob", "jitter_noise")
WITHOUT_PLAN = ("gpt2",)  # families tessel splits from its own rules (tessel.models.hf), no plan in their config

# The parity sweep's record (tests/hf_matrix/sweep.py, `make hf-matrix`): per cell, the largest loss and weight
# differences against the unmodified transformers model and pass/fail, with the versions it ran under. A cell the
# rules accept is "trains" only where this record says it passed under the installed transformers.
PARITY_RECORD = Path(__file__).resolve().parents[2] / "docs" / "support_parity.json"


@dataclass(frozen=True)
class Cell:
    status: str  # "trains" | "accepted, untested" | "accepted, fails parity" | "refused" | "n/a"
    reason: str = ""  # the rules' one line, for "refused"; the differences or the error, for "fails parity"


@dataclass(frozen=True)
class Row:
    model_type: str
    cells: dict[str, Cell]  # axis -> cell
    planner: str  # "exact": tessel.hf.blocks counts it as transformers builds it; "estimate": Llama-like


def families() -> list[str]:
    """The causal LM model types whose config declares a tp or pp plan, and tessel's own, sorted."""
    # deferred: transformers loads torch; only the matrix needs its config classes
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    # only the causal LMs' config classes are imported: the other ~600 model types would take seconds more
    planned = [kind for kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if kind in CONFIG_MAPPING
               and (getattr(CONFIG_MAPPING[kind], "base_model_tp_plan", None)
                    or getattr(CONFIG_MAPPING[kind], "base_model_pp_plan", None))]
    return sorted(set(planned) | set(WITHOUT_PLAN))


def tiny_config(model_type: str) -> dict:
    """The family's config class with its defaults and the sizes shrunk (SIZES), as a config.json's contents;
    token ids outside the shrunk vocabulary are dropped (None). ValueError: the class refuses the sizes."""
    from transformers import CONFIG_MAPPING  # deferred: see families
    from transformers.utils import logging
    logging.set_verbosity_error()  # warnings on shrunk rope scalings and the like concern no rule here
    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    # a size the class stores under its own name (its attribute_map: ERNIE-4.5-MoE's moe_num_experts and moe_k
    # for num_experts and num_experts_per_tok) is shrunk under that name, unless SIZES names that key itself
    named = {k: real for k, real in (getattr(cls, "attribute_map", None) or {}).items() if real not in SIZES}
    sizes = {named.get(k, k): v for k, v in SIZES.items() if defaults.get(named.get(k, k)) is not None}
    if defaults.get("qk_rope_head_dim") is not None:  # latent attention: head_dim is the rotary part, the class's
        sizes.pop("head_dim", None)
    if any(defaults.get(named.get(k, k)) for k in EXPERT_COUNTS):  # routed experts, the top-k maybe unset
        sizes[named.get("num_experts_per_tok", "num_experts_per_tok")] = SIZES["num_experts_per_tok"]
    if isinstance(defaults.get("layer_types"), list):  # one per layer: let the class lay out the shrunk count
        sizes["layer_types"] = None
    try:
        config = cls(**sizes)
    except Exception as err:  # transformers' own validation: its reason is the matrix's
        raise ValueError(f"{cls.__name__} refuses the shrunk sizes: {' '.join(str(err).split())}") from None
    doc = json.loads(config.to_json_string(use_diff=False))
    for key, value in doc.items():  # every dropout and noise off, whatever the family calls it: parity is exact
        if key.endswith(DROPOUT) and isinstance(value, float):
            doc[key] = 0.0
    for key in TOKEN_IDS:
        if isinstance(doc.get(key), int) and not 0 <= doc[key] < doc.get("vocab_size", 0):
            doc[key] = None
    _shrink_overrides(doc)
    return doc


def _shrink_overrides(doc: dict) -> None:
    """Sizes a config overrides per layer (Gemma 4's per_layer_config: {layer: {"head_dim": 512}}, its full
    attention layers' width from an __init__ keyword the config never stores) take the shrunk model's own: a
    512-wide head at attention scaling 1 makes scores of std ~22, a softmax so sharp that fp32 rounding alone
    moves the reference's loss by 2.6e-3 in 5 steps (against its own fp64 run)."""
    for value in doc.values():
        for layer in value.values() if isinstance(value, dict) else ():
            if isinstance(layer, dict):
                layer.update({k: doc[k] for k in layer if k in SIZES and doc.get(k) is not None})


def refusal(config_json: str, overrides: list[str]) -> str | None:
    """The one line `tessel train` refuses the tiny recipe with on this layout, None where it accepts it."""
    raw = {**BASE, "model": {"hf_config": config_json}}
    try:
        build_config(json.loads(json.dumps(raw)), overrides)
    except ConfigError as err:
        return " ".join(str(err).split())
    except Exception as err:  # a rule that crashes on a config is a bug of tessel's, shown as what it is
        return f"tessel's checks crash: {type(err).__name__}: {' '.join(str(err).split())}"
    return None


def parity_record(path: Path = PARITY_RECORD) -> dict[str, dict]:
    """The sweep's cells ("<model type>/<axis>" -> its row), empty where there is no record or it was measured
    under another transformers (its verdicts are not this one's)."""
    import transformers  # deferred: see families
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    return record["cells"] if record.get("transformers") == transformers.__version__ else {}


def accepted_cell(measured: dict | None) -> Cell:
    """An accepted cell as the parity record has it: passed, failed (with what), or not measured."""
    if measured is None:
        return Cell("accepted, untested")
    if measured["status"] == "pass":
        return Cell("trains")
    why = measured.get("error") or (f"losses differ by {measured['loss_diff']:.1e}, weights after "
                                    f"3 steps by {measured['weight_diff']:.1e}")
    return Cell("accepted, fails parity", why)


def family_row(model_type: str, folder: Path, record: dict[str, dict]) -> Row:
    """Every axis of one family, judged by the rules on its tiny config."""
    try:
        doc = tiny_config(model_type)
    except ValueError as err:
        return Row(model_type, {axis: Cell("refused", f"config: {err}") for axis in AXES}, "-")
    path = folder / f"{model_type}.json"
    path.write_text(json.dumps(doc))
    try:
        moe = any(b.experts for b in read_model(doc).blocks) or _declares_experts(model_type)
    except HFConfigError:  # the rules say what they make of it
        moe = _declares_experts(model_type)
    cells = {}
    for axis, overrides in AXES.items():
        if axis == "ep" and not moe:
            cells[axis] = Cell("n/a")
            continue
        why = refusal(str(path), overrides)
        if why is not None:
            cells[axis] = Cell("refused", why)
        else:
            cells[axis] = accepted_cell(record.get(f"{model_type}/{axis}"))
    return Row(model_type, cells, "exact" if model_type in KNOWN else "estimate")


def _declares_experts(model_type: str) -> bool:
    from transformers import CONFIG_MAPPING  # deferred: see families
    return bool(getattr(CONFIG_MAPPING[model_type], "base_model_ep_plan", None))


def matrix(kinds: list[str] | None = None) -> list[Row]:
    """A row per family (those of `kinds` only, when given)."""
    record = parity_record()
    with tempfile.TemporaryDirectory(prefix="tessel-support-") as folder:
        return [family_row(kind, Path(folder), record) for kind in families() if kinds is None or kind in kinds]


def markdown(rows: list[Row]) -> str:
    """docs/support.md: the legend, the matrix, the refusals (each family's model type written <type>), the
    cells that failed parity."""
    import transformers  # deferred: see families
    reasons = numbered_reasons(rows)
    count = {status: sum(c.status == status for r in rows for c in r.cells.values())
             for status in ("trains", "accepted, fails parity", "accepted, untested")}
    out = [
        "# Hugging Face families x parallel axes",
        "",
        f"Generated by `tessel support` from transformers {transformers.__version__}, tessel's own rules and the "
        "parity sweep's record (docs/support_parity.json); do not edit (tests/commands/test_support.py fails when this file "
        "is stale).",
        "",
        f"{len(rows)} families: every model type whose config class declares `base_model_tp_plan` or "
        "`base_model_pp_plan` and that `AutoModelForCausalLM` builds (what `tessel train` builds; encoders, vision "
        "towers and the text halves of multimodal models are left out), and GPT-2 (tessel's own rules). Each axis's "
        "layout (two ranks of it; the 2D grid four) on a tiny config from the family's own config class, put through "
        "the checks `tessel train` runs before it spawns anything:",
        "",
        f"- **trains**: accepted, and the parity sweep (`make hf-matrix`: 5 losses and the weights after 3 steps "
        f"against the unmodified transformers model) found it matching under this transformers ({count['trains']} "
        "cells);",
        f"- **F*n***: accepted, and the sweep found it off, for reason *n* below ({count['accepted, fails parity']} "
        "cells);",
        f"- **accepted, untested**: accepted, and the sweep has not measured it ({count['accepted, untested']} "
        "cells);",
        "- **R*n***: refused, for reason *n* below (the line `tessel train` prints);",
        "- **n/a**: expert parallelism of a dense family.",
        "",
        "The planner column: `exact` where `tessel plan` counts the family's parameters and FLOPs as transformers "
        "builds it (tessel/hf/blocks.py, checked against the model on the meta device), `estimate` where it "
        "reads it as a Llama-like decoder.",
        "",
        "## Summary",
        "",
        f"Families per axis (of {len(rows)}), and the cells of a few well-known ones (the README's table):",
        "",
        summary_table(rows),
        "## Every family",
        "",
        "| family | " + " | ".join(AXES) + " | planner |",
        "|---" * (len(AXES) + 2) + "|",
    ]
    for row in rows:
        cells = [_cell_text(row, row.cells[axis], reasons) for axis in AXES]
        out.append(f"| {row.model_type} | " + " | ".join(cells) + f" | {row.planner} |")
    for title, status in (("Refusals", "refused"), ("Parity failures", "accepted, fails parity")):
        out += ["", f"## {title}", ""]
        for (kind, reason), (n, families_) in reasons.items():
            if kind == status:
                out.append(f"- **{'R' if status == 'refused' else 'F'}{n}** ({', '.join(families_)}): {reason}")
    return "\n".join(out) + "\n"


# the families a user most often brings, shown by name in the README's summary (the rest are counted)
SHOWN = ("llama", "mistral", "qwen3", "gemma3_text", "gpt2", "mixtral", "qwen3_moe", "deepseek_v3")
SHORT = {"trains": "trains", "accepted, fails parity": "F", "accepted, untested": "untested", "refused": "R",
         "n/a": "n/a"}


def summary_table(rows: list[Row]) -> str:
    """The strategy x family table the README embeds: per axis, how many families train, fail parity, are refused
    (or n/a: ep of a dense family), and the cells of the SHOWN families; docs/support.md has every cell."""
    shown = [r for name in SHOWN for r in rows if r.model_type == name]
    head = ["axis", "trains", "fails parity or untested", "refused", "n/a", *(r.model_type for r in shown)]
    out = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for axis in AXES:
        count = {s: sum(r.cells[axis].status == s for r in rows) for s in SHORT}
        counts = [count["trains"], count["accepted, fails parity"] + count["accepted, untested"], count["refused"],
                  count["n/a"]]
        out.append(f"| {axis} | " + " | ".join(map(str, counts + [SHORT[r.cells[axis].status] for r in shown])) + " |")
    return "\n".join(out) + "\n"


def _reason_key(row: Row, cell: Cell) -> tuple[str, str]:
    return cell.status, cell.reason.replace(f"'{row.model_type}'", "'<type>'")


def numbered_reasons(rows: list[Row]) -> dict[tuple[str, str], tuple[int, list[str]]]:
    """(status, reason) -> (its number among its status's reasons, the families that meet it), in order."""
    reasons: dict[tuple[str, str], tuple[int, list[str]]] = {}
    for row in rows:
        for cell in row.cells.values():
            if cell.status in ("refused", "accepted, fails parity"):
                key = _reason_key(row, cell)
                if key not in reasons:
                    reasons[key] = (sum(k[0] == cell.status for k in reasons) + 1, [])
                if row.model_type not in reasons[key][1]:
                    reasons[key][1].append(row.model_type)
    return reasons


def _cell_text(row: Row, cell: Cell, reasons: dict) -> str:
    if cell.status == "trains":
        return "**trains**"
    if cell.status in ("refused", "accepted, fails parity"):
        return f"{'R' if cell.status == 'refused' else 'F'}{reasons[_reason_key(row, cell)][0]}"
    return cell.status


def support_markdown() -> str:
    return markdown(matrix())
