"""tessel.parallelize from a user's own loop (tessel.api): parity with transformers alone, a checkpoint that
resumes under another layout, bad input named before any collective, `import tessel` without torch.

The loop is examples/own_loop.py's `train`, run on 2 ranks under each layout in one process group (a
tiny Llama under dp2, dp2 ZeRO-1, tp2 with sequence parallelism and pp2; a tiny GPT-2 under tp2); the
reference is the unmodified transformers model trained alone by torch's AdamW and clip_grad_norm_ on the
same batches, with the same weight-decay groups (matrices only) and tessel's loss (the mean next-token
cross-entropy of its logits).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import tessel
from examples.own_loop import batches, tiny_llama, train
from tessel.mesh import Mesh
from tessel.spawn import spawn
from tessel.train.checkpoint.read import read_model_tensors
from tests.helpers import ROOT, cli_env

STEPS = 3
CASES = [  # (model, mesh, layout keys beyond the mesh's axes)
    ("llama", {"dp": 2}, ""),
    ("llama", {"dp": 2}, "zero=1"),
    ("llama", {"tp": 2}, "sp=true"),
    ("llama", {"pp": 2}, ""),  # 1F1B over 2 micro-batches (m defaults to pp)
    ("gpt2", {"tp": 2}, ""),  # a tied head, and a fused q|k|v split per head that full_state_dict reassembles
]


def tiny_gpt2():
    from transformers import GPT2Config
    return GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


CONFIGS = {"llama": tiny_llama, "gpt2": tiny_gpt2}


def user_loops() -> dict[str, tuple[list[float], dict]]:
    """Every case's losses and final weights, on this rank (all ranks of one group)."""
    return {f"{model} {mesh} {layout}": train(CONFIGS[model](), mesh, layout, steps=STEPS)
            for model, mesh, layout in CASES}


def resume_elsewhere(root: str) -> tuple[list[float], dict, dict, str]:
    """Train 3 steps under tp2+SP and save; load that into a job of other weights under dp2 ZeRO-1; one more
    step in both. Returns (the two 4th losses, both jobs' weights, the checkpoint's path)."""
    from transformers import AutoModelForCausalLM
    config = tiny_llama()
    data = list(batches(config.vocab_size, 4, 4, 16))

    def job_for(mesh: dict, layout: str, seed: int):
        torch.manual_seed(seed)
        job = tessel.parallelize(AutoModelForCausalLM.from_config(config), tessel.make_mesh(mesh), layout)
        return job, job.optimizer(lr=1e-2, weight_decay=0.1)

    def step(job, opt, x, y) -> float:
        loss = job.step(job.shard(x), job.shard(y))
        opt.step()
        opt.zero_grad()
        return loss.item()

    first, first_opt = job_for({"tp": 2}, "sp=true", 0)
    for x, y in data[:3]:
        step(first, first_opt, x, y)
    path = first.save(root, 3)
    second, second_opt = job_for({"dp": 2}, "zero=1", 1)
    assert second.load(path) == 3
    losses = [step(first, first_opt, *data[3]), step(second, second_opt, *data[3])]
    return losses, first.full_state_dict(), second.full_state_dict(), str(path)


def on_each_rank(root: str) -> dict:
    return {"loops": user_loops(), "resume": resume_elsewhere(root)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    """Every rank's results of one 2-rank process group (all cases in one spawn: it costs seconds)."""
    return spawn(on_each_rank, 2, str(tmp_path_factory.mktemp("ckpt")), timeout=150)


def alone(model_name: str) -> tuple[list[float], dict]:
    """transformers' model alone: the loop a user has before tessel."""
    from transformers import AutoModelForCausalLM
    config = CONFIGS[model_name]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=1e-2)
    losses = []
    for x, y in batches(config.vocab_size, STEPS, 4, 16):
        loss = F.cross_entropy(model(x).logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def test_own_loop_matches_transformers_alone(runs):
    reference = {name: alone(name) for name in CONFIGS}
    for key, (losses, state) in runs[0]["loops"].items():
        want_losses, want_state = reference[key.split()[0]]
        assert runs[1]["loops"][key][0] == losses, key  # the loss step() returns is the same on every rank
        # dp: two half-batch means averaged, gradients all-reduced; tp: matmuls split over two ranks, a
        # vocab-parallel loss; pp: two micro-batch means. Each only reorders float32 sums (~1e-7 relative per
        # op). Measured after 3 AdamW steps at lr 1e-2: losses within 9.6e-7; weights within 2.9e-6 (Llama,
        # every layout, ZeRO-1 and -3 too) and 2.1e-5 (GPT-2, whose dp2 alone is 1.7e-5 off). Adam divides by
        # sqrt(v), so a rounding-sized change in a near-zero gradient moves its weight by a sizeable fraction
        # of lr: 5x those margins
        torch.testing.assert_close(losses, want_losses, rtol=0, atol=5e-6, msg=key)
        assert state.keys() == want_state.keys(), key  # the names of the model as transformers built it
        atol = {"llama": 2e-5, "gpt2": 1e-4}[key.split()[0]]
        for name, want in want_state.items():
            torch.testing.assert_close(state[name], want, rtol=0, atol=atol, msg=f"{key}: {name}")


def test_a_checkpoint_saved_under_one_layout_resumes_under_another(runs):
    """tp2+SP (torch AdamW's state per parameter) -> dp2 ZeRO-1 (its flat shards): the next step is the
    same, and the checkpoint reads back in one process under the model's own names."""
    (first_loss, second_loss), first, second, path = runs[0]["resume"]
    # the same weights and AdamW moments, one step on the same batch, in two layouts: float32 reorderings of
    # one step only (measured: the same loss, weights within 1.2e-7, one ulp of the largest): 1e-6
    torch.testing.assert_close(second_loss, first_loss, rtol=0, atol=1e-6)
    for name, want in first.items():
        torch.testing.assert_close(second[name], want, rtol=0, atol=1e-6, msg=name)
    saved = read_model_tensors(path)
    assert saved.keys() == first.keys()


def test_bad_layouts_name_what_is_wrong():
    """Before any collective: a layout the mesh does not hold, an unknown key, heads that do not split, a
    mesh without its process group, a model that is not transformers'."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(tiny_llama())
    alone_mesh = Mesh({"pp": 1, "dp": 1, "ep": 1, "tp": 1})
    cases = [
        (alone_mesh, "dp=2", "layout: dp=2 but the mesh has dp=1"),
        (alone_mesh, "dp=1,wide=2", "layout: unknown key 'wide'"),
        (alone_mesh, "mb=2", "layout: micro_batch: step() is given this rank's rows"),
        (alone_mesh, 42, "layout: expected a string"),
        (Mesh({"pp": 1, "dp": 1, "ep": 1, "tp": 3}), "", "parallel.tp: model.n_head (4) is not divisible by tp (3)"),
        (Mesh({"pp": 3, "dp": 1, "ep": 1, "tp": 1}), "", "parallel.pp: model.n_layer (2) is fewer than the pipeline"),
        (Mesh({"pp": 1, "dp": 2, "ep": 1, "tp": 1}), "", "mesh: holds 2 ranks but the process group has 1"),
        ({"dp": 1}, "", "mesh: expected a tessel.Mesh"),
        (Mesh({"cp": 2}), "", "layout: cp > 1 trains through `tessel train`"),  # step() is handed whole rows
    ]
    for mesh, layout, message in cases:
        with pytest.raises(tessel.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            tessel.parallelize(model, mesh, layout)
    with pytest.raises(tessel.ConfigError, match="model: expected a transformers PreTrainedModel"):
        tessel.parallelize(torch.nn.Linear(4, 4), alone_mesh)


def test_import_tessel_stays_light():
    """`import tessel` loads no torch; tessel.parallelize is the library's function, also once the trainer's
    apply steps (tessel.apply) are loaded."""
    code = ("import sys, tessel; assert not [m for m in sys.modules if m.split('.')[0] == 'torch']; "
            "import tessel.apply, tessel.api; assert tessel.parallelize is tessel.api.parallelize")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cli_env(), check=True, timeout=120)
