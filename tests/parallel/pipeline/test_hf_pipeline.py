"""Pipeline parallelism on Hugging Face models, unmodified: parity with one process.

A stage is transformers' own model with the modules it does not hold removed or stood in for
(tessel.models.parts: a later stage takes its hidden states as inputs_embeds); nothing of the
model's forward is copied and nothing is traced. The reference is the same model built by
transformers from the same local config and seed, alone, trained on the same global batches
with tessel's cross-entropy on its logits. Each layout runs 5 optimizer steps through the
trainer `tessel train` runs (tests.helpers.train_whole); the losses of every step and the final weights
(every stage's, gathered whole over tp) are compared. One spawn of 2 ranks (pp2 1F1B for Llama
with and without full recompute, GPT-2 with its tied head across stages, and the zero-bubble
schedules ZB-H1, ZBV (Llama) and ZB-H2 (GPT-2), whose split backward runs on the decoder layers) and one of 8 ranks
(Llama dp2 x tp2 x pp2, the issue's headline layout; Llama and GPT-2 dp2 x tp2 x pp2 with sequence
parallelism, and every family of tests.helpers.PLANNED and DERIVED dp2 x tp2(SP) x pp2). Each world-8 run
checkpoints its last step, which `tessel export --format hf` then writes as a folder transformers loads: the
export is tested from the very run whose parity is (one world-8 spawn for both).
"""


import pytest
import torch
from torch.testing import assert_close

from tessel.hf.config import transformers_config
from tessel.models.gpt import cross_entropy
from tessel.models.hf.families import FAMILIES, pipeline_parts
from tessel.spawn import spawn
from tests.helpers import (DERIVED, LATENT, PLANNED, export_hf, hf_logits, tessel_logits, tiny_config,
                           train_whole, write_configs)

STEPS = 5
# dropout 0 (GPT-2 has dropout by default); 4 layers so that pp2 leaves two decoder layers a stage
CONFIGS = {
    "llama": {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2},
    "gpt2": {"model_type": "gpt2", "vocab_size": 128, "n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 64,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0},
} | PLANNED | DERIVED | {"deepseek_v3": LATENT["deepseek_v3"]}  # cut by their own pipeline plans (tessel.hf.layout)
PP2 = ["parallel.pp=2", "parallel.micro_batches=2", 'parallel.schedule="1f1b"']
WORLD2 = {
    "llama_pp2": ("llama", PP2),
    "llama_pp2_recompute": ("llama", [*PP2, "parallel.recompute=true"]),
    "gpt2_pp2": ("gpt2", PP2),  # tied embedding: the first stage's and the last stage's copies summed
    # the backward split into B and W on transformers' decoder layers (tessel.parallel.pipeline.split_backward)
    "llama_pp2_zb_h1": ("llama", [*PP2, 'parallel.schedule="zb-h1"']),
    "llama_pp2_zbv": ("llama", [*PP2, 'parallel.schedule="zbv"', "parallel.virtual_stages=2"]),
    "gpt2_pp2_zb_h2": ("gpt2", [*PP2, 'parallel.schedule="zb-h2"']),  # W's gradient of the tied head, summed
} | {f"{kind}_pp2": (kind, PP2) for kind in (*PLANNED, *DERIVED)}
SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
# tp2 + SP under pp: stages exchange sequence shards; a later stage makes its input whole (the model measures
# its positions and causal mask from it) and splits it at its first layer; GPT-2's first stage makes the
# sequence whole at its final norm's stand-in (the model reshapes there) and sends its shard
WORLD8 = {"llama_dp2_tp2_pp2": ("llama", ["parallel.dp=2", "parallel.tp=2", *PP2]),
          "llama_dp2_tp2sp_pp2": ("llama", ["parallel.dp=2", *SP, *PP2]),
          "gpt2_dp2_tp2sp_pp2": ("gpt2", ["parallel.dp=2", *SP, *PP2])} | {
    # stages hand sequence shards over at the decoder layers (tessel.parallel.pipeline.handover)
    f"{kind}_dp2_tp2sp_pp2": (kind, ["parallel.dp=2", *SP, *PP2]) for kind in (*PLANNED, *DERIVED)} | {
    # latent attention split by heads, its down projections whole; a dense first stage, an MoE second
    "deepseek_v3_dp2_tp2_pp2": ("deepseek_v3", ["parallel.dp=2", "parallel.tp=2", *PP2])}
# fp32 throughout. A pipeline runs each micro-batch's forward and backward as one process does;
# what changes the order of sums is the split of the batch into micro-batches (gradients summed
# per micro-batch, then added), the data-parallel all-reduce and tensor parallelism's partial
# products (tests/parallel/tensor/test_hf_tensor_parallel.py argues the same bounds): measured loss
# differences ~1e-7 on losses ~5 and weight differences ~1e-6 after 5 AdamW steps at lr 1e-3.
# WEIGHT_TOL's 5e-5 is 1/20 of one AdamW step (~lr), which a near-zero gradient's rounding can
# approach; a real bug (a stage skipping a layer, positions restarted on a later stage, the tied
# head's gradient not summed, a double-counted micro-batch) moves losses by >1e-2 and weights by ~lr.
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
WEIGHT_TOL = dict(rtol=1e-4, atol=5e-5)


# the trainer's own steps at a constant lr (the tolerances' 1e-3); checkpoints off unless a run names a folder
TRAIN = [f"train.steps={STEPS}", "train.lr=1e-3", "train.min_lr=1e-3", "train.warmup_steps=0", "fault.heartbeat_s=0"]


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    return write_configs(tmp_path_factory.mktemp("hf"), CONFIGS)


def probe(vocab: int) -> torch.Tensor:
    """The batch the exported models and the sharded ones are scored on."""
    return torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(7))


def _run(path: str, overrides: list[str], checkpoints: str | None = None) -> dict:
    """5 steps through the trainer `tessel train` runs: the global batch's mean loss each step, the weights whole;
    with a folder, the last step's checkpoint there and the trained sharded model's loss on the probe batch."""
    cfg = tiny_config(f'model.hf_config="{path}"', *overrides, *TRAIN,
                      *([f'checkpoint.dir="{checkpoints}"', f"checkpoint.every={STEPS}"] if checkpoints else []))
    return train_whole(cfg, probe(cfg.model.vocab_size) if checkpoints else None)


def _world(paths: dict[str, str], layouts: dict, checkpoints: str | None = None) -> dict:
    return {name: _run(paths[kind], overrides, checkpoints and f"{checkpoints}/{name}")
            for name, (kind, overrides) in layouts.items()}


@pytest.fixture(scope="module")
def references(configs):
    return {kind: _run(path, []) for kind, path in configs.items()}


@pytest.fixture(scope="module")
def world2(configs):
    return spawn(_world, 2, configs, WORLD2, timeout=600)


@pytest.fixture(scope="module")
def world8(configs, tmp_path_factory) -> dict:
    """Every world-8 layout trained once, checkpointed at its last step: its parity and its export are tested
    from the same run. {"ranks": each rank's results, "checkpoints": the folder of a folder per layout}."""
    checkpoints = tmp_path_factory.mktemp("world8")
    return {"ranks": spawn(_world, 8, configs, WORLD8, str(checkpoints), timeout=900), "checkpoints": checkpoints}


def _check(got: dict, want: dict) -> None:
    assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **LOSS_TOL)
    # every parameter on some stage under its own name; a tied head under both names, as the model has it
    assert set(got["weights"]) == set(want["weights"])
    for name, w in want["weights"].items():
        assert_close(got["weights"][name], w, **WEIGHT_TOL, msg=name)


@pytest.mark.parametrize("name", list(WORLD2))
def test_pp2_matches_the_single_process_transformers_model(world2, references, name):
    want = references[WORLD2[name][0]]
    # the reference trains: a comparison of something (its losses are those of 5 different batches, which a
    # few steps at lr 1e-3 need not lower; every weight's move is ~lr a step)
    assert want["moved"] > 1e-3
    for rank in world2:  # both stages report the same losses and the same gathered weights
        _check(rank[name], want)


# the first test to ask for world8 waits for its spawn (20 layouts trained and checkpointed): the spawn's own limit
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(WORLD8))
def test_dp2_tp2_pp2_matches_the_single_process_transformers_model(world8, references, name):
    for rank in world8["ranks"]:
        _check(rank[name], references[WORLD8[name][0]])


# Tolerances. The exported model computes with the very tensors tessel trained, in the same code (transformers'
# own forward), so its logits equal those of tessel's one-process model loaded from the checkpoint bit for bit.
# The sharded run's loss on the probe batch sums the same products in other orders (tp's partial sums, the
# vocab-parallel softmax): a few ulps of a loss ~5 (measured < 2e-6); a row or a head exported out of place
# moves it by >1e-2.
SAME_CODE = dict(rtol=0, atol=0)
SHARDED_LOSS = dict(rtol=0, atol=1e-5)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(WORLD8))
def test_dp2_tp2_pp2_checkpoint_exports_to_transformers(world8, name, tmp_path):
    """`tessel export --format hf` of the run's checkpoint (each stage's layers saved under the model's names, tp
    shards as logical rows; its config the copy the checkpoint carries): what
    AutoModelForCausalLM.from_pretrained loads computes tessel's logits and the sharded run's loss."""
    checkpoint = world8["checkpoints"] / name / f"step_{STEPS:08d}"
    export_hf(checkpoint, tmp_path / "hf")
    cfg = tiny_config(f'model.hf_config="{checkpoint / "hf_config.json"}"')
    x = probe(cfg.model.vocab_size)
    logits = hf_logits(tmp_path / "hf", x[:, :-1])
    assert_close(logits, tessel_logits(cfg, checkpoint, x[:, :-1]), **SAME_CODE)
    loss = cross_entropy(logits, x[:, 1:])
    assert_close(loss, torch.tensor(world8["ranks"][0][name]["probe_loss"]), **SHARDED_LOSS)


def test_a_model_without_pipeline_parts_is_refused_naming_a_module(configs):
    opt_cfg = {"model_type": "opt", "vocab_size": 128, "hidden_size": 32, "ffn_dim": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64}
    from transformers import AutoModelForCausalLM  # deferred: transformers is heavy
    model = AutoModelForCausalLM.from_config(transformers_config(opt_cfg))
    with pytest.raises(ValueError, match=r"cannot place model\.decoder\.embed_tokens \(Embedding\)"):
        pipeline_parts(model, FAMILIES.get("opt"))
