"""Asynchronous pipelines (PipeDream-2BW, PipeDream with weight stashing) against single-process references of
their version semantics (tessel.parallel.pipeline.weight_versions), and their step lists as data.

- 2BW: a plain training loop applying the same one-step-delayed rule, W_{k+1} = W_k - lr * g_{k-1}(W_{k-1})
  (step 0 applies nothing), on the same batches: every micro-batch's loss and the final weights agree.
- PipeDream: an emulation in one process that runs the same step lists (async_schedules.py) event by event
  in the order the unit-time replay starts them, each stage updating after every micro-batch's W with that
  micro-batch's gradient (averaged over dp), each forward and backward on the version the rule names:
  the stage's newest at the forward, or with vertical sync the version rank 0 had at the micro-batch's
  forward there (counted by the emulation itself). Losses of every micro-batch and final weights agree.
"""

import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.func import functional_call
from torch.testing import assert_close

from tessel.apply import parallelize
from tessel.mesh import make_mesh
from tessel.models.gpt import GPT, cross_entropy
from tessel.parallel.pipeline.async_schedules import build_async
from tessel.parallel.pipeline.partition import split_model, uniform_layout
from tessel.parallel.pipeline.schedules import max_in_flight, simulate
from tessel.spawn import spawn
from tessel.train.data import BatchSampler, load_tokens
from tessel.parallel.weight_decay import param_groups
from tessel.train.optim import build_optimizer, build_scheduler, lr_at
from tessel.train.trainer import Trainer
from tests.helpers import tiny_config

STEPS = 4
M = 4
# fp32. Each micro-batch runs the same kernels on the same rows in both runs; what differs is the
# order of sums: the dp average, the split backward's two-part accumulation (bitwise equal to a whole
# backward on one micro-batch, tests/parallel/pipeline/test_split_backward.py), the 2BW gradient summed
# over micro-batches in another grouping, the global norm per stage then over stages. AdamW divides by
# sqrt(v) and can magnify ulps where a gradient is tiny: the same bounds as the synchronous pipelines'
# parity (tests/parallel/pipeline/test_pipeline.py). A wrong weight version (the current one instead of the
# stashed one, a one-step delay missing) moves losses by >1e-3 after the first update at lr 1e-2.
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
WEIGHT_TOL = dict(rtol=1e-4, atol=5e-5)


def _config(schedule: str, pp: int, dp: int, *extra: str):
    clip = ["train.grad_clip=0"] if schedule == "pipedream" else []
    return tiny_config("model.n_layer=4", f"parallel.pp={pp}", f"parallel.dp={dp}", f'parallel.schedule="{schedule}"',
                       "parallel.allow_async=true", f"parallel.micro_batches={M}", f"train.steps={STEPS}",
                       *clip, *extra, out_dir=tempfile.mkdtemp(prefix="tessel-async-"))


CONFIGS = [("2bw", 4, 1, ()), ("pipedream", 4, 1, ("parallel.vertical_sync=true",)),
           ("2bw", 2, 2, ()), ("pipedream", 2, 2, ())]


def _run(configs) -> list[dict]:
    """Inside a spawn: train each config with the trainer; every step's micro-batch losses, this rank's weights."""
    out = []
    for schedule, pp, dp, extra in configs:
        cfg = _config(schedule, pp, dp, *extra)
        mesh = make_mesh({"pp": pp, "dp": dp})
        torch.manual_seed(cfg.train.seed)
        runner = parallelize(GPT(cfg.model), mesh, cfg)
        runner.timeline = False
        losses: dict[int, float] = {}
        step = runner.forward_backward

        def recorded(x, y, step=step, runner=runner, losses=losses):
            loss = step(x, y)
            losses.update(runner.executor.micro_losses)  # the last stage's, by global micro-batch
            return loss

        runner.forward_backward = recorded
        Trainer(cfg, mesh, runner, dist.get_rank()).fit()
        out.append({"losses": losses, "dp": mesh.coord("dp"),
                    "state": {k: v.detach().clone() for k, v in runner.state_dict().items()},
                    **runner.extra_metrics()})
    return out


def _batches(cfg):
    """The global batch of every step, as the trainer's sampler deals it (dp shards are its row blocks)."""
    tokens = load_tokens(cfg.data, cfg.model.vocab_size, seed=cfg.train.seed)
    sampler = BatchSampler(tokens.train, cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed, 0, 1,
                           cfg.model.vocab_size)
    return [sampler.next() for _ in range(STEPS)]


def _reference_2bw(pp: int, dp: int) -> dict:
    """One process: batch k's gradient on W_k; the update at the end of step k applies batch k-1's."""
    cfg = _config("2bw", pp, dp)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    opt = build_optimizer(list(model.parameters()), cfg.train)
    sched = build_scheduler(opt, cfg.train)
    losses, pending = {}, None
    for k, (x, y) in enumerate(_batches(cfg)):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for i, (xs, ys) in enumerate(zip(x.chunk(dp * M), y.chunk(dp * M))):
            loss = cross_entropy(model(xs), ys)
            losses[(i // M, k * M + i % M)] = loss.item()  # (dp rank, its global micro-batch)
            for g, dg in zip(grads, torch.autograd.grad(loss / (dp * M), list(model.parameters()))):
                g += dg
        if pending is not None:  # one step late: batch k-1's gradient, taken on W_{k-1}
            for p, g in zip(model.parameters(), pending):
                p.grad = g
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), cfg.train.grad_clip)
        opt.step()  # at step 0 no parameter has a gradient: nothing moves
        sched.step()
        opt.zero_grad(set_to_none=True)
        pending = grads
    return {"losses": losses, "state": dict(model.state_dict())}


def _reference_pipedream(pp: int, dp: int, vertical: bool) -> dict:
    """One process, event by event through the same step lists: versions as PipeDream's rule names them."""
    cfg = _config("pipedream", pp, dp, *(["parallel.vertical_sync=true"] if vertical else []))
    t = cfg.train
    torch.manual_seed(t.seed)
    model = GPT(cfg.model)
    stages = [split_model(model, uniform_layout(cfg.model.n_layer, pp), r, pp)[0] for r in range(pp)]
    opts = [torch.optim.AdamW(param_groups(s.parameters(), t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2))
            for s in stages]
    versions = [[{n: p.detach().clone() for n, p in s.named_parameters()}] for s in stages]  # [stage][u]
    first_version: dict[int, int] = {}  # micro-batch -> rank 0's updates at its forward there
    plan = build_async(pp, M)
    held: dict = {}  # (stage, g, d) -> (input leaf, output, weights leaves, version)
    grads: dict = {}  # (stage, g, d) -> weight gradients
    losses, prev_y = {}, ()
    for k, (x, y) in enumerate(_batches(cfg)):
        xs, ys = x.chunk(dp * M), y.chunk(dp * M)
        lists = plan.lists(k)
        timeline = simulate(lists, 1, strict=False, carried=[set(c) for c in plan.carried_into(k)] if k else None)
        events = sorted(((start, r, a) for r, acts in enumerate(timeline) for a, start, _ in acts),
                        key=lambda e: (e[0], e[1]))
        for _, r, a in events:
            g = k * M + a.mb
            batch = g // M
            for g_opts in opts[r].param_groups:
                g_opts["lr"] = lr_at(k, t)
            if a.kind == "F":
                if r == 0:
                    first_version[g] = len(versions[0]) - 1
                u = first_version[g] if vertical else len(versions[r]) - 1
                for d in range(dp):
                    i = d * M + g % M
                    w = {n: v.detach().requires_grad_(True) for n, v in versions[r][u].items()}
                    inp = xs[i] if r == 0 and batch == k else None
                    if r > 0:
                        inp = held[(r - 1, g, d)][1].detach().requires_grad_(True)
                    elif batch != k:
                        raise AssertionError("rank 0 forwards only its own step's batch")
                    out = functional_call(stages[r], w, (inp,))
                    if r == pp - 1:
                        target = y.chunk(dp * M)[i] if batch == k else prev_y[i]
                        loss = cross_entropy(out, target)
                        losses[(d, g)] = loss.item()
                        out = loss / M
                    held[(r, g, d)] = (inp, out, w, u)
            elif a.kind == "B":
                for d in range(dp):
                    inp, out, w, u = held[(r, g, d)]
                    seed = None if r == pp - 1 else held[(r + 1, g, d)][0].grad
                    leaves = ([inp] if r > 0 else []) + list(w.values())
                    got = torch.autograd.grad(out, leaves, seed, allow_unused=True)
                    if r > 0:
                        inp.grad = got[0]
                        got = got[1:]
                    grads[(r, g, d)] = got
            else:  # W: the stage updates with this micro-batch's gradient, averaged over dp
                for p, *per_d in zip(stages[r].parameters(), *(grads.pop((r, g, d)) for d in range(dp))):
                    p.grad = sum(per_d) / dp
                opts[r].step()
                opts[r].zero_grad(set_to_none=True)
                versions[r].append({n: q.detach().clone() for n, q in stages[r].named_parameters()})
        prev_y = y.chunk(dp * M)
    return {"losses": losses, "state": dict(model.state_dict())}


@pytest.fixture(scope="module")
def results():
    return spawn(_run, 4, CONFIGS, timeout=600)


@pytest.mark.parametrize("c", range(len(CONFIGS)), ids=[f"{s}-pp{p}-dp{d}" + ("-vertical" if e else "")
                                                        for s, p, d, e in CONFIGS])
def test_async_pipeline_matches_its_single_process_version_semantics(results, c):
    schedule, pp, dp, extra = CONFIGS[c]
    ref = _reference_2bw(pp, dp) if schedule == "2bw" else _reference_pipedream(pp, dp, bool(extra))
    assert len(ref["losses"]) > dp * M * (STEPS - 1)  # most micro-batches reached the loss
    seen = set()
    for rank in results:
        got = rank[c]
        for g, loss in got["losses"].items():  # the last stage's ranks
            assert_close(torch.tensor(loss), torch.tensor(ref["losses"][(got["dp"], g)]), **LOSS_TOL,
                         msg=lambda msg: f"{CONFIGS[c]} micro-batch {g}: {msg}")
        for name, w in got["state"].items():
            assert_close(w, ref["state"][name], **WEIGHT_TOL, msg=lambda msg: f"{CONFIGS[c]} {name}: {msg}")
        seen |= set(got["state"])
        assert got["stash_mb"] > 0
    assert seen == set(ref["state"])
    first, last = ([v for (d, g), v in ref["losses"].items() if g // M == k] for k in (0, STEPS - 1))
    assert sum(last) / len(last) < sum(first) / len(first)  # it learns, so agreement is not trivially true


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (3, 4), (4, 4), (4, 8), (8, 16)])
def test_async_steps_continue_each_other_with_no_bubble_at_unit_times(p, m):
    plan = build_async(p, m)
    for k in range(len(plan.steps) + 1):
        lists, carried = plan.lists(k), [set(c) for c in plan.carried_into(k)]
        for strict in (True, False):  # messages meet their partners under NCCL's and gloo's rules
            timeline = simulate(lists, 1, t_fwd=1, t_bwd=2, strict=strict, carried=carried if k else None)
        for r, acts in enumerate(lists):
            computes = [a for a in acts if a.kind in "FBW"]
            if k >= len(plan.steps) - 1:  # steady: m of each kind, none older than the previous batch
                assert sorted(a.kind for a in computes) == sorted("FBW" * m)
                assert min(a.mb for a in computes) >= -m and max(a.mb for a in computes) < m
                # rank 0 forwards exactly this step's batch; 1F1B's memory: p - r micro-batches from F to W
                assert r > 0 or [a.mb for a in computes if a.kind == "F"] == list(range(m))
        if k >= len(plan.steps) - 1:  # every rank busy from the step's start to its end
            end = max(e for events in timeline for _, _, e in events)
            assert all(sum(e - s for _, s, e in events) == end for events in timeline)
    assert max_in_flight([a for a in plan.lists(0)[0] if a.kind in "FBW"]) <= p
