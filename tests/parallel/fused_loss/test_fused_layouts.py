"""train.fused_loss on every layout it plugs into: the same training as the unfused loss on one process.

One spawn of two ranks trains each layout 3 steps with the fused loss; its reference is one process with
train.fused_loss = false (today's loss on the whole fp32 logits), from the same seed and batches. Compared:
each step's loss and global gradient norm, the validation loss (the fused loss without gradients), a sampled
text (the head's logits taken back from its input: the model's whole-vocabulary logits, TP's FullLogits, a
pipeline's last stage through gather_vocab, cp's whole sequences) and the final weights (tp shards gathered;
under a pipeline the rank's stage). Layouts: tp2 (plain, sequence-parallel, a vocabulary tp does not divide,
tied embeddings), pp2 (1F1B with the tied head on the last stage, the same under ZeRO-3, and ZBV, whose last
stage is rank 0's second chunk and whose split backward runs the fused node twice), dp2 ZeRO-3 (the root unit holds the head), cp2, ep2 MoE
(aux losses added to the fused loss), Hugging Face Llama (tp2 + SP, a padded vocabulary) and GPT-2 (tp2, its
head tied), and the parameter server (one worker, one server).
"""

import contextlib
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from tessel.parallel.fused_loss.apply import HeadInput
from tessel.parallel.fused_loss.kernel import Vocab, linear_cross_entropy
from tessel.parallel.tensor.tensor_parallel import TPContext, full_tensor
from tessel.sharding import shard_axes
from tessel.spawn import spawn
from tessel.train.ps.trainer import train_rank_ps
from tests.helpers import build_trainer, tiny_config, train_and_collect

STEPS = ["train.steps=3", "train.eval_every=3", "train.eval_batches=1", "train.sample_tokens=6"]
FUSED = "train.fused_loss=true"
MOE = ["model.n_experts=4", "model.moe_every=2", "model.moe_top_k=2", "model.capacity_factor=4.0",
       'model.aux_loss_scope="local"']
LLAMA = {"model_type": "llama", "vocab_size": 251, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64, "pad_token_id": 3, "bos_token_id": 1, "eos_token_id": 2}
GPT2 = {"model_type": "gpt2", "vocab_size": 128, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}
# name -> (overrides of the two-rank run, overrides of its one-process reference); "{llama}" and "{gpt2}"
# stand for the model.hf_config of those configs
LAYOUTS = {
    "tp2": (["parallel.tp=2"], []),
    "tp2_sp_odd_vocab": (["parallel.tp=2", "parallel.sequence_parallel=true", "model.vocab_size=251"],
                         ["model.vocab_size=251"]),
    "tp2_tied": (["parallel.tp=2", "model.tie_embeddings=true"], ["model.tie_embeddings=true"]),
    "pp2_1f1b_tied": (["parallel.pp=2", "parallel.micro_batches=2", "model.tie_embeddings=true"],
                      ["model.tie_embeddings=true"]),
    # ZeRO-3 under a pipeline: each stage gathered for a step, an evaluation (its loss reads the head) or sampling
    "pp2_zero3_tied": (["parallel.pp=2", "parallel.micro_batches=2", "parallel.zero_stage=3",
                        "model.tie_embeddings=true"], ["model.tie_embeddings=true"]),
    # ZBV: the last stage is rank 0's second chunk, and the split backward runs the fused node twice (B, W)
    "pp2_zbv": (["parallel.pp=2", "parallel.micro_batches=2", 'parallel.schedule="zbv"', "parallel.virtual_stages=2",
                 "model.n_layer=4"], ["model.n_layer=4"]),
    "dp2_zero3": (["parallel.dp=2", "parallel.zero_stage=3"], []),
    "cp2": (["parallel.cp=2"], []),
    "ep2_moe": ([*MOE, "parallel.ep=2"], [*MOE, "train.grad_accum=2"]),
    "llama_tp2_sp": (["{llama}", "parallel.tp=2", "parallel.sequence_parallel=true"], ["{llama}"]),
    "gpt2_tp2": (["{gpt2}", "parallel.tp=2"], ["{gpt2}"]),
    # one worker and one server; the reference is the all-reduce layout on one process
    "ps": (['parallel.dp_arch="ps"', "parallel.ps_servers=1"], []),
}
# fp32 throughout. The fused loss takes the same logits chunk by chunk and sums their statistics in another
# order than F.cross_entropy over the whole batch, and under tp the vocabulary's halves are merged by
# all-reduces: losses and gradients agree to ~1e-7 relative per step (measured). Over 3 AdamW steps at
# lr 1e-2 the losses agree to ~1e-6; 1e-5 catches any real mistake (a lost vocabulary half, a doubled or
# missing gradient of the head or the hidden states moves the loss by >1e-3 by the 2nd step).
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
NORM_TOL = dict(rtol=1e-4, atol=1e-6)  # a norm sums many more products (tests/parallel/test_hybrid.py)
# AdamW divides by sqrt(v): where a gradient is near zero a ~1e-7 difference becomes a visible step
# (measured up to 5e-5 in a tied embedding row); a lost or doubled head gradient moves weights by ~lr = 1e-2
WEIGHT_TOL = dict(rtol=1e-4, atol=1e-4)


def _overrides(names: list[str], paths: dict[str, str]) -> list[str]:
    return [f'model.hf_config="{paths[o[1:-1]]}"' if o.startswith("{") else o for o in names]


def _train(cfg) -> dict:
    if cfg.parallel.dp_arch == "ps":
        summary = train_rank_ps(cfg, torch.device("cpu"))
        return {} if summary is None else {"losses": summary.losses, "val_loss": summary.val_loss,
                                           "sample": summary.sample, "fused": True}
    trainer, model, runner, mesh = build_trainer(cfg)
    summary = trainer.fit()
    out = {"losses": summary.losses, "val_loss": summary.val_loss, "sample": summary.sample,
           "grad_norms": [row["grad_norm"] for row in trainer.history],
           "fused": any(isinstance(m.forward, HeadInput) for m in model.modules())}  # its head hands out its input
    gathered = runner.gathered() if hasattr(runner, "gathered") else runner.model.gathered() \
        if getattr(getattr(runner, "model", None), "stage", 0) == 3 else contextlib.nullcontext()
    with gathered:  # a pipeline's stage under the full model's names; ZeRO-3's parameters whole
        named = runner.named_parameters() if hasattr(runner, "named_parameters") else dict(model.named_parameters())
        tp = TPContext.from_mesh(mesh)
        # tp shards whole (the head's among them); ep's experts have their own tests
        out["weights"] = {n: full_tensor(p, p, tp) for n, p in named.items() if set(shard_axes(p)) <= {"tp"}}
    return out


def _run_layouts(paths: dict[str, str]) -> dict:
    out = {name: _train(tiny_config(*STEPS, FUSED, *_overrides(run, paths))) for name, (run, _) in LAYOUTS.items()}
    return {**out, "kernel": _vocab_parallel_kernel()}


KERNEL_VOCAB, KERNEL_ROWS = 251, 126  # split over tp2: 252 rows, the last one padding


def _kernel_inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g)
    weight = torch.randn(KERNEL_VOCAB, 16, generator=g)
    return hidden, weight, torch.randint(0, KERNEL_VOCAB, (37,), generator=g)


def _vocab_parallel_kernel() -> dict:
    """This rank's half of the head's rows, straight through the kernel (chunks of 8 tokens: a ragged last one),
    plain and soft-capped: the loss, the hidden states' gradient once summed over tp as the head's entry sums
    it, and the rows' gradient."""
    rank = dist.get_rank()
    hidden, weight, targets = _kernel_inputs()
    shard = torch.cat([weight, weight.new_zeros(1, 16)])[rank * KERNEL_ROWS:(rank + 1) * KERNEL_ROWS]
    out = {}
    for cap in (None, 2.0):
        h, w = hidden.clone().requires_grad_(), shard.clone().requires_grad_()
        vocab = Vocab(start=rank * KERNEL_ROWS, size=KERNEL_VOCAB, group=dist.group.WORLD, softcap=cap, chunk=8)
        loss = linear_cross_entropy(h, w, None, targets, vocab)
        dh, dw = torch.autograd.grad(loss, (h, w))
        dist.all_reduce(dh)
        out[cap] = (loss.detach(), dh, dw)
    return out


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("hf")
    for name, doc in {"llama": LLAMA, "gpt2": GPT2}.items():
        (folder / f"{name}.json").write_text(json.dumps(doc))
    return {name: str(folder / f"{name}.json") for name in ("llama", "gpt2")}


@pytest.fixture(scope="module")
def references(paths):
    """The one-process unfused run of some reference overrides, trained once for the layouts that share it."""
    done = {}

    def reference(overrides: list[str]) -> dict:
        key = tuple(overrides)
        if key not in done:
            done[key] = train_and_collect(tiny_config(*STEPS, *_overrides(overrides, paths)))
        return done[key]
    return reference


@pytest.fixture(scope="module")
def world2(paths):
    return spawn(_run_layouts, 2, paths, timeout=600)


def test_vocab_parallel_kernel_equals_the_whole_vocabularys_loss(world2):
    """tp2 over a vocabulary it does not divide (251 -> 2 x 126, one padding row), with and without Gemma 2's
    soft-capping: the loss and the hidden states' gradient of the whole head, and each rank its rows' gradient
    (the padding row's zero). fp32: the two all-reduces merge the halves' statistics in another order (~1e-7)."""
    hidden, weight, targets = _kernel_inputs()
    for cap in (None, 2.0):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logits = F.linear(h, w)
        loss = F.cross_entropy(logits if cap is None else torch.tanh(logits / cap) * cap, targets)
        dh, dw = torch.autograd.grad(loss, (h, w))
        dw = torch.cat([dw, dw.new_zeros(1, 16)])
        for rank, got in enumerate(r["kernel"][cap] for r in world2):
            assert_close(got[0], loss.detach(), rtol=1e-5, atol=1e-6, msg=f"cap {cap} rank {rank} loss")
            assert_close(got[1], dh, rtol=1e-5, atol=1e-6, msg=f"cap {cap} rank {rank} hidden")
            assert_close(got[2], dw[rank * KERNEL_ROWS:(rank + 1) * KERNEL_ROWS], rtol=1e-5, atol=1e-6,
                         msg=f"cap {cap} rank {rank} rows")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fused_loss_trains_as_the_unfused_one_on_one_process(world2, references, name):
    ref = references(LAYOUTS[name][1])
    assert ref["losses"][-1] < ref["losses"][0]  # it learns, so equality is not trivial
    # every rank that holds the head fused it (under pp the last stage alone)
    fused = [r[name]["fused"] for r in world2 if r[name]]
    assert all(fused) if "pp2" not in name else sorted(fused) == [False, True]
    for rank, got in enumerate(world2):
        got = got[name]
        if not got:  # the parameter server's server rank trains nothing
            continue
        assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **LOSS_TOL, msg=f"{name} rank {rank}")
        if "grad_norms" in got:
            assert_close(torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"]), **NORM_TOL,
                         msg=f"{name} rank {rank} grad norm")
        assert_close(got["val_loss"], ref["val_loss"], **LOSS_TOL, msg=f"{name} rank {rank} validation")
        assert got["sample"] == ref["sample"], f"{name} rank {rank}: sample differs"
        for n, w in got.get("weights", {}).items():
            assert_close(w, ref["state"][n], **WEIGHT_TOL, msg=f"{name} rank {rank} {n}")
