"""tessel.hf.blocks counts what transformers builds: for every family it knows (KNOWN), a tiny config from the
family's own config class (tessel.commands.support.tiny_config), the model built on the meta device, and the
parameters, the experts' share and the weights a token multiplies (the runtime's MFU numerator,
tessel.models.flops, which reads the experts' count from the same config) compared exactly: they are integer
counts of the same tensors, so any difference is a module the reading missed."""

from __future__ import annotations

import json

import pytest
import torch

from tessel.config import ModelConfig
from tessel.hf.blocks import KNOWN, read_model
from tessel.hf.config import transformers_config
from tessel.models.flops import experts_per_token, matmul_params
from tessel.commands.support import tiny_config

# flags the families' defaults leave off: biases on, GQA off, no query low-rank pair, untied heads
VARIANTS = {
    "llama+biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen3+bias": ("qwen3", {"attention_bias": True}),
    "deepseek_v3-no-q-lora": ("deepseek_v3", {"q_lora_rank": None, "attention_bias": True}),
    "gemma2-untied": ("gemma2", {"tie_word_embeddings": False}),
    "qwen3_moe-sparse-step": ("qwen3_moe", {"decoder_sparse_step": 2, "mlp_only_layers": [3]}),
    "starcoder2-no-bias": ("starcoder2", {"use_bias": False}),
}
CASES = {**{kind: (kind, {}) for kind in sorted(KNOWN)}, **VARIANTS}


def _built(doc: dict, tmp_path):
    """transformers' causal LM for the config, on the meta device, and tessel's ModelConfig of it."""
    from transformers import AutoModelForCausalLM
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    config = transformers_config(doc)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model, ModelConfig(hf_config=str(path))


@pytest.mark.parametrize("case", CASES)
def test_blocks_count_what_transformers_builds(case, tmp_path):
    kind, flags = CASES[case]
    doc = {**tiny_config(kind), **flags}
    model, cfg = _built(doc, tmp_path)
    blocks = read_model(doc)
    assert blocks.exact
    assert blocks.total_params == sum(p.numel() for p in model.parameters())
    n_experts, _ = experts_per_token(cfg)
    stacked = sum(p.numel() for p in model.parameters() if n_experts and p.dim() == 3 and p.shape[0] == n_experts)
    assert sum(b.params[1] for b in blocks.blocks) == stacked  # what ep shards
    head = blocks.vocab_size * blocks.d_model  # the head's matmul, tied to the embedding or not (counted once)
    assert sum(b.matmul_params_per_token for b in blocks.blocks) + head == matmul_params(model, cfg)


def test_exact_is_every_family_of_the_matrix_that_counts_exactly(tmp_path):
    """Over every family of the support matrix (tessel.commands.support.families): the reading is exact (its parameters
    equal those of transformers' model, built on the meta device from the family's tiny config) exactly for the
    families KNOWN lists, so the planner column's "exact" is true and no family it counts right says "estimate".
    The others (their blocks hold modules the reading has no key for: linear attention, sinks, routers' biases,
    per-layer inputs) are estimates; each is printed with its error when this fails."""
    from transformers import AutoModelForCausalLM
    from tessel.commands.support import families
    exact, off, unbuilt = set(), {}, {}
    for kind in families():
        try:
            doc = tiny_config(kind)
            (tmp_path / "config.json").write_text(json.dumps(doc))
            ModelConfig(hf_config=str(tmp_path / "config.json"))  # one tessel refuses is never planned
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(transformers_config(doc))
        except Exception as err:  # transformers (or tessel) refuses the tiny config: nothing to count against
            unbuilt[kind] = f"{type(err).__name__}"
            continue
        want = sum(p.numel() for p in model.parameters())
        try:
            got = read_model(doc).total_params
        except Exception:
            got = None
        if got == want:
            exact.add(kind)
        else:
            off[kind] = f"{got} vs {want}"
    assert exact == set(KNOWN) - set(unbuilt), f"exact but not KNOWN: {sorted(exact - set(KNOWN))}; " \
        f"KNOWN but off: { {k: off[k] for k in set(KNOWN) & set(off)} }"
    assert exact and off.keys().isdisjoint(KNOWN)  # the estimates: printed above when the first assertion fails
