"""ZeRO's pieces in one process (no torch.distributed: every collective is a copy).

The multi-rank parity tests are in test_zero_parallel.py; these check, fast, that
each stage's composition steps like torch's AdamW, that ZeroAdamW takes
parameter groups as torch optimizers do, and when stage 3 frees parameters.
"""

import pytest
import torch
import torch.nn as nn

from tessel.mesh import make_mesh
from tessel.parallel.zero.engine import STAGES, ZeroDataParallel
from tessel.parallel.zero.gradients import AllReduceGradients, ReduceScatterGradients
from tessel.parallel.zero.optim import ZeroAdamW
from tessel.parallel.zero.parameters import GatheredParameters, WholeParameters
from tessel.parallel.zero.pipeline import pipeline_zero3
from tessel.parallel.zero.zero_parallel import zero_parallel
from tessel.parallel.weight_decay import param_groups


class Stack(nn.Module):
    def __init__(self, width=12, depth=3):
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.LayerNorm(width))
                                    for _ in range(depth))
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _mesh():
    return make_mesh({"dp": 1})


def test_each_stage_is_its_two_pieces():
    assert STAGES[1].gradients is AllReduceGradients and STAGES[1].parameters is WholeParameters
    assert STAGES[2].gradients is ReduceScatterGradients and STAGES[2].parameters is WholeParameters
    assert STAGES[3].gradients is ReduceScatterGradients and STAGES[3].parameters is GatheredParameters


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_rank_steps_exactly_like_adamw(stage):
    """One rank: reductions are copies (divided by 1), AdamW is elementwise, so ZeRO's
    segments must end bit for bit where torch's AdamW on whole parameters does."""
    torch.manual_seed(0)
    net, ref = Stack(), Stack()
    ref.load_state_dict(net.state_dict())
    hyper = dict(lr=1e-2, betas=(0.9, 0.95))
    model, opt = zero_parallel(net, _mesh(), stage, param_groups(net.parameters(), 0.1), **hyper)
    ref_opt = torch.optim.AdamW(param_groups(ref.parameters(), 0.1), **hyper)
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        with model.no_sync():  # an accumulation micro-step, then the synchronised one
            model(x[:4]).pow(2).mean().backward()
        model(x[4:]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x[:4]).pow(2).mean().backward()
        ref(x[4:]).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with model.gathered():
        for (name, got), want in zip(net.state_dict().items(), ref.state_dict().values()):
            assert torch.equal(got, want), f"stage {stage} {name}"


def test_param_group_options_carry_to_segments():
    torch.manual_seed(0)
    net = Stack()
    engine = ZeroDataParallel(net, _mesh(), 2)
    matrices = [p for p in net.parameters() if p.dim() >= 2]
    vectors = [p for p in net.parameters() if p.dim() < 2]
    opt = ZeroAdamW(engine, [{"params": matrices, "lr": 0.1}, {"params": vectors, "lr": 0.2, "weight_decay": 0.0}],
                    weight_decay=0.5)
    got = [(g["lr"], g["weight_decay"], sum(s.numel() for s in g["params"])) for g in opt.param_groups]
    assert got == [(0.1, 0.5, sum(p.numel() for p in matrices)), (0.2, 0.0, sum(p.numel() for p in vectors))]


def test_plain_parameter_list_is_one_group():
    net = Stack()
    opt = ZeroAdamW(ZeroDataParallel(net, _mesh(), 1), net.parameters(), weight_decay=0.3)
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["weight_decay"] == 0.3
    assert sum(s.numel() for s in opt.param_groups[0]["params"]) == sum(p.numel() for p in net.parameters())


def test_bad_parameter_groups_are_refused():
    net, other = Stack(), Stack()
    engine = ZeroDataParallel(net, _mesh(), 2)
    w = net.head.weight
    with pytest.raises(ValueError, match="more than one parameter group"):
        ZeroAdamW(engine, [{"params": [w]}, {"params": [w]}])
    with pytest.raises(ValueError, match="does not shard"):
        ZeroAdamW(engine, other.parameters())


def test_stage3_frees_parameters_after_backward_unless_step_gathered():
    net = Stack()
    engine = pipeline_zero3(net, _mesh())
    loss = engine(torch.randn(2, 4)).sum()
    loss.backward()
    assert not any(g.gathered for g in engine.groups), "freed at the end of backward"
    with engine.step_gathered():
        for _ in range(2):  # two micro-batches: whole throughout
            engine(torch.randn(2, 4)).sum().backward()
            assert all(g.gathered for g in engine.groups)
    assert not any(g.gathered for g in engine.groups), "freed at the end of the step"
    with ZeroDataParallel(Stack(), _mesh(), 2).step_gathered():
        pass  # stages 1, 2: parameters are always whole, nothing to gather
