"""`tessel export CHECKPOINT --format hf --out DIR`: what it writes loads in transformers and computes
tessel's logits, from checkpoints of any layout; import -> train -> export -> import is exact.

Tolerances. A Hugging Face model exported under its own names computes with the very tensors tessel
trained, in the same code (transformers' own forward), so its logits are equal bit for bit (atol 0).
The reference GPT exported as a Llama runs a different forward: rotate-half rotary on permuted q/k rows
instead of interleaved pairs, transformers' RMSNorm and attention instead of torch's. Both are the same
function of the weights in exact arithmetic; in fp32 they differ by the rounding of their different
summation orders, measured below 2e-7 on logits of magnitude ~1 here (and 1.8e-7 by the hand-written
converter of issue 17), so 1e-5 bounds rounding with a wide margin while a mis-permuted head, a wrong eps
or theta moves the logits by >1e-3.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from tessel.hf.config import transformers_config
from tessel.models.gpt import cross_entropy
from tessel.models.weights import read_weights, tied_names
from tessel.spawn import spawn
from tests.helpers import build_trainer, hf_logits, tessel_logits, tiny_config
from tests.helpers import export_hf as export

GPT_TO_LLAMA = dict(rtol=0, atol=1e-5)  # see the module's docstring
SAME_CODE = dict(rtol=0, atol=0)
# the sharded run's own loss on a batch against the exported model's: the layouts sum the same products in
# other orders (tp's partial sums, the vocab-parallel softmax), a few ulps of a loss ~5.5 (measured < 2e-6)
SHARDED_LOSS = dict(rtol=0, atol=1e-5)
LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
         "rms_norm_eps": 1e-5, "rope_theta": 500.0}
GPT2 = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 32,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
MIXTRAL = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}  # fused experts
# the reference GPT: tied embeddings, grouped-query attention, a non-default eps and rotary base, so a
# converter that drops any of them fails
GPT = ["model.tie_embeddings=true", "model.n_kv_head=2", "model.norm_eps=1e-4", "model.rope_theta=500.0"]
COMMON = ["train.steps=2", "checkpoint.every=2", "fault.heartbeat_s=0"]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def config_file(tmp_path: Path, doc: dict) -> str:
    path = tmp_path / f"{doc['model_type']}.json"
    path.write_text(json.dumps(doc))
    return str(path)


def batch(vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(7))


# ---- checkpoints of sharded layouts ----------------------------------------------------------
def _train(root: str, runs: dict[str, list[str]], vocab: int = 256) -> dict[str, float]:
    """Train and checkpoint each run; the loss its sharded model then computes on batch(vocab)."""
    losses = {}
    for name, overrides in runs.items():
        trainer, _, runner, _ = build_trainer(tiny_config(*overrides, *COMMON, f'checkpoint.dir="{root}/{name}"'))
        trainer.fit()
        x = batch(vocab)
        losses[name] = runner.evaluate(x[:, :-1], x[:, 1:]).item()
    return losses


def exported_loss(folder: Path, vocab: int = 256) -> torch.Tensor:
    x = batch(vocab)
    return cross_entropy(hf_logits(folder, x[:, :-1]), x[:, 1:])


def test_reference_gpt_dp2_tp2_pp2_checkpoint_exports_as_llama(tmp_path):
    layout = ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2"]
    sharded = spawn(_train, 8, str(tmp_path), {"gpt": [*GPT, *layout]}, timeout=300)[0]["gpt"]
    checkpoint = tmp_path / "gpt" / "step_00000002"
    export(checkpoint, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    x = batch()
    ours = tessel_logits(tiny_config(*GPT), checkpoint, x)
    assert_close(hf_logits(tmp_path / "hf", x), ours, **GPT_TO_LLAMA)
    assert_close(exported_loss(tmp_path / "hf"), torch.tensor(sharded), **SHARDED_LOSS)


# Hugging Face checkpoints of every axis, on 4 ranks: a Llama under dp2 x tp2 with ZeRO-1, dp4 with ZeRO-3's
# flat shards and pp2 x dp2 with ZeRO-1 (each stage's ZeRO names its parameters as the full model does); a
# tied GPT-2 under dp2 x tp2 with ZeRO-2 (its fused q|k|v split per head, saved as pieces of the logical
# tensor); a Mixtral under pp2 x ep2 with ZeRO-1 (experts sharded over ep). A
# vocabulary of 250 is padded to 252 over tp: the checkpoint holds the 250 logical rows.
HF_LAYOUTS = {"dp2tp2zero1": (LLAMA, ["parallel.dp=2", "parallel.tp=2", "parallel.zero_stage=1"]),
              "dp4zero3": (LLAMA, ["parallel.dp=4", "parallel.zero_stage=3"]),
              "pp2dp2zero1": (LLAMA, ["parallel.pp=2", "parallel.dp=2", "parallel.zero_stage=1"]),
              "gpt2-dp2tp2zero2": (GPT2, ["parallel.dp=2", "parallel.tp=2", "parallel.zero_stage=2"]),
              "mixtral-pp2ep2zero1": (MIXTRAL, ["parallel.pp=2", "parallel.ep=2", "parallel.zero_stage=1"])}


def test_hf_sharded_checkpoints_export_under_their_own_names(tmp_path):
    runs = {name: [f'model.hf_config="{config_file(tmp_path, {**doc, "vocab_size": 250})}"', *layout]
                   for name, (doc, layout) in HF_LAYOUTS.items()}
    sharded = spawn(_train, 4, str(tmp_path), runs, 250, timeout=300)[0]
    for doc in (LLAMA, GPT2, MIXTRAL):  # the recipe's config is gone: the checkpoint carries its own copy
        (tmp_path / f"{doc['model_type']}.json").unlink()
    x = batch(250)
    for name in HF_LAYOUTS:
        checkpoint = tmp_path / name / "step_00000002"
        export(checkpoint, tmp_path / f"hf-{name}", "--shard-mb", "0.05")  # several files and an index
        assert len(list((tmp_path / f"hf-{name}").glob("*.safetensors"))) > 1
        cfg = tiny_config(f'model.hf_config="{checkpoint / "hf_config.json"}"')
        assert_close(hf_logits(tmp_path / f"hf-{name}", x), tessel_logits(cfg, checkpoint, x), **SAME_CODE,
                     msg=lambda m: f"{name}: {m}")
        assert_close(exported_loss(tmp_path / f"hf-{name}", 250), torch.tensor(sharded[name]), **SHARDED_LOSS,
                     msg=lambda m: f"{name}: {m}")


# dp2 x tp2 x pp2 checkpoints of every Hugging Face family tessel places by plan: exported from the very run whose
# parity with transformers tests/parallel/pipeline/test_hf_pipeline.py checks (one world-8 spawn for both)


# ---- one process: every conversion, and the round trip -----------------------------------------
def test_reference_gpt_untied_exports_as_llama(tmp_path):
    _train(str(tmp_path), {"gpt": ["model.n_kv_head=1"]})
    checkpoint = tmp_path / "gpt" / "step_00000002"
    export(checkpoint, tmp_path / "hf", "--dtype", "fp32")
    x = batch()
    assert_close(hf_logits(tmp_path / "hf", x), tessel_logits(tiny_config("model.n_kv_head=1"), checkpoint, x),
                 **GPT_TO_LLAMA)


@pytest.mark.parametrize("doc", [LLAMA, GPT2, MIXTRAL], ids=["llama", "gpt2-tied", "mixtral"])
def test_import_one_step_export_import_is_exact(doc, tmp_path):
    """save_pretrained's folder -> init_from -> 1 step -> checkpoint -> export -> from_pretrained and init_from
    again, bit for bit. (Mixtral: save_pretrained writes its experts one by one, the hub's layout, which
    init_from reads through transformers' conversions; the export writes the model's own fused names,
    which from_pretrained reads as they are.)"""
    from transformers import AutoModelForCausalLM
    hf = config_file(tmp_path, doc)
    torch.manual_seed(3)
    source = AutoModelForCausalLM.from_config(transformers_config(doc))
    source.save_pretrained(tmp_path / "in")
    cfg = tiny_config(f'model.hf_config="{hf}"', f'model.init_from="{tmp_path / "in"}"', "train.steps=1",
                      "train.warmup_steps=0", "checkpoint.every=1", f'checkpoint.dir="{tmp_path / "ck"}"',
                      "fault.heartbeat_s=0")
    trainer, model, _, _ = build_trainer(cfg, init_seed=99)
    assert same(model.state_dict(), source.state_dict())  # imported exactly
    trainer.fit()
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert not same(trained, source.state_dict())  # the step moved the weights
    export(tmp_path / "ck" / "step_00000001", tmp_path / "out")
    written = read_weights(tmp_path / "out")
    assert written.keys() == tied_names(model)[0].keys()  # its own names; a tied head once, as save_pretrained
    assert all(torch.equal(written[k], trained[k]) for k in written)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # transformers reads the same tensors
    assert same(reloaded.state_dict(), trained)
    again = build_trainer(tiny_config(f'model.hf_config="{hf}"', f'model.init_from="{tmp_path / "out"}"'),
                          init_seed=5)[1]
    assert same(again.state_dict(), trained)  # and tessel reads them back
    x = batch()
    with torch.no_grad():
        assert_close(hf_logits(tmp_path / "out", x), model.eval()(x), **SAME_CODE)
