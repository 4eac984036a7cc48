"""Hugging Face heads whose forward changes the logits after lm_head, trained with and without train.fused_loss
on one process: Granite's and Cohere's linear scalings (logits / logits_scaling, logits * logit_scale), which commute with the head's matmul and
so stays in the model, applied to the hidden states the head now returns; and Gemma 2's and Gemma 3's final
soft-capping (cap * tanh(logits / cap); Gemma 2 with its eager attention, having no SDPA), which moves into the
fused loss while the model's own is switched off. Compared: 3 steps'
losses and gradient norms, the validation loss, a sampled text and the final weights."""

import json

import pytest
import torch
from torch.testing import assert_close

from tessel.hf.head import hf_fused_loss_refusal
from tessel.models.build import build_model
from tests.helpers import tiny_config, train_and_collect

COMMON = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "bos_token_id": 1,
          "eos_token_id": 2}
CONFIGS = {
    "granite": {**COMMON, "model_type": "granite", "logits_scaling": 4.0},
    # Cohere multiplies instead (logits * logit_scale): read from its forward as a scaling too (tessel.hf.head)
    "cohere": {**COMMON, "model_type": "cohere", "logit_scale": 4.0},
    # the logits of a fresh model are ~0.1 (hidden states of norm ~1 times weights of std 0.02): a cap of
    # 0.05 bends them hard (tanh(2) = 0.96), so a cap left out of the loss, or left in the model to bend the
    # hidden states, moves the first loss by >= 2e-3 (measured), far outside the tolerance
    "gemma3_text": {**COMMON, "model_type": "gemma3_text", "head_dim": 8, "final_logit_softcapping": 0.05},
    "gemma2": {**COMMON, "model_type": "gemma2", "head_dim": 8, "final_logit_softcapping": 0.05},
}
STEPS = ["train.steps=3", "train.eval_every=3", "train.eval_batches=1", "train.sample_tokens=6"]
# fp32, one process: the same logits chunk by chunk, summed in another order (~1e-7 relative); over 3 AdamW
# steps a near-zero gradient's rounding can become a step of ~1e-5 in a weight (measured <= 7e-6); a wrong
# cap or scaling moves losses by >1e-3 and weights by ~lr = 1e-2
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
WEIGHT_TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_head_that_rescales_or_caps_its_logits(tmp_path, kind):
    path = tmp_path / f"{kind}.json"
    path.write_text(json.dumps(CONFIGS[kind]))
    base = [f'model.hf_config="{path}"', *STEPS]
    cfg = tiny_config(*base)
    torch.manual_seed(cfg.train.seed)  # the initial weights every run starts from (tests.helpers.build_runner)
    start = build_model(cfg.model).state_dict()
    ref = train_and_collect(cfg)
    got = train_and_collect(tiny_config(*base, "train.fused_loss=true"))
    # the weights moved, so their equality below is not trivial (a capped model's loss barely falls in 3 steps)
    assert max((ref["state"][n] - w).abs().max().item() for n, w in start.items()) > 1e-3
    assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **LOSS_TOL)
    assert_close(torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=1e-4, atol=1e-6)
    assert_close(got["val_loss"], ref["val_loss"], **LOSS_TOL)
    assert got["sample"] == ref["sample"]
    for name, w in ref["state"].items():
        assert_close(got["state"][name], w, **WEIGHT_TOL, msg=name)


def test_what_a_forward_does_after_its_head_is_read_from_its_source():
    """tessel.hf.head: the families above are accepted from their own forwards (scalings, the final soft-cap's
    `if`), and a forward that does something else to its logits is refused naming the statement: Recurrent
    Gemma's soft-cap under another key (logits_soft_cap, which the fused loss does not take over), Inkling's
    slice of the padded vocabulary."""
    for kind in (*CONFIGS, "llama", "falcon_h1", "opt"):  # Falcon-H1 multiplies the head's call, OPT copies it
        assert hf_fused_loss_refusal({"model_type": kind}) is None, kind
    assert "logits = nn.functional.tanh(logits / cap) * cap" in hf_fused_loss_refusal({"model_type": "recurrent_gemma"})
    assert "unpadded_vocab_size" in hf_fused_loss_refusal({"model_type": "inkling_text"})
