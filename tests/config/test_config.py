"""Bad recipes are rejected before any process exists: exit 2, the field named, no traceback."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import tessel.commands.launch
from tessel.commands.cli import app
from tessel.config import ConfigError, build_config, load_config, parse_override, to_toml

# (overrides, the field the message must name)
BAD = [
    (["model.foo=1"], "model.foo"),                                   # unknown key
    (["wat.x=1"], "wat"),                                             # unknown section
    (['parallel.dp="two"'], "parallel.dp"),                           # wrong type
    (["parallel.dp=1.5"], "parallel.dp"),                             # wrong type (float)
    (["parallel.dp=0"], "parallel.dp"),                               # out of range
    (["parallel.tp=3"], "parallel.tp"),                               # heads not divisible by tp
    (["parallel.pp=4"], "parallel.pp"),                               # fewer layers than stages
    (["model.n_experts=3", "parallel.ep=2"], "parallel.ep"),          # experts not divisible by ep
    (["parallel.ep=2"], "parallel.ep"),                               # ep without experts
    (["parallel.dp=4", "train.global_batch=6"], "train.global_batch"),  # batch vs dp x micro-batches
    (["parallel.micro_batches=3"], "train.global_batch"),
    (["parallel.dp=2", "runtime.nproc_per_node=3"], "runtime.nproc_per_node"),  # world != product
    (["train.seq_len=512"], "train.seq_len"),                         # longer than the model
    (["parallel.zero_stage=4"], "parallel.zero_stage"),
    (['parallel.schedule="zigzag"'], "parallel.schedule"),
    (["train.lr=-1"], "train.lr"),
    (["train.min_lr=1.0"], "train.min_lr"),
    (["model.d_model=65"], "model.d_model"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
    (["parallel.virtual_stages=2"], "parallel.virtual_stages"),
    (['data.source="bin"'], "data.path"),
    (["parallel.pp=2", "model.n_layer=4", "parallel.pp_layout=[1, 2]"], "parallel.pp_layout"),
    (["parallel.dp=2", "parallel.dp_extra=1"], "parallel.dp_extra"),
    (["parallel.dp=2", 'parallel.zero_param_dtype="bf16"'], "parallel.zero_param_dtype"),  # needs ZeRO
    (["parallel.dp=2", 'parallel.zero_reduce_dtype="bf16"'], "parallel.zero_param_dtype"),
    (["parallel.cp=2", "model.sliding_window=8"], "parallel.cp"),  # cp attends whole causal prefixes
]


@pytest.mark.parametrize("overrides,field", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        build_config({}, overrides)
    assert err.value.field == field, str(err.value)


def test_at_least_twelve_distinct_rules():
    assert len({field for _, field in BAD}) >= 12


@pytest.fixture
def no_spawn(monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("a process was spawned for an invalid config")
    monkeypatch.setattr(tessel.commands.launch, "launch", forbidden)
    monkeypatch.setattr(subprocess, "run", forbidden)


@pytest.mark.parametrize("overrides,field", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_cli_rejects_without_spawning(no_spawn, overrides, field):
    args = ["train"] + [x for o in overrides for x in ("--set", o)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert field in result.output
    assert "Traceback" not in result.output


def test_real_cli_exit_code_and_message(tmp_path):
    recipe = tmp_path / "bad.toml"
    recipe.write_text("[parallel]\ntp = 3\n")
    proc = subprocess.run([sys.executable, "-m", "tessel", "train", str(recipe)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "parallel.tp" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout


def test_missing_and_malformed_recipes(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)


def test_overrides_parse_as_toml_and_round_trip():
    assert parse_override("parallel.dp=2") == (["parallel", "dp"], 2)
    assert parse_override("data.source=synthetic") == (["data", "source"], "synthetic")
    cfg = build_config({}, ["parallel.dp=2", "train.lr=0.001", "model.tie_embeddings=true"])
    assert (cfg.parallel.dp, cfg.train.lr, cfg.model.tie_embeddings) == (2, 0.001, True)
    import tomllib
    assert build_config(tomllib.loads(to_toml(cfg))) == cfg


def test_zero_checkpoints_allowed_on_data_pipeline_expert_and_grid_layouts():
    # ZeRO checkpoints go through logical whole tensors (tessel.parallel.zero.checkpoint) under dp, pp, ep and a
    # tp grid (its blocks cut by their own placement: tests/parallel/tensor_nd/test_grid_modes.py resumes one)
    moe = ["model.n_experts=4"]
    for stage in (1, 2, 3):
        for layout in (["parallel.dp=2"], ["parallel.dp=2", "parallel.pp=2"], [*moe, "parallel.ep=2"],
                       [*moe, "parallel.ep=2", "parallel.pp=2"],
                       ["parallel.dp=2", "parallel.tp=4", 'parallel.tp_mode="2d"']):
            cfg = build_config({}, [*layout, f"parallel.zero_stage={stage}", "checkpoint.every=10"])
            assert cfg.checkpoint.every == 10 and cfg.parallel.zero_stage == stage


def test_cp_joins_the_world_size_and_an_older_rank_order():
    cfg = build_config({}, ["parallel.cp=2", "parallel.tp=2", "parallel.dp=2", 'parallel.cp_mode="ulysses"',
                            'parallel.rank_order=["pp", "dp", "ep", "tp"]'])
    assert cfg.parallel.world_size == 8
    assert cfg.parallel.axis_sizes == {"pp": 1, "dp": 2, "ep": 1, "cp": 2, "tp": 2}
    assert cfg.parallel.rank_order == ["pp", "dp", "ep", "cp", "tp"]
    assert build_config({}).parallel.rank_order == ["pp", "dp", "ep", "cp", "tp"]


def test_cp_refuses_what_it_does_not_cover_for_hugging_face_models(tmp_path):
    """tessel.hf.context reads each model's own layers: what ring and Ulysses attention would not apply is
    refused naming the key, layer type or keyword (the families from their config classes, shrunk)."""
    from tessel.commands.support import tiny_config as family
    llama = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    gpt2 = {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}
    cases = {"dropout": ({**llama, "attention_dropout": 0.1}, "attention_dropout"),
             "gpt2_dropout": (gpt2, "attn_pdrop"),  # GPT2Config's attn_pdrop is 0.1 unless set
             "sinks": (family("gpt_oss"), "GptOssAttention .* as s_aux"),  # attention sinks
             "linear": (family("qwen3_next"), "layer_types hold 'linear_attention' layers"),  # Gated DeltaNet
             "conv": ({**family("lfm2"), "full_attn_idxs": [1], "layer_types": None}, "'conv' layers"),
             "own_mask": (family("doge"), "DogeAttention .* as a mask of its own"),  # its dynamic mask
             "chunked": (family("llama4_text"), "'chunked_attention' layers")}
    for name, (doc, why) in cases.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
        with pytest.raises(ConfigError, match=why) as err:
            build_config({"data": {"source": "synthetic"}},
                         [f'model.hf_config="{tmp_path / name}.json"', "parallel.cp=2", "train.seq_len=32"])
        assert err.value.field == "parallel.cp"


def test_cp_takes_moe_models_gpt2_mixtral_and_hugging_face_pipelines(tmp_path):
    """Lifted refusals (tests/parallel/context/test_context_parallel.py trains each against one process):
    the reference GPT's MoE (with and without ep), Mixtral, GPT-2 (dropout 0) and Hugging Face models under pp."""
    synthetic = {"data": {"source": "synthetic"}}
    for extra in ([], ["parallel.ep=2"], ['model.aux_loss_scope="local"', "parallel.pp=2"]):
        cfg = build_config(synthetic, ["model.n_experts=4", "parallel.cp=2", *extra])
        assert cfg.parallel.cp == 2 and cfg.model.n_experts == 4
    docs = {"gpt2": {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4,
                     "n_positions": 64, "attn_pdrop": 0.0},
            "mixtral": {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "num_local_experts": 4, "max_position_embeddings": 64, "sliding_window": 32},
            # a window shorter than the sequence: applied across the cp ranks (tessel.parallel.context.kernel)
            "mistral": {"model_type": "mistral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "max_position_embeddings": 64, "sliding_window": 6}}
    for name, doc in docs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
        for extra in ([], ["parallel.pp=2"], ["parallel.ep=2"] if name == "mixtral" else []):
            cfg = build_config(synthetic, [f'model.hf_config="{tmp_path / name}.json"', "parallel.cp=2",
                                           "train.seq_len=32", *extra])
            assert cfg.parallel.cp == 2
