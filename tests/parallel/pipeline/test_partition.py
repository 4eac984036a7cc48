"""Partitioning and timelines, without processes: layouts, original parameter names, trace files."""

import json

import pytest
import torch
import torch.nn as nn

from tessel.config import ModelConfig
from tessel.models.gpt import GPT
from tessel.observe.timeline import chrome_trace, gantt_png
from tessel.parallel.pipeline.partition import balanced_layout, split_model, uniform_layout, without_modules
from tessel.parallel.pipeline.schedules import build_schedule, simulate
from tessel.parallel.recompute import recompute_blocks


def test_balanced_layout_minimises_the_costliest_stage():
    assert balanced_layout([1] * 8, 4) == [2, 2, 2, 2]
    # a heavy embedding and head push blocks to the middle stages
    assert balanced_layout([1] * 8, 4, head=2, tail=2) == [1, 3, 3, 1]
    assert balanced_layout([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    for costs, k in (([3, 1, 4, 1, 5, 9, 2, 6], 3), ([1] * 7, 7)):
        layout = balanced_layout(costs, k)
        assert sum(layout) == len(costs) and min(layout) >= 1 and len(layout) == k
    with pytest.raises(ValueError):
        balanced_layout([1, 1], 3)


def test_uniform_layout_puts_the_remainder_in_the_middle():
    assert uniform_layout(8, 4) == [2, 2, 2, 2]
    assert uniform_layout(6, 4) == [1, 2, 2, 1]
    assert uniform_layout(5, 2) == [3, 2]  # the last stage also runs the head and the loss
    assert uniform_layout(7, 4) == [2, 2, 2, 1]


def test_stages_keep_the_full_models_parameter_names_and_tensors():
    cfg = ModelConfig(vocab_size=64, n_layer=6, n_head=2, d_model=16, max_seq_len=16)
    model = GPT(cfg)
    full = dict(model.named_parameters())
    layout = [1, 2, 2, 1]
    names = {}
    for rank in range(2):  # pp=2 x 2 virtual stages: rank 0 holds stages 0 and 2
        for chunk in split_model(model, layout, rank, 2):
            for name, p in chunk.named_parameters():
                assert p is full[name], name  # the same tensor under the same name
                names[name] = rank
    assert set(names) == set(full)
    assert names["tok_emb.weight"] == 0 and names["lm_head.weight"] == 1 and names["layers.1.attn.wq.weight"] == 1 and names["layers.3.attn.wq.weight"] == 0
    # the chunks compose to the whole model
    idx = torch.randint(0, 64, (2, 8))
    chunks = {s: c for s, c in zip((0, 2, 1, 3), split_model(model, layout, 0, 2) + split_model(model, layout, 1, 2))}
    x = idx
    for s in range(4):
        x = chunks[s](x)
    torch.testing.assert_close(x, model(idx), rtol=0, atol=0)  # same ops in the same order: bitwise


def test_a_stage_is_the_model_without_the_modules_it_does_not_own():
    cfg = ModelConfig(vocab_size=64, n_layer=4, n_head=2, d_model=16, max_seq_len=16)
    model = GPT(cfg)
    first, last = split_model(model, [2, 2], 0, 2)[0], split_model(model, [2, 2], 1, 2)[0]
    # the model's own class and forward, with the other modules gone (None, or out of `layers`)
    assert type(first) is GPT and first.lm_head is None and first.norm is None and len(first.layers) == 2
    assert last.tok_emb is None and [n for n, _ in last.layers.named_children()] == ["2", "3"]
    assert len(model.layers) == 4 and model.tok_emb is not None  # the model itself stays whole
    # any model is cut by its own names: here a Sequential, whose forward runs what is left
    stack = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    tail = without_modules(stack, ["0"])
    assert [n for n, _ in tail.named_parameters()] == ["2.weight", "2.bias"] and len(stack) == 3
    x = torch.randn(2, 4)
    torch.testing.assert_close(tail(stack[0](x)), stack(x), rtol=0, atol=0)


def test_recompute_keeps_names_and_gradients():
    cfg = ModelConfig(vocab_size=64, n_layer=2, n_head=2, d_model=16, max_seq_len=16)
    torch.manual_seed(0)
    a, b = GPT(cfg), GPT(cfg)
    b.load_state_dict(a.state_dict())
    recompute_blocks(b.layers)
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()]
    idx = torch.randint(0, 64, (2, 8))
    a(idx).square().mean().backward()
    b(idx).square().mean().backward()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        # the recomputed forward runs the same kernels on the same inputs: bitwise equal on CPU
        torch.testing.assert_close(pb.grad, pa.grad, rtol=0, atol=0, msg=n)


def test_trace_and_gantt_files(tmp_path):
    timeline = simulate(build_schedule("1f1b", 3, 4), t_fwd=1e-3, t_bwd=2e-3)
    per_rank = [[(a.kind, a.mb, a.chunk, s, e) for a, s, e in events] for events in timeline]
    trace = json.loads(chrome_trace(per_rank, tmp_path / "t.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 3 * 4 * 2 and {e["pid"] for e in spans} == {0, 1, 2}
    png = gantt_png(per_rank, tmp_path / "g.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a split backward's W is drawn and traced as compute, beside F and B (zero-bubble schedules)
    timeline = simulate(build_schedule("zb-h1", 3, 4), t_fwd=1e-3, t_bwd=2e-3)
    per_rank = [[(a.kind, a.mb, a.chunk, s, e) for a, s, e in events] for events in timeline]
    trace = json.loads(chrome_trace(per_rank, tmp_path / "zb.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted({e["cat"] for e in spans}) == ["backward", "forward", "weight gradients"]
    assert all(e["tid"] == 0 for e in spans) and len(spans) == 3 * 4 * 3
    assert gantt_png(per_rank, tmp_path / "zb.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_time_costs_measure_every_block_and_feed_the_balancer():
    from tessel.parallel.pipeline.partition import time_costs
    cfg = ModelConfig(vocab_size=64, n_layer=4, n_head=2, d_model=16, max_seq_len=16)
    model = GPT(cfg)
    blocks, head, tail = time_costs(model, batch=2, seq_len=8, device=torch.device("cpu"), repeats=1)
    assert len(blocks) == 4 and min(blocks) > 0 and head > 0 and tail > 0
    assert all(p.grad is None for p in model.parameters())  # timing leaves no gradients behind
    layout = balanced_layout(blocks, 2, head, tail)
    assert sum(layout) == 4 and len(layout) == 2
