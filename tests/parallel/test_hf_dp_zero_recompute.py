"""Hugging Face families tessel has no tp/pp rules for train under dp, ZeRO-3 and full recompute (what the
refusals on the other axes promise), each against the unmodified single-process transformers model scored by
its own loss: model(input_ids, labels=targets, shift_labels=targets).loss, the cross-entropy plus, for an MoE
whose config sets output_router_logits, router_aux_loss_coef * its load_balancing_loss_func.

- Gemma 2 (no SDPA in transformers: its eager attention, with soft-capping and a sliding window shorter than
  the sequence), built by tessel's own build as `tessel train` builds it, under dp2 x ZeRO-3 x full recompute;
- Qwen3-MoE with 8 experts per token of 16 and its router loss, one process and dp2 (the balance statistics
  of the whole batch, model.aux_loss_scope = "global"), and with 2 of 4, one process; Mixtral with 4 per token, dp2;
- DeepSeek-V3 (latent attention, shared experts, a first dense layer; its forward adds no router loss) under
  full recompute, one process and dp2: the key/value cache stays off, so the recomputed forward is the first's;
- twelve families more (FAMILIES), each from its config class's defaults shrunk, under dp2 x ZeRO-3 x full
  recompute.

Each run starts from the weights transformers draws under the run's seed (tests.helpers.build_runner) and takes
3 AdamW steps on the same batches (dp: each rank half of each batch, the loss their mean).
"""

import json

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from tessel.commands import support
from tessel.axes import TOKEN_AXES
from tessel.hf.config import transformers_config
from tessel.mesh import make_mesh
from tessel.parallel.norms import clip_grad_norm_
from tessel.spawn import spawn
from tessel.train.data import BatchSampler, load_tokens
from tessel.train.mesh_cohort import mean_over
from tessel.train.optim import build_optimizer, optimizer_params
from tests.helpers import build_runner, tiny_config, write_configs

STEPS = 3
SMALL = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
# router_aux_loss_coef 0.5 (Mixtral's default is 0.001): the router loss (about top_k at a fresh router) is then
# a third of the loss or more, so dropping it or taking it over the wrong tokens shows far outside the tolerance
CONFIGS = {
    "gemma2": {**SMALL, "model_type": "gemma2", "head_dim": 8, "sliding_window": 8},
    "qwen3_moe": {**SMALL, "model_type": "qwen3_moe", "head_dim": 8, "num_experts": 16, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 16, "output_router_logits": True, "router_aux_loss_coef": 0.5},
    # 2 per token, within tessel's own MoE limit: the router loss alone is what a dropped one fails on (issue 31's
    # defect 2; the 8-per-token case above is refused first where the limit is checked against the config)
    "qwen3_moe_top2": {**SMALL, "model_type": "qwen3_moe", "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                       "moe_intermediate_size": 16, "output_router_logits": True, "router_aux_loss_coef": 0.5},
    "mixtral": {**SMALL, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 4,
                "output_router_logits": True, "router_aux_loss_coef": 0.5},
    "deepseek_v3": {**SMALL, "model_type": "deepseek_v3", "num_key_value_heads": 4, "moe_intermediate_size": 16,
                    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2,
                    "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 24,
                    "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8, "output_router_logits": True},
}
# Families of every structure tessel reads, each from its own config class's defaults shrunk to 2 layers
# (tessel.commands.support.tiny_config): q/k norms (Qwen3, OLMo 2), fused q|k|v and gate|up (Phi-3), parallel blocks
# (GPT-NeoX, Cohere, Phi), multipliers and a scaled head (Granite, Cohere), four norms a block (GLM-4), a
# sliding window on every layer (StarCoder2, Mistral), a scaled embedding (Gemma), experts with shared ones
# (Qwen2-MoE)
FAMILIES = ("qwen3", "olmo2", "phi3", "gpt_neox", "cohere", "phi", "granite", "glm4", "starcoder2", "mistral",
            "gemma", "qwen2_moe")
RECOMPUTE = 'parallel.recompute="full"'
ZERO3 = ["parallel.dp=2", "parallel.zero_stage=3", RECOMPUTE]
ONE = {"qwen3_moe": [], "qwen3_moe_top2": [], "deepseek_v3": [RECOMPUTE]}
DP2 = {"gemma2": ZERO3, "qwen3_moe": ["parallel.dp=2"], "mixtral": ["parallel.dp=2"],
       "deepseek_v3": ["parallel.dp=2", RECOMPUTE], **{kind: ZERO3 for kind in FAMILIES}}
# fp32. One process: the same model, the same ops, and recompute runs the same forward again (measured: equal
# bit for bit; the tolerance below is the dp2 one). dp2: each rank's half of the
# batch, gradients averaged, the balance statistics summed over the ranks, ZeRO-3's gradients reduce-scattered:
# sums in another order, ~1e-7 relative per op; AdamW turns a near-zero gradient's rounding into up to an
# lr-sized step (lr 1e-3), so weights get 1/20 of one (as tests/parallel/expert/test_hf_expert_parallel.py). A lost
# router loss moves the loss by >= 1 and weights by ~lr; statistics per rank instead of the batch's move the loss
# by ~1e-4 (measured on Mixtral there); a cache recomputed twice does not run at all. Measured here: losses
# within 1e-6, weights within 1e-6.
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
WEIGHT_TOL = dict(rtol=1e-4, atol=5e-5)


def _family_config(kind: str) -> dict:
    doc = {**support.tiny_config(kind), "num_hidden_layers": 2}
    return {**doc, "layer_types": None} if "layer_types" in doc else doc  # the class lays out 2 layers' types


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    families = {kind: _family_config(kind) for kind in FAMILIES}
    return write_configs(tmp_path_factory.mktemp("families"), {**CONFIGS, **families})


def _cfg(path: str, *overrides: str):
    return tiny_config(f'model.hf_config="{path}"', *overrides, "train.lr=1e-3")


def _batches(cfg, shard: int = 0, shards: int = 1) -> BatchSampler:
    tokens = load_tokens(cfg.data, cfg.model.vocab_size, seed=cfg.train.seed)
    return BatchSampler(tokens.train, cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed, shard, shards)


def _tessel(path: str, overrides: list[str]) -> dict:
    """3 steps as a trainer takes them: the model tessel builds, parallelize()'s runner, its optimizer."""
    cfg = _cfg(path, *overrides)
    model, runner, mesh = build_runner(cfg)
    opt = runner.optimizer or build_optimizer(runner.parameters(), cfg.train)
    sampler = _batches(cfg, mesh.coord("dp"), mesh.size("dp"))
    losses = []
    for _ in range(STEPS):
        loss = mean_over(runner.forward_backward(*sampler.next()).float(), mesh, *TOKEN_AXES)
        losses.append(loss.item())
        clip_grad_norm_(optimizer_params(opt), cfg.train.grad_clip, mesh)
        opt.step()
        opt.zero_grad(set_to_none=False)
    gathered = getattr(runner.model, "gathered", None)  # ZeRO-3: the shards made whole for the duration
    with gathered() if gathered is not None else torch.no_grad():
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "weights": weights}


def _dp2(paths: dict[str, str]) -> dict:
    return {name: _tessel(paths[name], overrides) for name, overrides in DP2.items()}


def _transformers(path: str) -> dict:
    """The unmodified model on the whole batches, scored by its own loss (router loss included)."""
    from transformers import AutoModelForCausalLM
    cfg = _cfg(path)
    doc = json.loads(open(path).read())
    torch.manual_seed(cfg.train.seed)  # the seed build_runner draws tessel's copy from
    model = AutoModelForCausalLM.from_config(transformers_config(doc))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    opt, sampler, mesh = build_optimizer(params, cfg.train), _batches(cfg), make_mesh({"pp": 1, "dp": 1, "ep": 1, "tp": 1})
    losses, aux = [], None
    for _ in range(STEPS):
        x, y = sampler.next()
        y = y.contiguous()  # transformers views the targets flat
        out = model(input_ids=x, labels=y, shift_labels=y)  # targets as given: tessel's are already shifted
        out.loss.backward()
        losses.append(out.loss.item())
        aux = getattr(out, "aux_loss", None)
        clip_grad_norm_(params, cfg.train.grad_clip, mesh)
        opt.step()
        opt.zero_grad(set_to_none=False)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = max((weights[n] - w).abs().max().item() for n, w in start.items())
    return {"losses": losses, "weights": weights, "moved": moved, "aux": None if aux is None else aux.item()}


@pytest.fixture(scope="module")
def runs(paths) -> dict:
    one = {name: _tessel(paths[name], overrides) for name, overrides in ONE.items()}
    return {"reference": {name: _transformers(path) for name, path in paths.items()}, "one": one,
            "dp2": spawn(_dp2, 2, paths)}


def _assert_matches(got: dict, want: dict, where: str) -> None:
    assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **LOSS_TOL, msg=lambda m: f"{where}: {m}")
    assert got["weights"].keys() == want["weights"].keys(), where
    for n, w in want["weights"].items():
        assert_close(got["weights"][n], w, **WEIGHT_TOL, msg=lambda m: f"{where} {n}: {m}")


@pytest.mark.parametrize("name", [*CONFIGS, *FAMILIES])
def test_family_trains_like_transformers(runs, name):
    want = runs["reference"][name]
    if name in ONE:
        _assert_matches(runs["one"][name], want, f"{name} one process")
    for rank, result in enumerate(runs["dp2"] if name in DP2 else []):
        _assert_matches(result[name], want, f"{name} dp2 rank {rank}")


def test_the_references_add_what_their_family_adds(runs):
    """The comparisons above are not vacuous: the MoE references carry a router loss of about top_k (E * sum f*P
    at a fresh router), DeepSeek-V3's none (its forward adds no load-balancing loss), and every model's weights
    moved by more than a few of the tolerance's lr/20 (3 AdamW steps of lr 1e-3 move a weight by up to 3e-3)."""
    ref = runs["reference"]
    assert ref["qwen3_moe"]["aux"] == pytest.approx(8, rel=0.05) and ref["mixtral"]["aux"] == pytest.approx(4, rel=0.05)
    assert ref["qwen3_moe_top2"]["aux"] == pytest.approx(2, rel=0.05)
    assert ref["deepseek_v3"]["aux"] is None
    assert all(r["moved"] > 1e-3 for r in ref.values()), {name: r["moved"] for name, r in ref.items()}
