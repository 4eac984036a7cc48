"""Hybrid layouts (issue 6): several axes and ZeRO in one run, loss-for-loss with one process.

Each layout trains 5 steps from the same seed and batches as a single-process
reference. MoE capacity is counted per forward call, so an MoE reference
accumulates over as many chunks as the run has data shards (one chunk = one
rank's batch, or one micro-batch of it under a pipeline) and both see the
same routing decisions. Besides the losses, every step's gradient norm is
compared, where the run evaluates or samples, the validation loss and the
sampled text, and under a pipeline the final weights each stage holds (those
not split over tp or ep; under ZeRO-3 gathered for the check).
"""

import torch
from torch.testing import assert_close

from tessel.sharding import shard_axes
from tessel.spawn import spawn
from tests.helpers import build_trainer, tiny_config, train_and_collect

STEPS = ["train.steps=5"]
# references accumulate one chunk per rank's shard (capacity is per shard): so do the balancing statistics
MOE = ["model.n_experts=4", "model.moe_every=2", "model.moe_top_k=2", "model.capacity_factor=1.0",
       'model.aux_loss_scope="local"']
SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
# evaluation, sampling (full-vocab logits gathered on the last stage) and tied embeddings
# (their gradient summed between the first and last stage, per tp shard) join the comparison
PP_EXTRAS = ["model.tie_embeddings=true", "train.eval_every=5", "train.sample_tokens=8"]
DP2_PP2 = ["parallel.dp=2", "parallel.pp=2", "parallel.micro_batches=2"]

# name -> (overrides of the parallel run, overrides of its single-process reference)
# packed documents (tessel.models.documents): id 21 is ~6% of the synthetic tokens of a 32-id vocabulary
DOCUMENTS = ["model.vocab_size=32", "model.document_separator=21"]
WORLD2 = {"dp2_zero3": (["parallel.dp=2", "parallel.zero_stage=3"], []),
          # each rank's mask from its own rows, inside ZeRO-3's gathers; with a window inside the documents
          "dp2_zero3_documents": ([*DOCUMENTS, "model.sliding_window=6", "parallel.dp=2", "parallel.zero_stage=3"],
                                  [*DOCUMENTS, "model.sliding_window=6"])}
WORLD4 = {
    "dp2_tp2_zero2": (["parallel.dp=2", "parallel.tp=2", "parallel.zero_stage=2"], []),
    "tp2_ep2_moe": (MOE + ["parallel.tp=2", "parallel.ep=2"], MOE + ["train.grad_accum=2"]),
    "dp2_tp2_moe_zero1": (MOE + ["parallel.dp=2", "parallel.tp=2", "parallel.zero_stage=1"],
                          MOE + ["train.grad_accum=2"]),
    # ZeRO under a pipeline: one engine over the rank's chunks, reduced after its last backward;
    # with tied embeddings (PP_EXTRAS) stages 2 and 3 reduce after the flush, once the
    # embedding's and the head's gradients are summed; ZeRO-3 gathers each stage once a step
    "dp2_pp2_zero1_tied": (PP_EXTRAS + DP2_PP2 + ["parallel.zero_stage=1"], PP_EXTRAS),
    "dp2_pp2_zero2": (DP2_PP2 + ["parallel.zero_stage=2"], []),
    "dp2_pp2_zero2_tied": (PP_EXTRAS + DP2_PP2 + ["parallel.zero_stage=2"], PP_EXTRAS),
    "dp2_pp2_zero3_tied": (PP_EXTRAS + DP2_PP2 + ["parallel.zero_stage=3"], PP_EXTRAS),
    # sequence parallelism under a pipeline: stages exchange (B, T/tp, C) per rank
    "pp2_tp2_sp": (PP_EXTRAS + SP + ["parallel.pp=2", "parallel.micro_batches=2"], PP_EXTRAS),
    # MoE under sequence parallelism: each tp rank gathers the sequence and routes it whole
    # (every block MoE: its mlp_norm stays sequence-parallel, its weight gradient summed over tp)
    "tp2_ep2_sp_moe": (MOE + SP + ["model.moe_every=1", "parallel.ep=2"],
                       MOE + ["model.moe_every=1", "train.grad_accum=2"]),
}

# fp32. Sharded matmuls and all-reduces add in other orders than one process
# (relative error ~1e-7 per op); over 5 AdamW steps the losses measured agree
# to ~1e-6. 1e-5 leaves room for that and still catches any real mistake (a
# lost shard or a doubled gradient moves the loss by >1e-3 within 2 steps).
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
# A gradient norm sums many more products than the loss and after a few steps the
# weights carry the losses' ~1e-6 drift; 1e-4 relative is still far below a lost or
# doubly counted shard (a tp or pp shard is >= 1% of the squared norm here).
NORM_TOL = dict(rtol=1e-4, atol=1e-6)
# Final weights: AdamW divides by sqrt(v), so where a gradient is near zero the
# ~1e-7 relative differences above grow to ~1e-5 absolute in a weight (measured:
# up to 4.2e-5, one element of a tied embedding under dp2 x pp2 ZeRO-1, on an
# AVX-512 machine whose kernels round differently from AVX2's). 1e-4 covers that;
# a lost tied-gradient sum or a stale stage moves weights by ~lr = 1e-2.
WEIGHT_TOL = dict(rtol=1e-4, atol=1e-4)


def _train(cfg) -> dict:
    trainer, _, runner, _ = build_trainer(cfg)
    summary = trainer.fit()
    out = {"losses": summary.losses, "val_loss": summary.val_loss, "sample": summary.sample,
           "grad_norms": [row["grad_norm"] for row in trainer.history]}
    if getattr(getattr(runner, "zero", None), "stage", 0) == 3:  # at rest only the shards remain
        out["rest_bytes"] = sum(p.untyped_storage().nbytes() for p in runner.parameters())
    if hasattr(runner, "named_parameters"):  # a pipeline: this rank's stage under the full model's names
        with runner.gathered():
            out["stage"] = {n: p.detach().clone() for n, p in runner.named_parameters().items()
                            if not shard_axes(p)}  # tp and ep shards have their own tests
    return out


def _run_layouts(layouts: dict) -> dict:
    return {name: _train(tiny_config(*STEPS, *run)) for name, (run, _) in layouts.items()}


def _check(layouts: dict, world: int) -> None:
    got = spawn(_run_layouts, world, layouts, timeout=600)
    refs: dict[tuple, dict] = {}  # layouts that share a reference train it once
    for name, (_, ref_overrides) in layouts.items():
        key = tuple(ref_overrides)
        if key not in refs:
            refs[key] = train_and_collect(tiny_config(*STEPS, *ref_overrides))
        ref = refs[key]
        reference = ref["losses"]
        assert len(reference) == 5
        assert reference[-1] < reference[0]  # it learns, so equality is not trivial
        for rank, result in enumerate(got):
            assert_close(torch.tensor(result[name]["losses"]), torch.tensor(reference),
                         msg=lambda m: f"{name} rank {rank}: {m}", **LOSS_TOL)
            # the global gradient norm (before clipping, which it drives) over every layout's shards
            assert_close(torch.tensor(result[name]["grad_norms"]), torch.tensor(ref["grad_norms"]),
                         msg=lambda m: f"{name} rank {rank} grad norm: {m}", **NORM_TOL)
            if ref["val_loss"] is not None:  # evaluation: the same tolerance as training losses
                assert_close(result[name]["val_loss"], ref["val_loss"], **LOSS_TOL)
            # sampling: the logits agree to ~1e-6, far below what could flip a seeded draw
            assert result[name]["sample"] == ref["sample"], f"{name} rank {rank}: sample differs"
            assert result[name].get("rest_bytes", 0) == 0, f"{name}: ZeRO-3 left whole parameters after the step"
            for n, w in result[name].get("stage", {}).items():
                assert_close(w, ref["state"][n], msg=lambda m: f"{name} rank {rank} {n}: {m}", **WEIGHT_TOL)


def test_world4_layouts_match_single_process():
    _check(WORLD4, 4)


def test_world2_layouts_match_single_process():
    _check(WORLD2, 2)


WORLD8 = {
    "dp2_tp2_pp2": (PP_EXTRAS + ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.micro_batches=2"],
                    PP_EXTRAS),
    # every block MoE, so the first stage has router losses of its own to back-propagate;
    # the reference accumulates one chunk per micro-batch of each ep shard (2 x 2)
    "pp2_tp2_ep2_moe": (MOE + ["model.moe_every=1", "parallel.pp=2", "parallel.tp=2", "parallel.ep=2",
                               "parallel.micro_batches=2"],
                        MOE + ["model.moe_every=1", "train.grad_accum=4"]),
}


def test_world8_layouts_match_single_process():
    _check(WORLD8, 8)
