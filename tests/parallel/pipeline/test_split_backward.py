"""The split backward (B: the input's gradient, W: the weights'), against one whole backward, in one process."""

import json

import pytest
import torch
from torch.testing import assert_close

from tessel.config import ModelConfig
from tessel.models.build import build_model
from tessel.models.gpt import GPT, cross_entropy
from tessel.parallel.pipeline.split_backward import backward_input, grad_node
from tessel.parallel.pipeline.split_plan import plan_of, walk
from tessel.parallel.recompute import recompute_attention_cores, recompute_blocks


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=64, n_layer=2, n_head=4, d_model=32, max_seq_len=16, **kw))


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _whole_backward():
    """The GPT, a batch of token ids, a seed gradient for its logits, and the gradients of one whole backward
    (cleared from the model after)."""
    model = _gpt()
    idx = torch.randint(0, 64, (2, 16))
    seed = torch.randn(2, 16, 64)
    torch.autograd.backward(model(idx), seed)
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    return model, idx, seed, want


def _compare(model, stage, x, seed_grad=None):
    """A whole backward, then B and W on a fresh forward: the same input gradient and weight gradients."""
    inp = x.clone().requires_grad_(True)
    torch.autograd.backward(stage(inp), seed_grad)
    want, want_dx = _grads(model), inp.grad
    model.zero_grad(set_to_none=True)
    inp = x.clone().requires_grad_(True)
    dx, work = backward_input(stage(inp), seed_grad, inp)
    assert all(p.grad is None for p in model.parameters())  # B leaves the weights alone
    assert work.nbytes > 0  # what W needs is held until then
    work.run()
    # the same kernels on the same tensors, in the same order of accumulation: equal, not close
    assert_close(dx, want_dx, rtol=0, atol=0)
    got = _grads(model)
    assert set(got) == set(want) and len(got) > 0
    for name in want:
        assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    model.zero_grad(set_to_none=True)  # for the next comparison


@pytest.mark.parametrize("kind", ["dense", "moe", "recompute", "selective"])
def test_b_then_w_equals_one_backward_on_gpt_blocks(kind):
    model = _gpt(n_experts=4) if kind == "moe" else _gpt()
    if kind == "recompute":  # right, but W rebuilds the blocks once per weight group: tessel.config refuses it
        recompute_blocks(model.layers)
    if kind == "selective":  # the attention core has no weight: W never unpacks it
        recompute_attention_cores(model.modules())
    x, y = torch.randn(2, 16, 32), torch.randint(0, 64, (2, 16))

    def last_stage(h):  # blocks, norm, head and loss: the seed is the loss's own
        for layer in model.layers:
            h = layer(h, model.rope_cos, model.rope_sin)
        return cross_entropy(model.lm_head(model.norm(h)), y)

    _compare(model, last_stage, x)


def test_b_then_w_on_a_hugging_face_decoder_layer(tmp_path):
    doc = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 32}
    (tmp_path / "llama.json").write_text(json.dumps(doc))
    torch.manual_seed(0)
    model = build_model(ModelConfig(hf_config=str(tmp_path / "llama.json")))
    x = torch.randn(2, 8, 32)

    def middle_stage(h):  # the decoder layers only, as a stage between the first and the last
        out = model(inputs_embeds=h)  # tessel returns the logits (tessel.models.hf)
        return getattr(out, "logits", out)

    _compare(model, middle_stage, x, torch.randn(2, 8, 64))


def test_a_stage_without_an_input_gradient_runs_everything_in_w():
    model, idx, seed, want = _whole_backward()
    dx, work = backward_input(model(idx), seed, None)
    assert dx is None and all(p.grad is None for p in model.parameters())
    work.run()
    for name, g in want.items():
        assert_close(model.get_parameter(name).grad, g, rtol=0, atol=0)


def test_w_fires_each_post_accumulate_hook_once_in_one_backward():
    """Data parallelism reduces from these hooks and a callback at the end of the engine's run."""
    model = _gpt()
    fired: list[str] = []
    names = {p: n for n, p in model.named_parameters()}
    for p in model.layers.parameters():
        p.register_post_accumulate_grad_hook(lambda q: fired.append(names[q]))
    x = torch.randn(2, 16, 32, requires_grad=True)
    h = x
    for layer in model.layers:
        h = layer(h, model.rope_cos, model.rope_sin)
    _, work = backward_input(h, torch.ones_like(h), x)
    assert fired == []
    work.run()
    assert sorted(fired) == sorted(n for n, _ in model.layers.named_parameters(prefix="layers"))


def test_the_first_stage_cuts_at_its_blocks_input():
    """Token ids have no gradient: B runs down to the hidden states entering the first block, W the weight
    branches and the embedding's gradient (the runner hands B that tensor)."""
    model, idx, seed, want = _whole_backward()
    hidden = []
    model.layers[0].register_forward_pre_hook(lambda module, args: hidden.append(args[0]))
    dx, work = backward_input(model(idx), seed, hidden[0])
    assert dx is not None and all(p.grad is None for p in model.parameters())
    work.run()
    assert set(_grads(model)) == set(want)
    for name, g in want.items():
        assert_close(model.get_parameter(name).grad, g, rtol=0, atol=0)


def _middle_stage(model):
    def stage(h):
        for layer in model.layers:
            h = layer(h, model.rope_cos, model.rope_sin)
        return h
    return stage


def test_micro_batches_of_one_shape_reuse_one_plan_and_stay_exact():
    """Each micro-batch builds a graph of one shape: the first is analysed, the others replay its plan
    (in walk positions) on their own nodes, and every one's B and W still equal its whole backward."""
    model = _gpt()
    plan_of.cache_clear()
    for mb in range(3):
        _compare(model, _middle_stage(model), torch.randn(2, 16, 32), torch.randn(2, 16, 32))
        assert plan_of.cache_info().misses == 1 and plan_of.cache_info().hits == mb
    # a batch of another size builds the same nodes: the same plan, still exact
    _compare(model, _middle_stage(model), torch.randn(3, 8, 32), torch.randn(3, 8, 32))
    assert plan_of.cache_info().misses == 1


def test_a_replayed_plan_equals_a_fresh_analysis_of_the_new_graph():
    model = _gpt()
    stage = _middle_stage(model)
    graphs = []
    for _ in range(2):
        inp = torch.randn(2, 16, 32, requires_grad=True)
        graphs.append((walk(stage(inp).grad_fn), grad_node(inp)))
    (first, in_first), (second, in_second) = graphs
    assert first.shape == second.shape and first.nodes[0] is not second.nodes[0]  # two graphs, one shape
    fresh = plan_of.__wrapped__(second.shape, second.position[in_second], 0)
    assert fresh == plan_of.__wrapped__(first.shape, first.position[in_first], 0)
    cut = [second.nodes[n].name() for n, _ in fresh.inputs]
    assert cut == ["MmBackward0"] * (2 * 7)  # q, k, v, out, and the MLP's three, in each block
    scales = {second.nodes[c].variable for c, _ in fresh.vectors}  # the norms' weights: B's, not W's
    assert scales == {layer.attn_norm.weight for layer in model.layers} | {layer.mlp_norm.weight
                                                                           for layer in model.layers}


def test_a_graph_of_another_shape_misses_and_is_planned_afresh():
    """A stage whose graph differs (here one block where the plan was found on two) does not match the
    kept plan: it is analysed on its own, kept beside the first, and both stay exact."""
    model = _gpt()
    plan_of.cache_clear()
    x, seed = torch.randn(2, 16, 32), torch.randn(2, 16, 32)
    two_blocks, one_block = _middle_stage(model), lambda h: model.layers[0](h, model.rope_cos, model.rope_sin)
    _compare(model, two_blocks, x, seed)
    _compare(model, one_block, x, seed)
    assert plan_of.cache_info().misses == 2
    _compare(model, two_blocks, x, seed)  # the first shape's plan, still kept
    assert plan_of.cache_info().misses == 2 and plan_of.cache_info().hits == 1


def test_a_recomputed_attention_core_keeps_the_graph_and_its_plan():
    """Non-reentrant recomputation rebuilds saved tensors, not nodes: the dense stage's plan is replayed on
    the recomputed stage, exactly."""
    model = _gpt()
    plan_of.cache_clear()
    x, seed = torch.randn(2, 16, 32), torch.randn(2, 16, 32)
    _compare(model, _middle_stage(model), x, seed)
    recompute_attention_cores(model.modules())
    _compare(model, _middle_stage(model), x, seed)
    assert plan_of.cache_info().misses == 1 and plan_of.cache_info().hits == 1


def test_vectors_weights_are_computed_by_b_and_matrices_wait_for_w():
    """Biases and a LayerNorm's weight and bias are vectors: B computes their gradients along with the
    input's (held, not accumulated, until W), so the norm is no cut node; the matrices' gradients wait for
    W. Both exact."""
    torch.manual_seed(0)
    stage = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 32),
                                torch.nn.LayerNorm(32))
    x, seed = torch.randn(2, 16, 32), torch.randn(2, 16, 32)
    _compare(stage, stage, x, seed)
    inp = x.clone().requires_grad_(True)
    graph = walk(stage(inp).grad_fn)
    plan = plan_of(graph.shape, graph.position[grad_node(inp)], 0)
    vectors = {graph.nodes[c].variable for c, _ in plan.vectors}
    assert vectors == {stage[0].bias, stage[2].bias, stage[3].weight, stage[3].bias}
    deferred = {graph.nodes[c].next_functions[0][0].variable for g in plan.groups for c, _ in g.edges}
    assert deferred == {stage[0].weight, stage[2].weight}  # each through its transpose's node


class _ScaledTwice(torch.nn.Module):
    """A vector used by the input's path (x * s) and by a weight branch of its own ((s * s).sum())."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32, bias=False)
        self.s = torch.nn.Parameter(torch.randn(32))

    def forward(self, x):
        return self.lin(x) * self.s + (self.s * self.s).sum()


def test_a_vector_also_fed_by_a_weight_branch_stays_w_s():
    """Capturing s's gradient in B would pull its branch (s * s) into B, and W would run it again: counted
    twice. B leaves such a vector to W."""
    torch.manual_seed(0)
    stage = _ScaledTwice()
    x, seed = torch.randn(2, 16, 32), torch.randn(2, 16, 32)
    inp = x.clone().requires_grad_(True)
    torch.autograd.backward(stage(inp), seed)
    want = _grads(stage)
    stage.zero_grad(set_to_none=True)
    inp = x.clone().requires_grad_(True)
    out = stage(inp)
    graph = walk(out.grad_fn)
    assert plan_of(graph.shape, graph.position[grad_node(inp)], 0).vectors == ()
    _, work = backward_input(out, seed, inp)
    work.run()
    # s's two gradients are summed in another order than one backward sums them: equal to float32's rounding
    # (twice the branch's would be off by 2 * 16 * 32 * |s|)
    for name, g in _grads(stage).items():
        assert_close(g, want[name], msg=name)
