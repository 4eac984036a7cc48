"""model.init_from: safetensors weights (a file, a folder, sharded with an index) loaded under the model's
own names before anything is cut; every mismatch named before a value is copied."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tessel.config import ModelConfig
from tessel.errors import ConfigError
from tessel.models.build import build_model, check_init_from
from tessel.models.weights import INDEX, WeightsError, read_weights, stored_shapes, write_weights

LLAMA = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}
GPT2 = {"model_type": "gpt2", "vocab_size": 96, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 32}
GPT = dict(vocab_size=96, n_layer=2, n_head=4, d_model=32, max_seq_len=32, tie_embeddings=True)


def hf_model(tmp_path, doc: dict, seed: int, init_from=None):
    path = tmp_path / f"{doc['model_type']}.json"
    path.write_text(json.dumps(doc))
    torch.manual_seed(seed)
    return build_model(ModelConfig(hf_config=str(path), init_from=init_from and str(init_from))), path


def same_state(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_save_pretrained_shards_load_exactly(tmp_path):
    source, _ = hf_model(tmp_path, LLAMA, seed=0)
    source.save_pretrained(tmp_path / "w", max_shard_size="20KB")  # several files and an index
    assert (tmp_path / "w" / INDEX).is_file() and len(list((tmp_path / "w").glob("*.safetensors"))) > 2
    loaded, _ = hf_model(tmp_path, LLAMA, seed=1, init_from=tmp_path / "w")
    assert same_state(source, loaded)
    fresh, _ = hf_model(tmp_path, LLAMA, seed=1)
    assert not same_state(source, fresh)  # the seed alone would not have given these weights


def test_tied_gpt2_from_a_base_model_file(tmp_path):
    """A GPT-2 file as the hub holds it: the base model's names (no `transformer.`), no lm_head (tied),
    and the old causal-mask buffers from_pretrained ignores."""
    source, _ = hf_model(tmp_path, GPT2, seed=0)
    state = {k.removeprefix("transformer."): v for k, v in source.state_dict().items() if k != "lm_head.weight"}
    state["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)
    save_file(state, str(tmp_path / "gpt2.safetensors"))
    loaded, _ = hf_model(tmp_path, GPT2, seed=1, init_from=tmp_path / "gpt2.safetensors")
    assert same_state(source, loaded)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # still tied


def test_reference_gpt_under_its_own_names(tmp_path):
    torch.manual_seed(0)
    source = build_model(ModelConfig(**GPT))
    write_weights(tmp_path / "gpt", {k: v for k, v in source.state_dict().items() if k != "lm_head.weight"},
                  shard_bytes=10_000)  # the tied head is the embedding: written once
    torch.manual_seed(1)
    loaded = build_model(ModelConfig(**GPT, init_from=str(tmp_path / "gpt")))
    assert same_state(source, loaded)


def test_mismatches_are_named_before_anything_is_copied(tmp_path):
    source, config = hf_model(tmp_path, LLAMA, seed=0)
    state = {k: v for k, v in source.state_dict().items() if "layers.1.mlp" not in k}
    state["model.norm.weight"] = torch.ones(5)
    state["model.extra"] = torch.zeros(2)
    save_file(state, str(tmp_path / "bad.safetensors"))
    m = ModelConfig(hf_config=str(config), init_from=str(tmp_path / "bad.safetensors"))
    with pytest.raises(ConfigError) as err:
        check_init_from(m)  # on the meta device, from the header alone
    text = str(err.value)
    assert err.value.field == "model.init_from"
    assert "missing model.layers.1.mlp.down_proj.weight" in text and "unexpected model.extra" in text
    assert "model.norm.weight [5] (the model's is [32])" in text
    with pytest.raises(WeightsError):
        build_model(m)


def test_tied_names_with_different_values_are_refused(tmp_path):
    torch.manual_seed(0)
    state = dict(build_model(ModelConfig(**GPT)).state_dict())
    state["lm_head.weight"] = state["lm_head.weight"] + 1  # the file unties what the model ties
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "untied.safetensors"))
    with pytest.raises(WeightsError, match="ties lm_head.weight to tok_emb.weight"):
        build_model(ModelConfig(**GPT, init_from=str(tmp_path / "untied.safetensors")))


def test_files_that_are_not_weights(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "w.bin").write_bytes(b"\0" * 8)
    (tmp_path / "junk.safetensors").write_bytes(b"not a header")
    (tmp_path / "idx").mkdir()
    (tmp_path / "idx" / INDEX).write_text(json.dumps({"weight_map": {"a": "missing.safetensors"}}))
    for path, says in [("empty", "holds no .safetensors"), ("w.bin", "not a .safetensors file"),
                       ("junk.safetensors", "is not a safetensors file"), ("idx", "missing from")]:
        with pytest.raises(WeightsError, match=says):
            stored_shapes(tmp_path / path)


def test_write_weights_shards_and_reads_back(tmp_path):
    tensors = {f"t{i}": torch.full((100,), float(i)) for i in range(5)}
    files = write_weights(tmp_path, tensors, shard_bytes=900)  # two 400-byte tensors per shard
    assert len(files) == 3 and json.loads((tmp_path / INDEX).read_text())["weight_map"]["t4"] == files[2].name
    back = read_weights(tmp_path)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)


MIXTRAL = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}


def test_mixtral_as_save_pretrained_writes_it_loads_through_transformers(tmp_path):
    """transformers 5 fuses Mixtral's experts in memory but saves them per expert (w1/w2/w3, the hub's
    layout): such files load through its own conversions, exactly; a broken one is still named."""
    source, config = hf_model(tmp_path, MIXTRAL, seed=0)
    source.save_pretrained(tmp_path / "w")
    assert any(".experts.0.w1." in k for k in stored_shapes(tmp_path / "w"))  # not the model's own names
    check_init_from(ModelConfig(hf_config=str(config), init_from=str(tmp_path / "w")))
    loaded, _ = hf_model(tmp_path, MIXTRAL, seed=1, init_from=tmp_path / "w")
    assert same_state(source, loaded)
    state = read_weights(tmp_path / "w")
    del state["model.layers.1.block_sparse_moe.gate.weight"]
    save_file(state, str(tmp_path / "broken.safetensors"))
    with pytest.raises(ConfigError, match="nor through transformers' conversions: missing model.layers.1.mlp.gate"):
        check_init_from(ModelConfig(hf_config=str(config), init_from=str(tmp_path / "broken.safetensors")))
