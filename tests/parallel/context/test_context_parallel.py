"""Context parallelism (tessel.parallel.context) against one process: ring attention and Ulysses.

Two spawns. Each first checks the attention itself on random data (ring and Ulysses at the world's cp,
grouped-query heads: output and input gradients of each rank's chunks against torch's SDPA on the whole
sequence), then trains every layout of its world 5 steps through the real trainer (tests.helpers.
build_trainer: the sampler hands each cp rank its chunks, the cohort averages the loss over cp, the
gradients of replicated weights are averaged over cp like dp's). Compared with the same run on one
process: the loss of each step, the gradient norm of each step, the first step's gradients and the final
weights (gathered whole over tp and pp), a validation loss and a sampled text (generation runs whole
prompts on every cp rank). A Hugging Face model's reference is the unmodified transformers model.
2 ranks: ring cp2, Ulysses cp2, Llama under ring and Ulysses cp2, and a cp2 checkpoint that one process
resumes (cp shards no weights: checkpoints are unchanged). 4 ranks: ring cp4 (selective recompute), cp2 x tp2 with
sequence parallelism, cp2 x dp2 under ZeRO-2, cp2 x pp2 (tied embeddings), Ulysses cp2 x dp2 under ZeRO-3,
Llama cp2 x tp2 with sequence parallelism.

Mixture of experts (tessel.parallel.context.moe): a cp rank routes its own chunks, but capacity and the
load-balancing statistics belong to the whole sequences of a forward call. The reference GPT's MoE with
dropped tokens under ring cp2 (global scope: one process on the whole batch) and under cp2 x ep2 with the
local scope (the reference accumulates the ep ranks' halves of the batch as two chunks, each capped and
balanced on its own; cp2 x pp2 under 1F1B likewise, its two micro-batches the chunks), and without drops
under Ulysses cp2 x ep2 (global scope over ep x cp), with drops under cp2 x tp2 with SP; the aux and
z-losses, the drop rate and a load share of each step are compared too. Hugging Face Mixtral (router aux
loss on) under Ulysses cp2, cp2 x ep2, cp2 x tp2 with SP and cp2 x pp2 (GPipe: the router loss across stages,
of the whole step), GPT-2 (learned positions) under ring cp2, cp2 x tp2 with SP and cp2 x pp2, Llama under
cp2 x pp2. Both spawns also check
SequenceSlots itself on random choices: each rank keeps exactly the assignments one process keeps.

The 4 ranks also measure activation memory: the tiny model at 2048 tokens (one sequence a rank, fp32) under
ring cp4, ring cp2 x dp2 and Ulysses cp2 x dp2 (dp2 gives each rank one sequence's share, as cp2 alone
would), against one process. Each rank's peak over a step's forward and backward is measured with the
profiler's allocation record (tessel.testing.activations.step_peak): it falls as 1/cp, and the cost
model's activations term for the same layout (planned_peak) is within 10% of it. The README's table at 8192
tokens comes from benchmarks/cp_memory.py.
"""


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from tessel.commands import support
from tessel.testing.activations import planned_peak, step_peak
from tessel.mesh import make_mesh
from tessel.models.moe import local_slots
from tessel.parallel.context import layout
from tessel.parallel.context.context import CPContext
from tessel.parallel.context.moe import SequenceSlots
from tessel.parallel.pipeline.runner import PipelineRunner
from tessel.parallel.tensor.tensor_parallel import TPContext, full_tensor
from tessel.sharding import shard_dims
from tessel.spawn import spawn
from tests.helpers import build_trainer, tiny_config, write_configs

STEPS = 5
# seq 32: cp4 holds 8 chunks of 4 tokens; 2 kv heads: the ring passes kv heads un-repeated (a Hugging Face
# config brings its own: 2 for Llama and Mixtral, GPT-2 has none)
COMMON = ("train.seq_len=32", f"train.steps={STEPS}", "train.lr=1e-3", "train.min_lr=1e-4",
          "train.eval_every=5", "train.sample_tokens=8", "train.eval_batches=2")
GQA = "model.n_kv_head=2"
LLAMA = {"model_type": "llama", "vocab_size": 251, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64, "pad_token_id": 3, "bos_token_id": 1, "eos_token_id": 2}
# Mixtral: llama's attention and a sparse MoE block (no capacity); its router aux loss on, at 100x the
# default coefficient so that balance statistics taken per cp rank would show (measured below)
MIXTRAL = {"model_type": "mixtral", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2, "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2,
           "output_router_logits": True, "router_aux_loss_coef": 0.1}
# GPT-2: learned absolute position embeddings (each rank must embed its own positions), tied head, dropout 0
GPT2 = {"model_type": "gpt2", "vocab_size": 128, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}
HF = {"llama": LLAMA, "mixtral": MIXTRAL, "gpt2": GPT2}
# Families of other structure, each from its own config class's defaults shrunk (tessel.commands.support.tiny_config) to
# 2 layers: q/k norms per head (Qwen3, Qwen3-MoE) and over all heads (OLMo 2), fused q|k|v and gate|up (Phi-3),
# GPT-NeoX's parallel block with its interleaved q|k|v and partial rotary, Granite's multipliers (the attention
# scale arrives as `scaling`), Cohere's parallel block and logit scale, GLM-4's four norms and partial rotary,
# Qwen3-MoE's experts; and the two whose scores are more than scaled and masked: Gemma 2 (sliding and global
# layers alternating, attention soft-capping, query_pre_attn_scalar) and StarCoder2 (a window on every layer),
# both with a window of 6 tokens, so that it cuts across cp2's chunks of 8 (seq 32); and DeepSeek-V3's latent
# attention, whose values are narrower than its queries and keys (v_head_dim 8 against 8 + 8; its rotary part
# is head_dim wide; its keys and values have every head), with shared experts and a first dense layer
FAMILIES = {"qwen3": {}, "olmo2": {}, "phi3": {}, "gpt_neox": {}, "granite": {}, "cohere": {}, "glm4": {},
            "qwen3_moe": {}, "gemma2": {"sliding_window": 6}, "starcoder2": {"sliding_window": 6},
            "deepseek_v3": {"head_dim": 8, "v_head_dim": 8, "num_key_value_heads": 4}}
ULYSSES = 'parallel.cp_mode="ulysses"'
THREE_STEPS = ("train.steps=3", "train.eval_every=3")
# The reference GPT with MoE blocks in every layer: top-2, aux and z-losses on. DROP gives the experts slots
# for half the assignments, so capacity decides which tokens each expert takes: a cp rank counting it on its
# own chunks would drop other tokens than one process. "ref:X" is an override of the reference alone.
MOE = ["model.n_experts=4", "model.moe_top_k=2", "model.aux_loss_coef=0.1", "model.z_loss_coef=0.01"]
DROP = "model.capacity_factor=1.0"
NO_DROP = "model.capacity_factor=4.0"  # capacity = tokens: no expert can overflow
WORLD2 = {
    "ring_cp2": ["parallel.cp=2"],
    "ulysses_cp2": ["parallel.cp=2", ULYSSES],
    "llama_ring_cp2": ["{llama}", "parallel.cp=2"],
    "llama_ulysses_cp2": ["{llama}", "parallel.cp=2", ULYSSES, "parallel.recompute=true"],
    # capacity and balance statistics of the whole batch (aux_loss_scope "global"): one process on it
    "moe_ring_cp2": [*MOE, DROP, "parallel.cp=2"],
    "mixtral_ulysses_cp2": ["{mixtral}", "parallel.cp=2", ULYSSES],
    "gpt2_ring_cp2": ["{gpt2}", "parallel.cp=2"],
    # 3 steps (the reference's too: it takes the same non-parallel overrides), to keep the suite's time
    **{f"{kind}_{mode}_cp2": ["{%s}" % kind, *THREE_STEPS, "parallel.cp=2", *extra] for kind in FAMILIES
       for mode, extra in (("ring", []), ("ulysses", [ULYSSES]))},
}
WORLD4 = {
    "ring_cp4": ["parallel.cp=4", "parallel.recompute='selective'"],
    "cp2_tp2_sp": ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "cp2_dp2_zero2": ["parallel.cp=2", "parallel.dp=2", "parallel.zero_stage=2"],
    "cp2_pp2": ["parallel.cp=2", "parallel.pp=2", "parallel.micro_batches=2", "model.tie_embeddings=true"],
    "cp2_dp2_zero3": ["parallel.cp=2", "parallel.dp=2", "parallel.zero_stage=3", ULYSSES],
    "llama_cp2_tp2_sp": ["{llama}", "parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
    # aux_loss_scope "local" with drops: each ep rank's half of the batch is routed, capped and balanced on its
    # own (its sequences whole over cp), as the reference's two accumulation chunks are
    "moe_cp2_ep2_local": [*MOE, DROP, 'model.aux_loss_scope="local"', "parallel.cp=2", "parallel.ep=2",
                          "ref:train.grad_accum=2"],
    # "global": balance statistics over ep x cp; capacity is per ep rank, so no drops (test_global_balance.py)
    "moe_ulysses_cp2_ep2": [*MOE, NO_DROP, "parallel.cp=2", "parallel.ep=2", ULYSSES],
    "mixtral_cp2_ep2": ["{mixtral}", "parallel.cp=2", "parallel.ep=2"],
    # 1F1B, local scope: each micro-batch routed, capped and balanced on its own, as the reference's chunks
    "moe_cp2_pp2_local": [*MOE, DROP, 'model.aux_loss_scope="local"', "parallel.cp=2", "parallel.pp=2",
                          "parallel.micro_batches=2", "ref:train.grad_accum=2"],
    # tp x SP: a replicated MoE block gathers its rank's sequence shard back to the cp chunks before routing
    "moe_cp2_tp2_sp": [*MOE, DROP, "parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "mixtral_cp2_tp2_sp": ["{mixtral}", "parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "gpt2_cp2_tp2_sp": ["{gpt2}", "parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
    # a stage after the first takes hidden states (inputs_embeds) and this rank's positions all the same
    "llama_cp2_pp2": ["{llama}", "parallel.cp=2", "parallel.pp=2", "parallel.micro_batches=2"],
    # GPT-2's position embedding lives on the first stage; its head is tied to the embedding across stages
    "gpt2_cp2_pp2": ["{gpt2}", "parallel.cp=2", "parallel.pp=2", "parallel.micro_batches=2"],
    # Mixtral's router loss spans the stages (cross_stage) and, under GPipe, the whole step: the whole batch's
    # the window and soft-cap of the whole sequences, each dp rank's sequences split over its cp ranks
    "gemma2_cp2_dp2": ["{gemma2}", "parallel.cp=2", "parallel.dp=2"],
    "mixtral_cp2_pp2_gpipe": ["{mixtral}", "parallel.cp=2", "parallel.pp=2", "parallel.micro_batches=2",
                              'parallel.schedule="gpipe"'],
}
# evaluation routes each ep rank's half of a batch under capacity, the grad_accum reference the whole batch in
# one call (measured 6e-5 apart); the pipeline evaluates the whole batch, as the reference does
NO_VAL = {"moe_cp2_ep2_local"}
MEMORY_SEQ = 2048
MEMORY_COMMON = (f"model.max_seq_len={MEMORY_SEQ}", f"train.seq_len={MEMORY_SEQ}", "train.global_batch=1")
MEMORY = {"ring_cp4": (4, ["parallel.cp=4"]),
          "ring_cp2_dp2": (2, ["parallel.cp=2", "parallel.dp=2", "train.global_batch=2"]),
          "ulysses_cp2_dp2": (2, ["parallel.cp=2", "parallel.dp=2", "train.global_batch=2", ULYSSES])}
# fp32 throughout. Ring attention adds the softmax of each query row in cp blocks merged by their
# log-sum-exp, Ulysses computes it whole on a head group; everything else is the one process's arithmetic
# on fewer tokens, summed over cp by the gradient all-reduce (in another order). Measured: attention
# outputs and input gradients within 1.2e-6 of SDPA; losses within 9.5e-7 (2 ulp of a loss of 5.5),
# gradient norms within 6e-8, first-step gradients within 1.9e-8 absolute (the largest 5e-2), final
# weights within 1e-5 (cp2 x tp2; AdamW's 1/sqrt(v) amplifies rounding where a gradient is ~0). A lost
# block, a wrong causal pair, a wrong rotary position or a gradient not averaged over cp moves the
# loss by > 1e-3 and gradients by O(1) relative; AdamW moves a weight ~lr = 1e-3 a step, so WEIGHT_TOL's
# 5e-5 is 1/20 of one step (the argument of tests/parallel/tensor/test_hf_tensor_parallel.py).
# MoE, Mixtral, GPT-2 and the Hugging Face cp2 x pp2 and cp2 x tp2 runs: routing makes the same choices on numbers a few ulps apart
# (no token sits on a tie here) and the balance statistics are summed over cp in another order; measured
# losses within 9.5e-7, gradient norms within 6e-8, first-step gradients within 3e-8, final weights
# within 1.5e-6, the aux and z-losses within 1.5e-8 and the drop rate and load share exactly (all layouts;
# validation within 4.8e-7). Counting capacity on each rank's own chunks (SequenceSlots left out) moves
# the MoE GPT's loss by 1.4e-4 and its weights by 6e-3; balance statistics of each rank's own chunks move
# them by 1e-4 and 4e-3, Mixtral's by 2.8e-5 (inside LOSS_TOL) and 2.4e-3 (about 50x WEIGHT_TOL's atol):
# the weights catch each.
# tied embeddings: one tensor under the embedding's name (the reference GPT's, GPT-2's)
TIED = {"lm_head.weight": ("tok_emb.weight", "transformer.wte.weight")}
ATTN_TOL = dict(rtol=1e-5, atol=1e-5)
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
NORM_TOL = dict(rtol=1e-4, atol=1e-6)
GRAD_TOL = dict(rtol=1e-4, atol=1e-7)
WEIGHT_TOL = dict(rtol=1e-4, atol=5e-5)
MOE_METRICS = ("moe/aux_loss", "moe/z_loss", "moe/drop_rate", "moe/load/L0/e0")


def _attention_errors() -> dict[str, list[float]]:
    """Ring and Ulysses at cp = world on random (B, H, T, D) data against SDPA on the whole sequence: the
    largest error of this rank's output and of its q, k, v gradients."""
    cp = dist.get_world_size()
    mesh = make_mesh({"cp": cp})
    torch.manual_seed(0)  # the same data on every rank
    B, H, KV, T, D = 2, 2 * cp, cp, 8 * cp, 8  # Ulysses splits heads and kv heads over cp
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, KV, T, D), torch.randn(B, KV, T, D)
    dout = torch.randn(B, H, T, D)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(whole[0], whole[1].repeat_interleave(H // KV, 1),
                                         whole[2].repeat_interleave(H // KV, 1), is_causal=True)
    ref.backward(dout)
    mine = torch.tensor(layout.positions(T, cp, mesh.coord("cp")))
    errors = {}
    for mode in ("ring", "ulysses"):
        local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
        out = CPContext.from_mesh(mesh, mode).attention(*local)
        out.backward(dout[:, :, mine])
        errors[mode] = [(out - ref[:, :, mine]).abs().max().item()] + [
            (t.grad - w.grad[:, :, mine]).abs().max().item() for t, w in zip(local, whole)]
    return errors


def _slot_errors() -> list[int]:
    """Capacity under cp (tessel.parallel.context.moe.SequenceSlots) at cp = world on random top-2 choices (some
    second choices skipped, as random routing does): the assignments of this rank's chunks whose kept/dropped
    verdict differs from one process's on the whole sequences, for two capacity factors; then under
    whole_sequences (generation), against one process on the rank's own tokens."""
    cp = dist.get_world_size()
    ctx = CPContext.from_mesh(make_mesh({"cp": cp}), "ring")
    torch.manual_seed(1)  # the same choices on every rank
    B, T, E = 3, 8 * cp, 4
    experts = torch.randint(0, E, (B, T, 2))
    experts[..., 1] = experts[..., 1].masked_fill(torch.rand(B, T) < 0.2, -1)
    mine = ctx.positions(T // cp, torch.device("cpu"))
    local = experts[:, mine].reshape(-1, 2)
    wrong = []
    for factor in (0.5, 1.0):
        whole = local_slots(experts.reshape(-1, 2), E, factor).view(B, T, 2)[:, mine].reshape(-1, 2)
        assert not whole.all()  # capacity drops some
        wrong.append(int((SequenceSlots(ctx)(local, E, factor, B) != whole).sum()))
    with ctx.whole_sequences():
        wrong.append(int((SequenceSlots(ctx)(local, E, 0.5, B) != local_slots(local, E, 0.5)).sum()))
    return wrong


def _over_ep(t: torch.Tensor, p: torch.Tensor, mesh) -> torch.Tensor:
    """An expert weight (or its gradient) whole: its ep shards joined along the experts' dim."""
    dim = shard_dims(p).get("ep")
    if dim is None or mesh.size("ep") == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(mesh.size("ep"))]
    dist.all_gather(parts, t.contiguous(), group=mesh.group("ep"))
    return torch.cat(parts, dim=dim)


def _whole(model, runner, mesh, cfg, grads: bool) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) whole, by name: gathered over tp and ep, then over the pipeline's
    stages."""
    ctx = TPContext.from_mesh(mesh, cfg.parallel.sequence_parallel)
    named = runner.named_parameters() if isinstance(runner, PipelineRunner) else dict(model.named_parameters())
    mine = {n: _over_ep(full_tensor(p.grad if grads else p, p, ctx), p, mesh) for n, p in named.items()}
    if mesh.size("pp") == 1:
        return mine
    stages = [None] * mesh.size("pp")
    dist.all_gather_object(stages, mine, group=mesh.group("pp"))
    return {n: t for stage in stages for n, t in stage.items()}


def _train(overrides: list[str], out_dir: str | None = None) -> dict:
    """5 steps of the trainer; losses, norms, validation loss, sample, first gradients, final weights."""
    hf = any(o.startswith("model.hf_config") for o in overrides)
    cfg = tiny_config(*COMMON, *([] if hf else [GQA]), *overrides, out_dir=out_dir)
    trainer, model, runner, mesh = build_trainer(cfg)
    out: dict = {}
    forward_backward = runner.forward_backward

    def capture(x, y):  # the first step's gradients, reduced, before clipping and the update
        loss = forward_backward(x, y)
        if cfg.parallel.zero_stage < 2:  # ZeRO-2/3 keep their gradients in flat shards (compared by norm)
            out.setdefault("grads", _whole(model, runner, mesh, cfg, grads=True))
        return loss

    runner.forward_backward = capture
    summary = trainer.fit()
    # ZeRO-3 frees the module's parameters between steps: only its flat shards hold them (compared by the
    # losses and norms they produce)
    weights = _whole(model, runner, mesh, cfg, False) if cfg.parallel.zero_stage < 3 else None
    out.update(losses=summary.losses, norms=[row["grad_norm"] for row in trainer.history],
               val_loss=summary.val_loss, sample=summary.sample, weights=weights,
               moe={k: [row[k] for row in trainer.history] for k in MOE_METRICS if k in trainer.history[0]})
    return out


def _layouts(layouts: dict, hf: dict[str, str]) -> dict[str, list[str]]:
    """The layouts' overrides with the Hugging Face configs' paths in (and "ref:" overrides kept)."""
    paths = {kind: f'model.hf_config="{path}"' for kind, path in hf.items()}
    return {name: [o.format(**paths) for o in overrides] for name, overrides in layouts.items()}


def _parallel(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.startswith("ref:")]


def _world(layouts: dict, hf: dict[str, str], root: str) -> dict:
    out = {"attention": _attention_errors(), "slots": _slot_errors()}
    out.update({name: _train(_parallel(o)) for name, o in _layouts(layouts, hf).items()})
    if dist.get_world_size() == 2:  # saved under cp2 at step 3 (and trained on to 5), resumed below by one process
        saved = [*WORLD2["ring_cp2"], "checkpoint.every=3", "fault.heartbeat_s=0"]
        out["saved_cp2"] = _train(saved, out_dir=f"{root}/saved_cp2")["losses"]
    else:
        # the least of 3: one step's count varies in steps of one (1024, 32) fp32 activation (128 KiB) as
        # the exchanges' buffers are released a little earlier or later, by up to 13% on repeated measurement
        out["memory"] = {name: min(step_peak(tiny_config(*MEMORY_COMMON, *o)) for _ in range(3))
                         for name, (_, o) in MEMORY.items()}
    return out


def _family_config(kind: str, changes: dict) -> dict:
    doc = {**support.tiny_config(kind), "num_hidden_layers": 2, **changes}
    return {**doc, "layer_types": None} if "layer_types" in doc else doc  # the class lays out 2 layers' types


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> dict[str, str]:
    families = {kind: _family_config(kind, changes) for kind, changes in FAMILIES.items()}
    return write_configs(tmp_path_factory.mktemp("hf"), {**HF, **families})


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cp"))


@pytest.fixture(scope="module")
def world2(hf, root):
    return spawn(_world, 2, WORLD2, hf, root, timeout=600)


@pytest.fixture(scope="module")
def world4(hf, root):
    return spawn(_world, 4, WORLD4, hf, root, timeout=600)


@pytest.fixture(scope="module")
def references(hf):
    """One process, the same recipes without the parallel fields (recompute kept: it changes no number), with
    the "ref:" overrides. A Hugging Face model's is the unmodified transformers model."""
    refs: dict[tuple, dict] = {}
    out = {}
    for name, overrides in _layouts({**WORLD2, **WORLD4}, hf).items():
        key = tuple(o.removeprefix("ref:") for o in overrides if not o.startswith("parallel.") or "recompute" in o)
        if key not in refs:
            refs[key] = _train(list(key))
        out[name] = refs[key]
    return out


def _check(name: str, got: dict, ref: dict, rank: int) -> None:
    where = f"{name} rank {rank}"
    assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **LOSS_TOL, msg=lambda m: f"{where}: {m}")
    assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), **NORM_TOL,
                 msg=lambda m: f"{where} grad norm: {m}")
    if name not in NO_VAL:
        assert_close(got["val_loss"], ref["val_loss"], **LOSS_TOL)
    assert got["sample"] == ref["sample"], f"{where}: sample differs"
    recipe = {**WORLD2, **WORLD4}[name]
    if DROP in recipe:  # capacity decides: the same tokens dropped as one process drops
        assert min(ref["moe"]["moe/drop_rate"]) > 0.05, ref["moe"]["moe/drop_rate"]
    if NO_DROP in recipe:
        assert max(ref["moe"]["moe/drop_rate"]) == 0
    if "parallel.pp=2" not in recipe:  # (a pipeline rank's moe/* rows count its own stage's layers)
        # the aux and z-losses, the drop rate, a load share of each step: summed over cp (and ep)
        assert got["moe"].keys() == ref["moe"].keys()
        for key, values in got["moe"].items():
            assert_close(torch.tensor(values), torch.tensor(ref["moe"][key]), **LOSS_TOL,
                         msg=lambda m, key=key: f"{where} {key}: {m}")
    if got["weights"] is None:
        return
    # a pipeline's last stage holds its own copy of a tied head: it must equal the embedding
    assert set(got["weights"]) - set(ref["weights"]) <= set(TIED)
    assert set(ref["weights"]) <= set(got["weights"])
    ref_name = {n: n if n in ref["weights"] else next(t for t in TIED[n] if t in ref["weights"])
                for n in got["weights"]}
    for n, g in got.get("grads", {}).items():
        assert_close(g, ref["grads"][ref_name[n]], **GRAD_TOL, msg=lambda m, n=n: f"{where} grad {n}: {m}")
    for n, w in got["weights"].items():
        assert_close(w, ref["weights"][ref_name[n]], **WEIGHT_TOL, msg=lambda m, n=n: f"{where} weight {n}: {m}")


@pytest.mark.parametrize("name", list(WORLD2))
def test_parity_world2(world2, references, name):
    ref = references[name]
    assert ref["losses"][-1] < ref["losses"][0]  # it learns, so equality is not trivial
    for rank, result in enumerate(world2):
        _check(name, result[name], ref, rank)


@pytest.mark.parametrize("name", list(WORLD4))
def test_parity_world4(world4, references, name):
    for rank, result in enumerate(world4):
        _check(name, result[name], references[name], rank)
    if not name.startswith("cp2_dp2_zero"):
        assert "grads" in world4[0][name]  # the gradients were compared, not only their norm


def test_attention_matches_sdpa_on_the_whole_sequence(world2, world4):
    for world in (world2, world4):
        for rank, result in enumerate(world):
            for mode, errors in result["attention"].items():
                assert max(errors) < ATTN_TOL["atol"], (len(world), mode, rank, errors)


def test_moe_capacity_under_cp_drops_what_one_process_drops(world2, world4):
    for world in (world2, world4):
        for rank, result in enumerate(world):
            assert result["slots"] == [0, 0, 0], (len(world), rank, result["slots"])


def test_a_cp2_checkpoint_resumes_under_cp1(world2, root, references):
    """cp shards no weights: the cp2 run's step-3 checkpoint, resumed by one process, takes steps 4 and 5
    as the cp2 run took them (and as one process does)."""
    resumed = _train([f'checkpoint.resume="{root}/saved_cp2/checkpoints/step_00000003"'],
                     out_dir=f"{root}/resumed_cp1")["losses"]
    assert len(resumed) == 2
    assert_close(torch.tensor(resumed), torch.tensor(world2[0]["saved_cp2"][3:]), **LOSS_TOL)
    assert_close(torch.tensor(resumed), torch.tensor(references["ring_cp2"]["losses"][3:]), **LOSS_TOL)


def test_activation_memory_per_rank_falls_as_one_over_cp(world4):
    whole = step_peak(tiny_config(*MEMORY_COMMON))
    for name, (cp, _) in MEMORY.items():
        for rank, result in enumerate(world4):
            peak = result["memory"][name]
            # 1/cp of the tokens, and a little more: the least of 3 measured 0.7% over for the ring (positions,
            # rotary tables, buffers), 0.7-4.8% for Ulysses, varying run to run and rank to rank (when its
            # exchanges' buffers are freed against the head's backward)
            assert 0.99 * whole / cp <= peak <= 1.08 * whole / cp, (name, rank, peak, whole)
            # the planner: measured within 1.4% (cp1) and 2-3.5% (cp2, cp4) of its prediction
            assert planned_peak(tiny_config(*MEMORY_COMMON, *MEMORY[name][1])) == pytest.approx(peak, rel=0.10)
    assert planned_peak(tiny_config(*MEMORY_COMMON)) == pytest.approx(whole, rel=0.10)
