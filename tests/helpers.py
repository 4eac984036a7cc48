"""Shared pieces of the multi-process tests: tiny configs and a training run that reports back."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from tessel.config import Config, build_config, to_toml
from tessel.mesh import make_mesh
from tessel.models.build import build_model
from tessel.apply import parallelize
from tessel.sharding import shard_dims
from tessel.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "model": {"vocab_size": 256, "n_layer": 2, "n_head": 4, "d_model": 32, "max_seq_len": 32},
    "train": {"steps": 10, "global_batch": 8, "seq_len": 16, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2,
              "eval_every": 0, "sample_tokens": 0},
    "data": {"source": "synthetic"},
    # no plots: drawing curves.png takes rank 0 about 2 s of CPU a run (more than a tiny run's training) while
    # the other ranks wait; the tests that look at the pictures run a recipe of recipes/, which draws them
    "logging": {"progress": False, "tensorboard": False, "plots": False, "peak_flops": 1e9},
}


# Families placed from transformers' own plans (tessel.models.hf.tp_plan.rules_from_plan), each chosen for a
# piece the plan leaves to tessel: grouped-query attention (4 heads, 2 kv heads: one a rank), explicit tying.
DENSE = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
         "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
PLANNED = {
    "qwen3": {**DENSE, "model_type": "qwen3"},  # per-head q/k norms: replicated, gradients summed over tp
    "gemma": {**DENSE, "model_type": "gemma", "tie_word_embeddings": True},  # scaled embedding, GELU MLP
    # 4 norms a layer, a sliding window (4 < seq_len 16) on every other layer, the attention's and the final
    # logits' soft-caps set near the values they cap, so that both change the output (test_hf_tensor_parallel)
    "gemma2": {**DENSE, "model_type": "gemma2", "tie_word_embeddings": True, "sliding_window": 4,
               "query_pre_attn_scalar": 8, "attn_logit_softcapping": 0.05, "final_logit_softcapping": 0.3},
    "olmo2": {**DENSE, "model_type": "olmo2"},  # q/k norms over every head: the plan gathers q, k, v whole
    "granite": {**DENSE, "model_type": "granite", "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                "attention_multiplier": 0.125, "logits_scaling": 8.0},
    "phi3": {**DENSE, "model_type": "phi3"},  # fused q|k|v (4, 2, 2 heads) and gate|up, split block by block
    # q|k|v interleaved per head (a plain column split gives whole heads), attention and MLP in parallel
    "gpt_neox": {"model_type": "gpt_neox", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
                 "bos_token_id": 1, "eos_token_id": 2},
    "starcoder2": {**DENSE, "model_type": "starcoder2", "tie_word_embeddings": True},  # biases, LayerNorm
    # one LayerNorm before attention and MLP side by side, the logits scaled
    "cohere": {**DENSE, "model_type": "cohere", "tie_word_embeddings": True, "logit_scale": 0.5},
    # per-head q/k norms, a scaled embedding, sliding windows
    "gemma3_text": {**DENSE, "model_type": "gemma3_text", "tie_word_embeddings": True, "sliding_window": 4,
                    "query_pre_attn_scalar": 8},
}

# Families with no entry in tessel's table (tessel.models.hf.families.FAMILIES), placed by the derivation from
# their plans alone (tessel.hf.layout), each for a structure the table's families lack
DERIVED = {
    # post-attention and post-MLP norms (4 a layer), a fused gate|up projection its plan gathers, partial rotary
    "glm4": {**DENSE, "model_type": "glm4", "tie_word_embeddings": False},
    # attention and MLP in parallel after one LayerNorm, sliding windows (4 < seq_len 16) on 3 of 4 layers, tied
    # and scaled logits
    "cohere2": {**DENSE, "model_type": "cohere2", "tie_word_embeddings": True, "sliding_window": 4,
                "logit_scale": 0.5},
    # per-head q/k norms and norms after attention and MLP only, sliding windows
    "exaone4": {**DENSE, "model_type": "exaone4", "tie_word_embeddings": False, "sliding_window": 4},
    # q/k norms over every head (gathered q, k, v as OLMo 2), sliding windows
    "olmo3": {**DENSE, "model_type": "olmo3", "tie_word_embeddings": False, "sliding_window": 4},
    # q/k/v biases; its default dropout (0.1) off, as every parity test trains
    "seed_oss": {**DENSE, "model_type": "seed_oss", "tie_word_embeddings": False, "attention_bias": True,
                 "attention_dropout": 0.0, "residual_dropout": 0.0},
    "ernie4_5": {**DENSE, "model_type": "ernie4_5", "tie_word_embeddings": True},
    # MoE: its first layer dense (an MLP split by the plan), its second a sparse block every tp rank computes whole
    "qwen3_moe": {**DENSE, "model_type": "qwen3_moe", "tie_word_embeddings": False, "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [0]},
}


# Multi-head latent attention (tessel.hf.region_inputs, tessel.hf.lineage): low-rank q and kv down projections
# and their norms computed whole on every tp rank, q_b_proj (q_proj without a q rank) and kv_b_proj split by heads;
# a dense first layer, then an MoE with a shared expert. 4 heads and 4 kv heads (the keys kv_b_proj makes are one
# per head), so that tp2 gives each rank 2 whole heads.
MLA = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64, "bos_token_id": 1,
       "eos_token_id": 2, "pad_token_id": 0, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
       "qk_nope_head_dim": 4, "v_head_dim": 8, "first_k_dense_replace": 1, "n_routed_experts": 4,
       "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 1}
LATENT = {
    # its plan names no module of its attention: the split comes from DeepSeek-V2's, the class it derives from
    "deepseek_v3": {**MLA, "model_type": "deepseek_v3", "n_group": 1, "topk_group": 1},
    "deepseek_v2": {**MLA, "model_type": "deepseek_v2", "q_lora_rank": None},  # q_proj, no low-rank q
}


def tiny_config(*overrides: str, out_dir: str | None = None) -> Config:
    # a private directory per run: concurrent test sessions must not share metrics files
    out_dir = out_dir or tempfile.mkdtemp(prefix="tessel-test-")
    raw = {k: dict(v) for k, v in TINY.items()}
    if any(o.startswith("model.hf_config") for o in overrides):
        raw.pop("model")  # a Hugging Face config brings its own shape
    return build_config(raw, [f'logging.out_dir="{out_dir}"', *overrides])


def write_recipe(path: Path, *overrides: str) -> Path:
    """TINY with overrides, as the recipe file a user hands `tessel train` (out_dir is set per run)."""
    path.write_text(to_toml(build_config({k: dict(v) for k, v in TINY.items()}, list(overrides))))
    return path


def train_command(recipe: Path, out: Path, *args: str) -> list[str]:
    """`python -m tessel train RECIPE` writing to `out`, as a user types it."""
    return [sys.executable, "-m", "tessel", "train", str(recipe), "--set", f'logging.out_dir="{out}"', *args]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI run: this checkout on the path, one thread per rank."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))), "OMP_NUM_THREADS": "1", **extra}


def build_runner(cfg: Config, init_seed: int | None = None):
    """The model and the Runner `tessel train` builds on each rank (no Trainer), on the current process
    group (or alone). Returns (model, runner, mesh); init_seed overrides the weights' seed."""
    p = cfg.parallel
    mesh = make_mesh(p.axis_sizes, order=p.rank_order)
    torch.manual_seed(cfg.train.seed if init_seed is None else init_seed)
    model = build_model(cfg.model)
    return model, parallelize(model, mesh, cfg), mesh


def build_trainer(cfg: Config, init_seed: int | None = None):
    """What `tessel train` builds on each rank, on the current process group (or alone).

    Returns (trainer, model, runner, mesh); init_seed overrides the weights' seed.
    """
    model, runner, mesh = build_runner(cfg, init_seed)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return Trainer(cfg, mesh, runner, rank), model, runner, mesh


def train_and_collect(cfg: Config, weights: bool = True) -> dict:
    """Train with cfg on the current process group (or alone); return losses and full weights.

    weights=False returns losses only: under ZeRO-3 the module's own parameters
    are freed between steps, and only the sharded optimizer holds their values.
    """
    trainer, model, _, _ = build_trainer(cfg)
    summary = trainer.fit()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()} if weights else {}
    return {"losses": summary.losses, "state": state, "val_loss": summary.val_loss, "sample": summary.sample,
            "grad_norms": [row["grad_norm"] for row in trainer.history]}


def metrics_rows(out_dir) -> list[dict]:
    """The rows a run wrote to <out_dir>/metrics.jsonl, in order."""
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def write_configs(folder: Path, docs: dict[str, dict]) -> dict[str, str]:
    """Each model config of `docs` written as <name>.json in folder (what model.hf_config names); name -> path."""
    for name, doc in docs.items():
        (folder / f"{name}.json").write_text(json.dumps(doc))
    return {name: str(folder / f"{name}.json") for name in docs}


def whole_weights(model, runner, mesh, sequence_parallel: bool) -> dict[str, torch.Tensor]:
    """Every parameter whole (gathered over tp) under the model's own names, on every rank: under pp each stage
    holds its own names (both ends a tied tensor), gathered over the stages."""
    from tessel.parallel.tensor.tensor_parallel import TPContext, full_tensor  # deferred: the parallel layers
    ctx = TPContext.from_mesh(mesh, sequence_parallel)
    pp = mesh.size("pp")
    named = runner.named_parameters() if pp > 1 else dict(model.named_parameters(remove_duplicate=False))
    weights = {n: full_tensor(q, q, ctx) for n, q in named.items()}
    if pp > 1:
        stages = [None] * pp
        dist.all_gather_object(stages, weights, group=mesh.group("pp"))
        weights = {n: t for stage in stages for n, t in stage.items()}
    return weights


def train_whole(cfg: Config, probe: torch.Tensor | None = None) -> dict:
    """Train with cfg through the trainer `tessel train` runs (checkpointing as cfg says), on the current process
    group (or alone): each step's loss (the global batch's mean), every weight whole (whole_weights), how far the
    weights moved (one process only) and, given a probe batch, the loss the trained sharded model computes on it."""
    trainer, model, runner, mesh = build_trainer(cfg)
    start = {n: q.detach().clone() for n, q in model.named_parameters()} if mesh.world_size == 1 else {}
    losses = trainer.fit().losses
    weights = whole_weights(model, runner, mesh, cfg.parallel.sequence_parallel)
    moved = max(((weights[n] - w).abs().max().item() for n, w in start.items()), default=0.0)
    out = {"losses": losses, "weights": weights, "moved": moved}
    if probe is not None:
        with torch.no_grad():
            out["probe_loss"] = runner.evaluate(probe[:, :-1], probe[:, 1:]).item()
    return out


# ---- export: `tessel export --format hf` and what transformers then computes -----------------------------
def export_hf(checkpoint: Path, out: Path, *args: str) -> None:
    """`tessel export CHECKPOINT --format hf --out OUT [args]`, as a user types it; it must succeed."""
    import pytest
    import tessel.commands.cli
    with pytest.raises(SystemExit) as code:
        tessel.commands.cli.main(["export", str(checkpoint), "--format", "hf", "--out", str(out), *args])
    assert code.value.code == 0


def hf_logits(folder: Path, x: torch.Tensor) -> torch.Tensor:
    """The logits of the model AutoModelForCausalLM.from_pretrained(folder) loads."""
    from transformers import AutoModelForCausalLM  # deferred: transformers is heavy
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(x).logits


def tessel_logits(cfg: Config, checkpoint: Path, x: torch.Tensor) -> torch.Tensor:
    """The checkpoint's model as tessel computes it: one process, loaded by the trainer's own resume path."""
    from tessel.train.checkpoint.manager import CheckpointManager
    trainer, model, _, mesh = build_trainer(cfg, init_seed=99)  # other weights: the load must win
    CheckpointManager(checkpoint.parent, mesh).load(checkpoint, trainer.state.tensors)
    with torch.no_grad():
        return model.eval()(x)


def whole_over_ep(t: torch.Tensor, p: torch.Tensor, mesh) -> torch.Tensor:
    """The whole tensor of a parameter sharded over ep (experts along dim 0)."""
    dim = shard_dims(p).get("ep")
    if dim is None or mesh.size("ep") == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(mesh.size("ep"))]
    dist.all_gather(parts, t.detach().contiguous(), group=mesh.group("ep"))
    return torch.cat(parts, dim=dim)
