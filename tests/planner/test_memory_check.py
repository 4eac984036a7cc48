"""check_memory (tessel.calibrate.device: this machine's budget, tessel.planner.fit: the estimate): a recipe
whose own layout cannot fit is refused before spawning, in well under a second."""

import json
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch  # noqa: F401 - loaded in the launcher before the check (validate_data); not timed here

from tessel.calibrate import device
from tessel.calibrate.device import CPU_RANK_ALLOWANCE, CUDA_RANK_ALLOWANCE, check_memory
from tessel.config import ConfigError, build_config, load_config
from tessel.planner.cluster import get_cluster
from tessel.planner.fit import param_count
from tessel.planner.layout import Layout, config_layout, layout_config
from tessel.planner.model_spec import from_config
from tests.helpers import ROOT  # noqa: E402

RECIPES = sorted(ROOT.glob("recipes/*.toml"))
MiB, GiB = 2**20, 2**30


@pytest.fixture(autouse=True)
def no_probe(tmp_path, monkeypatch):
    """An empty cache: no probe of this machine unless a test writes one."""
    monkeypatch.setenv("TESSEL_CACHE", str(tmp_path))


@pytest.mark.parametrize("override, largest", [({"model": {"n_layer": 100_000}}, "AdamW state"),
                                               ({"train": {"global_batch": 10**9}}, "activations")])
def test_enormous_recipes_are_refused_at_once(override, largest):
    cfg = build_config(override)
    # this process's CPU time, not the wall clock, which a loaded host stretches: building even the smaller
    # of these models (1.26 G parameters) would take seconds of CPU, the estimate takes milliseconds
    t0 = time.process_time()
    with pytest.raises(ConfigError) as err:
        check_memory(cfg, ranks_per_node=2)
    assert time.process_time() - t0 < 0.5
    msg = str(err.value)
    assert err.value.field == "memory" and "\n" not in msg
    assert msg.startswith("memory: the planner estimates ") and " GiB per rank (" + largest in msg
    assert "2 ranks share" in msg and "GiB of RAM" in msg and "--force" in msg


def test_force_lets_it_through_with_the_estimate():
    got = check_memory(build_config({"model": {"n_layer": 100_000}}), ranks_per_node=2, force=True)
    assert not got.fits and got.memory["total"] > 70 * GiB  # 1.26 G parameters x 16 bytes of state alone


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_fits_with_room_to_spare(recipe):
    cfg = load_config(recipe)
    got = check_memory(cfg, ranks_per_node=cfg.parallel.world_size)
    assert got.memory["total"] < got.budget.per_rank / 2, got.describe()


def test_a_small_recipe_matches_a_hand_calculation():
    cfg = build_config({"runtime": {"device": "cpu"}})  # GPT 2 x d64, ffn 176, vocab 256; batch 8 x 64, fp32
    got = check_memory(cfg, ranks_per_node=1).memory
    # parameters: 2 blocks x (attention 4 d^2 + norms 2 d + SwiGLU 3 d ffn) + embedding + norm and head
    n = 2 * (4 * 64 * 64 + 2 * 64 + 3 * 64 * 176) + 256 * 64 + 64 + 256 * 64
    assert n == 133_440
    state = 16 * n  # fp32 weights, gradients, AdamW m and v
    tokens = 8 * 64
    # fp32 tensors a block keeps for backward, per token: each sublayer's residual input and normed
    # input (4 d), q k v (3 d), rotated q k (2 d), attention output (d), SwiGLU gate, up, silu, product (4 ffn)
    blocks = 2 * tokens * (10 * 64 + 4 * 176) * 4
    logits = tokens * 256 * 3 * 4  # logits, log-softmax, their gradient
    backward = blocks / 2  # one block's gradients in flight
    hand = state + blocks + logits + backward  # 11.4 MiB
    planner = got["total"] - got["baseline"]  # 12.1 MiB
    assert 0.5 < planner / hand < 2, (planner / MiB, hand / MiB)
    assert got["baseline"] == CPU_RANK_ALLOWANCE
    assert got["params"] + got["grads"] + got["optimizer"] == state


def test_a_parameter_server_is_priced_by_its_busiest_role():
    base = {"model": {"d_model": 256}, "parallel": {"dp": 6, "dp_arch": "ps", "ps_servers": 1},
            "train": {"global_batch": 6}, "runtime": {"device": "cpu"}}
    server_bound = check_memory(build_config(base), ranks_per_node=7)
    assert server_bound.role == "server" and "per server rank" in server_bound.need()
    # one server holds the whole model, its gradient from each of 6 workers, and AdamW state
    assert server_bound.memory["grads"] == 8 * 4 * param_count(from_config(build_config(base).model, 64, 6))
    worker_bound = check_memory(build_config({**base, "train": {"global_batch": 6 * 64}}), ranks_per_node=7)
    assert worker_bound.role == "worker" and worker_bound.memory["optimizer"] == 0


def test_a_cached_probe_supplies_the_runtime_baseline(tmp_path):
    probe = replace(get_cluster("a100"), name="this", baseline_memory=123 * MiB, collective_workspace={"x": 1.0})
    path = tmp_path / "planner" / "this-v3-w2.json"  # where tessel.calibrate.profile.probe_this caches it
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(probe.to_dict()))
    cfg = load_config(RECIPES[0], ['runtime.device="cpu"'])
    assert check_memory(cfg, ranks_per_node=2).memory["baseline"] == 123 * MiB
    assert check_memory(cfg, ranks_per_node=4).memory["baseline"] == CPU_RANK_ALLOWANCE  # probed at 2 only
    path.write_text("{corrupt")
    assert check_memory(cfg, ranks_per_node=2).memory["baseline"] == CPU_RANK_ALLOWANCE


def test_cuda_ranks_get_their_gpu_memory(monkeypatch):
    class Props:
        total_memory = 80 * GiB
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Props())
    cfg = build_config({"model": {"n_layer": 3000, "d_model": 256}, "runtime": {"device": "cuda"}})
    got = check_memory(cfg, ranks_per_node=8)  # 8 GPUs: not a share of one
    assert got.budget.per_rank == 80 * GiB and got.memory["baseline"] == CUDA_RANK_ALLOWANCE
    with pytest.raises(ConfigError, match="each rank's GPU has 80.0 GiB"):
        check_memory(build_config({"model": {"n_layer": 30_000, "d_model": 256}, "runtime": {"device": "cuda"}}), 8)


def test_the_ram_share_is_what_linux_says_is_available(monkeypatch):
    monkeypatch.setattr(device, "available_ram", lambda: 10 * GiB)
    got = check_memory(build_config({"runtime": {"device": "cpu"}}), ranks_per_node=4)
    assert got.budget.per_rank == 2.5 * GiB and got.budget.text == "4 ranks share 10.0 GiB of RAM (2.5 GiB each)"
    assert 0 < device.available_ram() < 2**50


def test_param_count_in_closed_form_matches_the_walk():
    for model in ({}, {"n_layer": 7, "n_experts": 4, "moe_every": 3}, {"n_experts": 8, "moe_top_k": 2},
                  {"n_layer": 5, "n_experts": 2, "moe_every": 2, "tie_embeddings": True, "n_kv_head": 2}):
        spec = from_config(build_config({"model": model}).model, 64, 8)
        assert param_count(spec) == spec.total_params


@pytest.mark.parametrize("layout", [Layout(), Layout(dp=2, tp=2, pp=2, micro_batch=2, micro_batches=4, grad_accum=2,
                                           sequence_parallel=True, recompute=True),
                                    Layout(pp=4, micro_batches=8, virtual_stages=2, schedule="interleaved",
                                           zero_stage=1),
                                    Layout(dp=2, ep=2, zero_stage=2, micro_batch=1, grad_accum=4, schedule="gpipe")])
def test_config_layout_inverts_layout_config(layout):
    base = build_config({"model": {"n_layer": 8, "n_experts": 4}, "train": {"seq_len": 32}})
    assert config_layout(layout_config(base, layout)) == layout


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_layout_config_inverts_config_layout(recipe):
    cfg = load_config(recipe)
    if cfg.parallel.dp_arch != "ps":  # a Layout has no parameter server
        assert layout_config(cfg, config_layout(cfg)) == cfg


def test_the_check_stays_out_of_the_runtime():
    """The planner never imports torch.distributed, the trainer or the CLI (the layers of docs/architecture.md)."""
    code = ("import sys, tessel.planner.fit; bad = [m for m in sys.modules if m.startswith("
            "('torch', 'tessel.train', 'tessel.commands.cli'))]; print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_data_cap_is_each_ranks_budget_and_cp_fits_a_sequence_one_rank_cannot(monkeypatch):
    """recipes/long_context.toml: 8192 tokens a step; with each process capped at 768 MiB of heap
    (RLIMIT_DATA, `prlimit --data`), one rank is refused before spawning and two cp ranks fit (the README's
    run trains under that cap; cp1 with --force dies allocating)."""
    monkeypatch.setattr(device, "data_limit", lambda: 768 * MiB)
    alone = load_config(ROOT / "recipes/long_context.toml", ["parallel.cp=1"])
    with pytest.raises(ConfigError, match="capped at 768 MiB \\(RLIMIT_DATA\\).*cp"):
        check_memory(alone, ranks_per_node=1)
    split = check_memory(load_config(ROOT / "recipes/long_context.toml"), ranks_per_node=2)
    assert split.fits and split.memory["activations"] < 0.55 * check_memory(alone, 1, force=True).memory["activations"]
