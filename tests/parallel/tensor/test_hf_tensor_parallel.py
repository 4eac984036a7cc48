"""Tensor and sequence parallelism on Hugging Face models, unmodified: parity with one process.

The reference is transformers' own model built from the same local config and seed, trained on
the same batches with tessel's cross-entropy on its logits (parallelize with tp = 1 leaves it as
transformers built it). The tp = 2 runs derive their plan from the model (its config's
base_model_tp_plan, or GPT-2's rules) and score vocab-sharded logits with the vocab-parallel loss.
One spawn of two ranks loops over every layout; the unit tests below need no processes.
"""

import json
import re

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

from tessel.config import ConfigError, hf_tp_refusal
from tessel.models.build import build_model
from tessel.models.hf.families import FAMILIES, family_of, tp_rules
from tessel.models.hf.tp_plan import hf_tp_plan
from tessel.parallel.norms import clip_grad_norm_
from tessel.parallel.tensor import regions
from tessel.parallel.tensor.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, TPContext, apply_plan,
                                                    full_tensor, match_plan, unplaced_modules)
from tessel.sharding import packed_dims, shard_axes
from tessel.spawn import spawn
from tessel.train.checkpoint.packed import packed_slice
from tessel.train.data import BatchSampler, load_tokens
from tessel.train.optim import build_optimizer
from tests.helpers import DERIVED, LATENT, PLANNED, build_runner, tiny_config

STEPS = 5
# tiny configs, dropout 0 (GPT-2 has dropout by default). Llama: grouped-query attention (4 heads,
# 2 kv heads: one kv head a rank under tp2), a vocabulary tp does not divide (251 -> 252) and a
# padding row (pad_token_id: no gradient). GPT-2: tied embeddings, Conv1D layers, fused q|k|v.
CONFIGS = {
    "llama": {"model_type": "llama", "vocab_size": 251, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "pad_token_id": 3, "bos_token_id": 1, "eos_token_id": 2},
    "gpt2": {"model_type": "gpt2", "vocab_size": 128, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0},
    "mixtral": {"model_type": "mixtral", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 48,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64,
                "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {"model_type": "mistral", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2": {"model_type": "qwen2", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True},
    "opt": {"model_type": "opt", "vocab_size": 128, "hidden_size": 32, "ffn_dim": 64, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64},
}
CONFIGS |= PLANNED | DERIVED | LATENT  # the families placed from transformers' own plans (tests/helpers.py)
# name -> (config, overrides); every one runs on two ranks, its reference on one process
LAYOUTS = {
    "llama_tp2_sp_recompute": ("llama", ["parallel.tp=2", "parallel.sequence_parallel=true",
                                         "parallel.recompute=true"]),
    "gpt2_tp2": ("gpt2", ["parallel.tp=2"]),
    "gpt2_tp2_sp": ("gpt2", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "mixtral_tp2": ("mixtral", ["parallel.tp=2"]),  # attention split, the MoE block replicated
    "mixtral_tp2_sp": ("mixtral", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
} | {f"{kind}_tp2{sp}": (kind, ["parallel.tp=2", *(["parallel.sequence_parallel=true"] if sp else [])])
     for kind in PLANNED for sp in ("", "_sp")} | {
    f"{kind}_tp2_sp": (kind, ["parallel.tp=2", "parallel.sequence_parallel=true"]) for kind in DERIVED} | {
    f"{kind}_tp2{sp}": (kind, ["parallel.tp=2", *(["parallel.sequence_parallel=true"] if sp else [])])
    for kind in LATENT for sp in ("", "_sp")}
# fp32 throughout; the same argument as tests/parallel/tensor/test_tensor_parallel.py. Tensor
# parallelism sums partial products in another order than one process (all-reduced per-rank
# partial matmuls, split softmax sums), so results differ by fp32 rounding: measured loss
# differences <= 1e-6 on losses ~5 and weight differences <= 2e-6 after 5 AdamW steps at
# lr 1e-3. AdamW moves a weight by ~lr * g / |g|, so an entry whose gradient is near zero can
# turn a 1e-10 rounding difference into a visible step: WEIGHT_TOL's 5e-5 is 1/20 of one step.
# A real bug (a missing or doubled all-reduce, q|k|v split by columns instead of heads, a
# sequence shard reshaped as a batch) moves losses by >1e-2 and weights by ~lr, far outside these.
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-7)  # first-step gradients ~1e-2 at most, summed in another order
WEIGHT_TOL = dict(rtol=1e-4, atol=5e-5)


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("hf")
    paths = {}
    for name, doc in CONFIGS.items():
        (folder / f"{name}.json").write_text(json.dumps(doc))
        paths[name] = str(folder / f"{name}.json")
    return paths


def _cfg(path: str, *overrides: str):
    return tiny_config(f'model.hf_config="{path}"', *overrides, "train.lr=1e-3")


def _run(path: str, overrides: list[str]) -> dict:
    """5 optimizer steps through the real parallelize(); parameters and gradients gathered whole."""
    cfg = _cfg(path, *overrides)
    model, runner, mesh = build_runner(cfg)
    ctx = TPContext.from_mesh(mesh, cfg.parallel.sequence_parallel)
    params = runner.parameters()
    opt = build_optimizer(params, cfg.train)
    tokens = load_tokens(cfg.data, cfg.model.vocab_size, seed=cfg.train.seed)
    sampler = BatchSampler(tokens.train, cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed, 0, 1)
    named = dict(model.named_parameters())
    out = {"losses": [], "weights0": {n: full_tensor(q, q, ctx) for n, q in named.items()},
           "local_numel": {n: q.numel() for n, q in named.items() if "tp" in shard_axes(q)}}
    for step in range(STEPS):
        out["losses"].append(runner.forward_backward(*sampler.next()).item())
        if step == 0:
            out["grads"] = {n: full_tensor(q.grad, q, ctx) for n, q in named.items()}
        clip_grad_norm_(params, cfg.train.grad_clip, mesh)
        opt.step()
        opt.zero_grad(set_to_none=False)
    out["weights"] = {n: full_tensor(q, q, ctx) for n, q in named.items()}
    with torch.no_grad():  # sampling: whole-vocabulary logits for a prompt of odd length
        out["full_logits"] = runner.full_logits(torch.arange(5).unsqueeze(0) * 7 % cfg.model.vocab_size)
    return out


def _world2(paths: dict[str, str]) -> dict:
    return {name: _run(paths[kind], overrides) for name, (kind, overrides) in LAYOUTS.items()}


@pytest.fixture(scope="module")
def world2(configs):
    return spawn(_world2, 2, configs, timeout=600)


@pytest.fixture(scope="module")
def references(configs):
    return {name: _run(configs[kind], [o for o in overrides if not o.startswith("parallel.")])
            for name, (kind, overrides) in LAYOUTS.items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parity_with_the_single_process_transformers_model(world2, references, name):
    ref = references[name]
    for rank, got in enumerate(r[name] for r in world2):
        assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **LOSS_TOL, msg=f"rank {rank} loss")
        assert got["weights"].keys() == ref["weights"].keys()  # transformers' names, tied weights once
        for n, g in ref["grads"].items():
            assert_close(got["grads"][n], g, **GRAD_TOL, msg=f"rank {rank} grad {n}")
        for n, w in ref["weights"].items():
            assert_close(got["weights"][n], w, **WEIGHT_TOL, msg=f"rank {rank} weight {n}")
        # whole-vocabulary logits (padding dropped) for a prompt the sequence split must pad
        assert_close(got["full_logits"], ref["full_logits"], rtol=1e-4, atol=1e-5)
    # the reference must actually move, or weight parity would be trivially true
    assert max((ref["weights"][n] - w0).abs().max().item() for n, w0 in ref["weights0"].items()) > 1e-3


# the parameters tp splits in each decoder layer (besides the vocabulary: the embedding, and the head unless tied)
LLAMA_SPLIT = (*(f"self_attn.{p}_proj.weight" for p in "qkvo"), *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")))
SPLIT = {
    "gpt2": ("attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_fc.bias",
             "mlp.c_proj.weight"),
    "mixtral": tuple(f"self_attn.{p}_proj.weight" for p in "qkvo"),  # the MoE block stays whole (experts on ep)
    "glm4": (*(f"self_attn.{p}_proj.weight" for p in "qkvo"), *(f"self_attn.{p}_proj.bias" for p in "qkv"),
             "mlp.gate_up_proj.weight", "mlp.down_proj.weight"),  # q/k/v biases by default
    "seed_oss": (*LLAMA_SPLIT, *(f"self_attn.{p}_proj.bias" for p in "qkv")),
    # the fused projections, split block by block
    "phi3": ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight"),
    "gpt_neox": ("attention.query_key_value.weight", "attention.query_key_value.bias", "attention.dense.weight",
                 "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias", "mlp.dense_4h_to_h.weight"),
    "starcoder2": (*(f"self_attn.{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias")), "self_attn.o_proj.weight",
                   "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight"),
}
# a family whose layers differ: layer -> what tp splits in it (Qwen3-MoE's dense first layer, its sparse second)
DENSE_MLP = tuple(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
# latent attention: q (q_b_proj after the low-rank q_a_proj, or q_proj) and kv_b_proj by heads, o_proj by rows;
# q_a_proj, kv_a_proj_with_mqa and their norms whole
MLA_SPLIT = {kind: tuple(f"self_attn.{p}.weight" for p in (q, "kv_b_proj", "o_proj"))
             for kind, q in (("deepseek_v3", "q_b_proj"), ("deepseek_v2", "q_proj"))}
LAYER_SPLIT = {"qwen3_moe": {0: LLAMA_SPLIT, 1: SPLIT["mixtral"]},
               **{kind: {0: (*attn, *DENSE_MLP), 1: attn} for kind, attn in MLA_SPLIT.items()}}
# the base model's prefix, the layers' list, the embedding
NAMES = {"gpt2": ("transformer", "transformer.h", "transformer.wte"),
         "gpt_neox": ("gpt_neox", "gpt_neox.layers", "gpt_neox.embed_in")}


def test_the_plan_splits_what_it_should(world2, references):
    """Every linear layer of attention (and of the MLP, where it is dense) and the vocabulary are split,
    each rank holding half of them; the norms (q/k norms too), GPT-2's position embedding, the MoE router and
    experts stay whole."""
    for name, (kind, _) in LAYOUTS.items():
        _, layers, embedding = NAMES.get(kind, ("model", "model.layers", "model.embed_tokens"))
        tied = CONFIGS[kind].get("tie_word_embeddings", kind == "gpt2")
        split = LAYER_SPLIT.get(kind, {})
        want = sorted([f"{layers}.{i}.{m}" for i in range(2) for m in split.get(i, SPLIT.get(kind, LLAMA_SPLIT))]
                      + [f"{embedding}.weight"] + ([] if tied else ["lm_head.weight"]))
        for got in (r[name] for r in world2):
            assert sorted(got["local_numel"]) == want, name
            for n, local in got["local_numel"].items():
                full = references[name]["weights"][n].numel()
                assert full / 2 <= local <= full / 2 + 32, n  # + one padded vocabulary row (251 -> 252)


# ---- no processes -----------------------------------------------------------------------------

def _model(configs, kind: str) -> nn.Module:
    torch.manual_seed(0)
    return build_model(_cfg(configs[kind]).model)


FOUR_NORMS = {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"}
AFTER = {"post_attention_layernorm", "post_feedforward_layernorm"}  # after attention and MLP only
LAYER_NORMS = {"gemma2": FOUR_NORMS, "gemma3_text": FOUR_NORMS, "cohere": {"input_layernorm"},  # one before both
               "cohere2": {"input_layernorm"}, "olmo2": AFTER, "olmo3": AFTER, "exaone4": AFTER,
               "glm4": {"input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm", "post_mlp_layernorm"}}


def _styles(configs, kind: str) -> dict[str, str]:
    """{module: style} of the family's plan on its tiny model; every parameter placed."""
    model = _model(configs, kind)
    plan = hf_tp_plan(model, tp_rules(model, family_of(kind)))  # a table's entry, or the plans alone
    styles = match_plan(model, plan.styles)
    assert unplaced_modules(model, styles) == []
    return styles


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "mixtral", "gpt2", *PLANNED, *DERIVED, *LATENT])
def test_every_weight_of_each_family_is_placed(configs, kind):
    styles = _styles(configs, kind)
    if kind == "gpt2":
        assert styles["transformer.h.1.attn"] == "enter" and styles["transformer.h.1.attn.c_attn"] == "colwise_qkv"
        assert styles["transformer.h.0.mlp.c_proj"] == "rowwise" and styles["transformer.wpe"] == "keep"
        assert styles["transformer.wte"] == "vocab_embedding_whole" and styles["transformer.ln_f"] == "final_norm"
        return
    prefix, layers, embedding = NAMES.get(kind, ("model", "model.layers", "model.embed_tokens"))
    # derived from transformers' pipeline plan: the embedding, the first layer, the final norm, the head
    assert styles[embedding] == "vocab_embedding_whole" and styles["lm_head"] == "vocab_head_entered"
    assert styles[f"{layers}.0"] == "split_sequence"
    assert styles[{"gpt_neox": "gpt_neox.final_layer_norm"}.get(kind, "model.norm")] == "final_norm"
    # every norm of a layer outside attention and MLP runs on sequence shards (Gemma 2: four of them)
    norms = {n.rpartition(".")[2] for n, s in styles.items() if s == "sequence_norm" and n.startswith(f"{layers}.1.")}
    assert norms == LAYER_NORMS.get(kind, {"input_layernorm", "post_attention_layernorm"})
    attn = f"{layers}.0.{'attention' if kind == 'gpt_neox' else 'self_attn'}"
    moe = kind in ("mixtral", "qwen3_moe", *LATENT)  # the sparse MoE block, found from the experts the plans name
    assert styles[attn] == "enter" and styles[f"{layers}.1.mlp"] == ("replicate" if moe else "enter")
    if kind in ("qwen3", "gemma3_text", "exaone4", "qwen3_moe"):  # per-head norms on each rank's own heads: gradients summed over tp
        assert styles[f"{attn}.q_norm"] == styles[f"{attn}.k_norm"] == "sum_grads"
    if kind in ("olmo2", "olmo3"):  # norms over every head: q, k, v gathered whole (as its plan says), the norms kept whole
        assert styles[f"{attn}.q_proj"] == "colwise_gather" and styles[f"{attn}.o_proj"] == "rowwise_split"
        assert styles[f"{attn}.q_norm"] == styles[f"{attn}.k_norm"] == "keep"
    if kind == "phi3":  # its plan gathers the fused projections; the family's notes split them block by block
        assert styles[f"{attn}.qkv_proj"] == styles[f"{layers}.0.mlp.gate_up_proj"] == "colwise_packed"
        assert styles[f"{attn}.o_proj"] == "rowwise"
    if kind in LATENT:  # the low-rank down projections and their norms run whole, before the split by heads
        whole = ("kv_a_proj_with_mqa", "kv_a_layernorm", *(("q_a_proj", "q_a_layernorm") if kind == "deepseek_v3" else ()))
        assert {styles[f"{attn}.{m}"] for m in whole} == {"sum_grads"}
        q = "q_b_proj" if kind == "deepseek_v3" else "q_proj"
        assert styles[f"{attn}.{q}"] == styles[f"{attn}.kv_b_proj"] == "colwise" and styles[f"{attn}.o_proj"] == "rowwise"
    if moe:  # transformers' packed_colwise / moe_tp_experts entries are inside the replicated block
        assert not any(n.startswith("model.layers.1.mlp.") for n in styles)


def test_a_module_no_rule_places_is_named(configs):
    # an architecture without rules: transformers' plan splits the projections, nothing places the rest
    llama = _model(configs, "llama")
    with pytest.raises(ValueError, match=r"cannot place 'model.embed_tokens' \(Embedding\) \(and \d+ more\)"):
        apply_plan(llama, hf_tp_plan(llama, None).styles, TPContext(), place_all=True)
    gpt2 = _model(configs, "gpt2")  # no base_model_tp_plan at all
    with pytest.raises(ValueError, match="cannot place 'transformer.wte'"):
        apply_plan(gpt2, hf_tp_plan(gpt2, None).styles, TPContext(), place_all=True)
    # a module the family's rules do not know, added to a known family
    llama = _model(configs, "llama")
    llama.model.layers[1].adapter = nn.Linear(32, 32)
    with pytest.raises(ValueError, match=r"cannot place 'model.layers.1.adapter' \(Linear\): outside the attention"):
        apply_plan(llama, hf_tp_plan(llama, tp_rules(llama, FAMILIES["llama"])).styles, TPContext(), place_all=True)
    # a module with weights inside the attention, whose projections the plan splits by heads
    llama = _model(configs, "llama")
    llama.model.layers[0].self_attn.gain = nn.Linear(8, 8)
    with pytest.raises(ValueError, match=r"cannot place 'model.layers.0.self_attn.gain' \(Linear\): inside "
                                         r"model.layers.\*.self_attn, whose projections the plan splits by heads"):
        tp_rules(llama, FAMILIES["llama"])
    # not nn.Linear nor Conv1D where a linear style is asked for
    with pytest.raises(ValueError, match="cannot place 'model.layers.0.input_layernorm'.*neither an nn.Linear"):
        apply_plan(llama, {"model.layers.0": "enter", "model.layers.0.input_layernorm": "colwise"}, TPContext())


def test_config_refuses_what_tensor_parallelism_cannot_split(configs, tmp_path):
    for kind in ("llama", "mixtral", "gpt2", *PLANNED, *DERIVED, *LATENT):
        assert _cfg(configs[kind], "parallel.tp=2").parallel.tp == 2
    # Cohere's optional q/k norms hold a weight per head (2-D), which its plan does not split: the derivation
    # refuses them by name
    qk = tmp_path / "cohere_qk.json"
    qk.write_text(json.dumps({**PLANNED["cohere"], "use_qk_norm": True}))
    assert hf_tp_refusal(PLANNED["cohere"]) is None
    with pytest.raises(ConfigError, match=r"parallel.tp: model_type 'cohere': tensor parallelism cannot place "
                                          r"'model.layers.0.self_attn.q_norm' \(CohereLayerNorm\): inside "
                                          r"model.layers.\*.self_attn"):
        _cfg(str(qk), "parallel.tp=2")
    assert _cfg(str(qk), "parallel.pp=2", "parallel.micro_batches=2").parallel.pp == 2  # a pipeline cuts it
    with pytest.raises(ConfigError, match="parallel.tp: model_type 'opt': OPTForCausalLM's config declares no "
                       "base_model_tp_plan"):
        _cfg(configs["opt"], "parallel.tp=2")
    with pytest.raises(ConfigError, match=r"n_kv_head \(2\) is not divisible by tp \(4\)"):  # GQA: kv heads split
        _cfg(configs["llama"], "parallel.tp=4")
    with pytest.raises(ConfigError, match="train.seq_len"):
        _cfg(configs["gpt2"], "parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=15")
    # GPT-2's per-head split of its fused q|k|v is checkpointed as pieces of the logical tensor
    assert _cfg(configs["gpt2"], "parallel.tp=2", "checkpoint.every=2").checkpoint.every == 2


# families the derivation from their plans refuses (tessel.hf.layout), on their config class's defaults shrunk:
# model type -> what the refusal must name
REFUSED = {
    "minimax": r"cannot place 'model.layers.\d.self_attn.norm' \(MiniMaxRMSNorm\): inside model.layers.\*.self_attn",
    "gpt_oss": "GptOssForCausalLM's config declares no base_model_tp_plan",
    # its plan names no module of its attention, nor does the plan of any family its attention derives from
    "kimi_linear": r"cannot place 'model.layers.0.self_attn.q_proj' \(Linear\): outside the attention and the MLP: "
                   r"base_model_tp_plan names no module of model.layers.\*.self_attn",
    # latent attention inside a list of attentions (two a layer), whose modules the plan names under it
    "longcat_flash": r"cannot place 'model.layers.0.self_attn.0.q_a_proj' \(Linear\): it holds weights of its own",
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_the_derivation_refuses_what_the_plans_do_not_place(kind):
    """Before any process starts, the rules the ranks would run, on transformers' model built on the meta device:
    a family without a table entry is refused by the module or the plan entry they cannot place."""
    from tessel.commands.support import tiny_config as family_defaults
    why = hf_tp_refusal(family_defaults(kind))
    assert why is not None and re.search(REFUSED[kind], why), why
    assert why.startswith(f"model_type '{kind}': ")


def test_a_module_runs_whole_in_a_split_region_only_before_the_split():
    """tessel.hf.region_inputs reads a region's forward: a module the plan does not name runs whole on every rank
    (its gradients summed over tp) only where every call of it takes whole values and nothing made from it alone
    leaves the region; a norm after the split, or a gate on the whole input multiplying the output, is not."""
    from tessel.hf.region_inputs import before_split

    class Latent(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_a, self.norm, self.q_b = nn.Linear(8, 4), nn.LayerNorm(4), nn.Linear(4, 8)
            self.o_proj, self.gate = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, hidden_states):
            return self.o_proj(self.q_b(self.norm(self.q_a(hidden_states))))

    class After(Latent):
        def forward(self, hidden_states):
            q = self.q_b(self.q_a(hidden_states))
            return self.o_proj(self.norm(q))

    class Gated(Latent):
        def forward(self, hidden_states):
            out = self.o_proj(self.q_b(self.norm(self.q_a(hidden_states))))
            return out * self.gate(hidden_states)

    split, rows = frozenset({"q_b"}), frozenset({"o_proj"})
    assert before_split(Latent(), split, rows) == {"q_a", "norm"}
    assert before_split(After(), split, rows) == {"q_a"}
    assert before_split(Gated(), split, rows) == frozenset()


def test_an_attention_its_plan_is_silent_on_takes_its_parent_familys_entries():
    """DeepSeek-V3's plan names no module of its attention; transformers' modular source derives the class from
    DeepSeek-V2's, whose plan splits it: those entries, and nothing of the MLP (its own plan names it)."""
    from tessel.hf.layout import meta_model
    from tessel.hf.lineage import inherited_entries
    from transformers import DeepseekV2Config
    model = meta_model(LATENT["deepseek_v3"])
    want = {k: s for k, s in DeepseekV2Config.base_model_tp_plan.items() if k.startswith("layers.*.self_attn.")}
    assert inherited_entries(model, dict(model.config.base_model_tp_plan)) == want
    llama = meta_model(CONFIGS["llama"])
    assert inherited_entries(llama, dict(llama.config.base_model_tp_plan)) == {}


def test_without_a_pipeline_plan_tp_reads_the_cut_off_the_structure():
    """OLMoE's config declares a tensor-parallel plan and no pipeline plan: tensor parallelism finds its embedding,
    layers, final norm and head in its base model's modules (tessel.hf.layout.structural_cut); a pipeline, which
    would also need what each part takes and gives, is refused naming the missing plan."""
    from tessel.config import hf_pp_refusal
    from tessel.hf.layout import meta_model, structural_cut
    from tessel.commands.support import tiny_config as family_defaults
    doc = family_defaults("olmoe")
    assert hf_tp_refusal(doc) is None
    assert "OlmoeForCausalLM's config declares no base_model_pp_plan" in hf_pp_refusal(doc)
    cut = structural_cut(meta_model(doc))
    assert (cut.before, cut.blocks, cut.after) == (("model.embed_tokens",), "model.layers", ("model.norm", "lm_head"))


def test_scalar_weights_inside_a_split_region_sum_their_gradients():
    """Apertus' xIELU activation holds scalar weights between its MLP's up and down projections: each rank applies
    them to its own columns, so each holds a part of their gradient, summed over tp (as the plan's q/k norms)."""
    from tessel.commands.support import tiny_config as family_defaults
    from tessel.hf.layout import meta_model
    model = meta_model(family_defaults("apertus"))
    styles = match_plan(model, hf_tp_plan(model, tp_rules(model, family_of("apertus"))).styles)
    assert styles["model.layers.0.mlp.act_fn"] == "sum_grads" and styles["model.layers.0.mlp"] == "enter"
    assert unplaced_modules(model, styles) == []


def test_grouped_query_qkv_splits_block_by_block_and_gathers_back():
    """Phi-3's fused q|k|v under grouped-query attention: 4 q heads, 2 k and 2 v heads of 2 features, blocks of
    relative sizes (4, 2, 2). Rank r holds q heads 2r, 2r+1 and k, v head r, side by side; gathered over tp
    (full_tensor) and cut back from the whole tensor (a checkpoint's packed_slice) it is the same tensor."""
    torch.manual_seed(0)
    qkv, x = nn.Linear(8, 16, bias=False), torch.randn(2, 3, 8)
    q, k, v = qkv(x).split([8, 4, 4], dim=-1)
    shards = []
    for rank in range(2):
        col = ColumnParallelLinear.from_linear(qkv, TPContext(size=2, rank=rank), blocks=(4, 2, 2), enter=False)
        assert col.weight.shape == (8, 8) and packed_dims(col.weight) == {"tp": (0, (4, 2, 2))}
        mine = lambda t: t[..., t.size(-1) // 2 * rank:t.size(-1) // 2 * (rank + 1)]  # noqa: E731
        assert_close(col(x), torch.cat([mine(q), mine(k), mine(v)], dim=-1))
        assert_close(col.weight, packed_slice(qkv.weight, 0, (4, 2, 2), 2, rank))
        shards.append(col.weight)
    pieces = [s.split([4, 2, 2]) for s in shards]
    whole = torch.cat([torch.cat([p[b] for p in pieces]) for b in range(3)])
    assert_close(whole, qkv.weight)


def test_the_gemma2_config_exercises_its_caps_and_window(configs, tmp_path):
    """The tp and pp parity of Gemma 2 shows that its soft-caps and windows are right on split heads and
    vocabulary shards only if they change the output: each, turned off, moves the logits by over 10 times the
    parity tolerance on losses (the vocab-parallel loss sees logits the model capped on each shard,
    elementwise; the attention caps each split head's scores)."""
    ids = torch.arange(16).unsqueeze(0) * 5 % 128
    logits = _model(configs, "gemma2")(ids)
    cap = PLANNED["gemma2"]["final_logit_softcapping"]
    assert logits.abs().max() < cap
    for key, off in (("final_logit_softcapping", None), ("attn_logit_softcapping", None), ("sliding_window", 64)):
        path = tmp_path / f"{key}.json"
        path.write_text(json.dumps({**PLANNED["gemma2"], key: off}))
        torch.manual_seed(0)
        other = build_model(_cfg(str(path)).model)(ids)
        assert (other - logits).abs().max() > 10 * LOSS_TOL["atol"], key


def test_conv1d_and_packed_qkv_layers_keep_transformers_layout():
    """GPT-2's Conv1D (weight [in, out]) split by columns and rows, and its fused q|k|v split per head:
    rank r holds the q, k and v columns of heads r*H/tp.., so its attention runs on whole heads."""
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(0)
    qkv, proj, x = Conv1D(3 * 8, 8), Conv1D(8, 8), torch.randn(2, 3, 8)
    q, k, v = qkv(x).split(8, dim=-1)
    for rank in range(2):
        ctx = TPContext(size=2, rank=rank)  # no group: the layers' local math, one rank at a time
        col = ColumnParallelLinear.from_linear(qkv, ctx, blocks=(1, 1, 1), enter=False)
        assert col.weight.shape == (8, 12) and col.bias.shape == (12,)
        mine = slice(4 * rank, 4 * rank + 4)
        assert_close(col(x), torch.cat([q[..., mine], k[..., mine], v[..., mine]], dim=-1))
        row = RowParallelLinear.from_linear(proj, ctx)
        assert row.weight.shape == (4, 8)  # the input rows of [in, out]
        assert_close(row.weight, proj.weight[mine])


def test_region_hooks_find_the_input_by_keyword_and_after_recompute():
    """Defect 8: HF decoder layers call attention as self_attn(hidden_states=...); a hook that reads
    args[0] crashed. The input is found by position or by its name, also once recompute wrapped forward."""
    from tessel.parallel.recompute import recompute_blocks

    class Attention(nn.Module):
        def forward(self, hidden_states, position_embeddings=None):
            return hidden_states + (0 if position_embeddings is None else position_embeddings)

    attn = Attention()
    regions.on_input(attn, lambda h: h * 10)
    recompute_blocks([attn])
    one = torch.ones(2)
    assert attn(one).tolist() == [10, 10]
    assert attn(hidden_states=one, position_embeddings=one).tolist() == [11, 11]
    assert attn(one, position_embeddings=one).tolist() == [11, 11]


def test_the_models_own_loss_is_refused_on_vocab_sharded_logits(configs):
    model = _model(configs, "gpt2")
    regions.refuse_own_loss(model)
    ids = torch.randint(0, 128, (1, 8))
    with pytest.raises(ValueError, match="the model's own loss"):
        model(ids, labels=ids)
    assert model(ids).shape == (1, 8, 128)  # without labels: its logits, scored by tessel's loss
