"""A Hugging Face model as tessel builds and trains it (tessel.models.hf.build).

- attention: the implementation transformers itself gives the class when none is asked for (SDPA for Llama,
  the eager attention for Gemma 2, which has no SDPA), so every family builds under `tessel train`;
- no key/value cache in training, for a model tessel builds (`tessel train`, here under full recompute, whose
  second forward would append to the cache again) and for one handed to tessel.parallelize; the model's own
  config keeps its use_cache (what an export writes).
"""

import json

import pytest
import torch

import tessel
from tessel.hf.config import transformers_config
from tessel.mesh import make_mesh
from tessel.models.build import build_model
from tests.helpers import build_runner, tiny_config

LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
GEMMA2 = {**LLAMA, "model_type": "gemma2", "head_dim": 8}


def _write(tmp_path, doc: dict) -> str:
    path = tmp_path / f"{doc['model_type']}.json"
    path.write_text(json.dumps(doc))
    return str(path)


def _transformers(doc: dict):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_config(transformers_config(doc))


@pytest.mark.parametrize("doc,attention", [(LLAMA, "sdpa"), (GEMMA2, "eager")], ids=["llama", "gemma2"])
def test_attention_is_the_one_transformers_picks(tmp_path, doc, attention):
    cfg = tiny_config(f'model.hf_config="{_write(tmp_path, doc)}"')
    built = build_model(cfg.model).config._attn_implementation
    assert built == _transformers(doc).config._attn_implementation == attention


def _caches(model) -> list:
    """What each forward of the model returns as its key/value cache (a hook ahead of tessel's, which keeps
    only the logits)."""
    seen = []
    model.register_forward_hook(lambda module, args, out: seen.append(out.past_key_values), prepend=True)
    return seen


def test_training_builds_no_key_value_cache(tmp_path):
    cfg = tiny_config(f'model.hf_config="{_write(tmp_path, LLAMA)}"', 'parallel.recompute="full"')
    model, runner, _ = build_runner(cfg)
    seen = _caches(model)
    x = torch.randint(0, 128, (2, 16))
    runner.forward_backward(x, x)
    assert seen == [None]  # one forward (the recomputation runs the layers, not the model), no cache

    user = _transformers(LLAMA)  # a model of the user's own, through tessel.parallelize
    job = tessel.parallelize(user, make_mesh({"dp": 1}))
    seen = _caches(user)
    job.step(x, x)
    assert seen == [None]
    assert model.config.use_cache and user.config.use_cache  # the configs, and what an export writes, unchanged
