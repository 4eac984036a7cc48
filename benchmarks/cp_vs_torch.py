"""Context parallelism at cp2: tessel's ring attention against torch's own, or an all-gather baseline.

torch's context parallelism (torch.distributed.tensor.experimental.context_parallel) swaps the CUDA
attention kernels (flash, efficient, cuDNN) for its ring; on CPU, SDPA runs
aten._scaled_dot_product_flash_attention_for_cpu, which it does not handle ("does not have a sharding
strategy registered", torch 2.13). The script tries it first on the ranks' device and, where it does not
run, compares against the other common design instead: every rank all-gathers the keys and values of the
whole sequence and attends its own queries to them under a causal mask of their positions, the gradients
of keys and values reduce-scattered back (the all-gather context parallelism of Llama 3's training,
Dubey et al. 2024, "The Llama 3 Herd of Models"). Both sides are the same model, weights,
layout (cp2, this rank's head and tail chunks, rotary at its positions, gradients averaged over cp) and
batches, through tessel.parallelize; only the attention core differs. One step is forward, backward and
AdamW; steps of the two sides alternate so load on the machine hits both alike. Prints each side's first
losses (equal: the same mathematics), the median step times, and the ratio tessel / baseline last.

    PYTHONPATH=$PWD python benchmarks/cp_vs_torch.py [--seq 8192] [--steps 12] [--warmup 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessel.apply import parallelize
from tessel.config import build_config
from tessel.mesh import make_mesh
from tessel.models.build import build_model
from tessel.models.gpt import Attention, apply_rotary
from tessel.parallel.context import layout
from tessel.parallel.context.kernel import repeat_kv
from tessel.parallel.tensor.comm import GatherSeq
from tessel.spawn import spawn
from tessel.train.data import BatchSampler, load_tokens
from tessel.train.optim import build_optimizer


def _config(args):
    raw = {"model": {"vocab_size": 256, "n_layer": args.layers, "n_head": 4, "d_model": args.d_model,
                     "max_seq_len": args.seq},
           "parallel": {"cp": 2},
           "train": {"global_batch": 1, "seq_len": args.seq, "warmup_steps": 0, "sample_tokens": 0},
           "data": {"source": "synthetic"}}
    return build_config(raw)


class AllGatherCore:
    """Attention.core of the baseline: rotary at this rank's positions, k and v all-gathered over cp (their
    gradients reduce-scattered: Korthikanti et al.'s g, tessel.parallel.tensor.comm.GatherSeq), then this
    rank's queries against every key under the causal mask of their positions."""

    def __init__(self, group, cp: int, rank: int):
        self.group, self.cp, self.rank = group, cp, rank

    def __call__(self, q, k, v, cos, sin):
        T = q.size(-2) * self.cp
        mine = torch.tensor(layout.positions(T, self.cp, self.rank))
        every = torch.tensor([p for r in range(self.cp) for p in layout.positions(T, self.cp, r)])  # gathered order
        q, k = apply_rotary(q, cos[mine], sin[mine]), apply_rotary(k, cos[mine], sin[mine])
        k, v = GatherSeq.apply(k, 2, self.group), GatherSeq.apply(v, 2, self.group)  # (B, Hkv, T, D)
        heads = q.size(1)
        mask = mine.unsqueeze(1) >= every.unsqueeze(0)  # (T/cp, T): a query sees the keys at or before it
        return F.scaled_dot_product_attention(q, repeat_kv(k, heads), repeat_kv(v, heads), attn_mask=mask)


def torch_cp_runs(mesh) -> str | None:
    """None when torch's context_parallel runs attention on this device; else what it says."""
    from torch.distributed.device_mesh import init_device_mesh  # deferred: only this probe uses DTensor's mesh
    from torch.distributed.tensor.experimental import context_parallel
    cp_mesh = init_device_mesh(mesh.device.type, (dist.get_world_size(),))
    q = torch.randn(1, 2, 8, 4, device=mesh.device)
    try:
        with context_parallel(cp_mesh, buffers=[q], buffer_seq_dims=[2]):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
    except (NotImplementedError, RuntimeError) as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return None


def _side(cfg, mesh, baseline: bool):
    torch.manual_seed(0)
    model = build_model(cfg.model)
    runner = parallelize(model, mesh, cfg)
    if baseline:
        core = AllGatherCore(mesh.group("cp"), mesh.size("cp"), mesh.coord("cp"))
        for module in model.modules():
            if isinstance(module, Attention):
                module.core = core
    return runner, build_optimizer(runner.parameters(), cfg.train)


def _rank(args) -> dict:
    cfg = _config(args)
    mesh = make_mesh(cfg.parallel.axis_sizes)
    why_not_torch = torch_cp_runs(mesh)
    if why_not_torch is None:
        raise SystemExit("torch's context_parallel runs here: compare against it (not written: no such device "
                         "was available when this benchmark was written)")
    tokens = load_tokens(cfg.data, cfg.model.vocab_size, seed=0)
    columns = layout.positions(cfg.train.seq_len, 2, mesh.coord("cp"))
    sampler = BatchSampler(tokens.train, cfg.train.seq_len, 1, 0, columns=columns)
    sides = {"tessel ring": _side(cfg, mesh, False), "all-gather kv": _side(cfg, mesh, True)}
    times: dict[str, list[float]] = {name: [] for name in sides}
    losses: dict[str, list[float]] = {name: [] for name in sides}
    for step in range(args.warmup + args.steps):
        x, y = sampler.batch_at(step)
        for name, (runner, opt) in sides.items():
            dist.barrier()
            t0 = time.perf_counter()
            loss = runner.forward_backward(x, y)
            opt.step()
            opt.zero_grad(set_to_none=False)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
            losses[name].append(loss.item())
    return {"times": {k: v[args.warmup:] for k, v in times.items()}, "losses": losses, "why": why_not_torch}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    out = spawn(_rank, 2, args, timeout=3600)[0]
    print(f"torch's context_parallel on this device: {out['why']}")
    print(f"so the peer is the all-gather-kv baseline; cp2, one sequence of {args.seq} tokens, "
          f"d_model {args.d_model}, {args.layers} layers, {args.steps} timed steps")
    for name, losses in out["losses"].items():
        print(f"{name:>14}: first losses {', '.join(f'{v:.5f}' for v in losses[:3])}; "
              f"median step {statistics.median(out['times'][name]) * 1e3:.1f} ms")
    ring, base = (statistics.median(out["times"][k]) for k in ("tessel ring", "all-gather kv"))
    print(f"tessel / all-gather step time: {ring / base:.3f}")


if __name__ == "__main__":
    main()
