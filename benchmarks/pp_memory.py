"""Memory a pipeline schedule holds per rank, measured by the runner against the planner's prediction.

    PYTHONPATH=. python benchmarks/pp_memory.py --pp 2 --micro-batches 8

For each schedule the same GPT (vocabulary 64, so the head's and the loss's
tensors stay small next to the blocks') trains a few steps on gloo; each rank
reports the peak of what it held for backward in a step (`act_peak_mb_rank`:
every tensor autograd saved, counted from the forward to the end of its
backward, W's for a split backward, plus the gradients B captured for W) and,
for an asynchronous pipeline, its stashed weight versions (`stash_mb`). The
planner's numbers come from tessel.planner: the micro-batches it reads off the
runtime's lists as held at once (held_micro_batches) times the stage's blocks
times one block's saved bytes (tessel.planner.memory.layer_activation_bytes,
exact per block: tests/planner/test_activation_memory.py), plus the captured
gradients and the stashed versions of CostModel's stage memory. What the
planner leaves out here is the embedding's and the head's saved tensors (its
workspace term covers them apart), so measured/predicted sits a little above
1 on the first and the last stage. The last line prints measured/predicted.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

SCHEDULES = {"1f1b": 1, "zb-h1": 1, "zb-h2": 1, "zbv": 2, "2bw": 1, "pipedream": 1}


def _config(p: int, name: str, m: int, args):
    from tessel.config import build_config
    raw = {"model": {"vocab_size": 64, "n_layer": args.layers, "n_head": 4, "d_model": args.d_model,
                     "max_seq_len": args.seq},
           "parallel": {"pp": p, "schedule": name, "virtual_stages": SCHEDULES[name], "micro_batches": m,
                        "allow_async": name in ("2bw", "pipedream")},
           "train": {"global_batch": args.batch, "seq_len": args.seq, "grad_clip": 0.0},
           "data": {"source": "synthetic"}}
    return build_config(raw)


def _measure(args) -> dict:
    from tessel.apply import parallelize
    from tessel.mesh import make_mesh
    from tessel.models.gpt import GPT
    p = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (args.batch, args.seq), generator=g)
    out = {}
    for name in args.schedules:
        cfg = _config(p, name, args.micro_batches, args)
        torch.manual_seed(0)
        runner = parallelize(GPT(cfg.model), make_mesh({"pp": p}), cfg)
        runner.timeline = False
        peaks, stash = [], 0.0
        for _ in range(args.steps):
            runner.forward_backward(x, x)
            for q in runner.parameters():
                q.grad = None
            metrics = runner.extra_metrics()
            peaks.append(metrics["act_peak_mb_rank"])
            stash = metrics.get("stash_mb", 0.0)
        out[name] = (max(peaks), stash)
    return out


def _predicted(name: str, p: int, m: int, args) -> list[tuple[float, float]]:
    """Per rank: (held activations + captured gradients, stashed versions) in MiB, from the planner."""
    from tessel.planner.cluster import get_cluster
    from tessel.planner.cost import CostModel
    from tessel.planner.layout import config_layout
    from tessel.planner.memory import layer_activation_bytes
    from tessel.planner.model_spec import from_config
    from tessel.planner.schedule import held_micro_batches
    cfg = _config(p, name, m, args)
    spec = from_config(cfg.model, args.seq, args.batch)
    lay = config_layout(cfg)
    cm = CostModel(spec, get_cluster("a100", p), "fp32")
    v = SCHEDULES[name]
    block = layer_activation_bytes(spec, lay.micro_batch * args.seq, 1, False, "fp32")
    blocks_per_chunk = args.layers / (p * v)
    rows = []
    for r in range(p):
        mem = cm.stage_memory(lay, r)
        held = held_micro_batches(name, p, m, r, v)[0]
        saved = held * blocks_per_chunk * block + mem.get("captured_grads", 0.0)
        rows.append((saved / 2**20, mem.get("weight_versions", 0.0) / 2**20))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    args = ap.parse_args()
    from tessel.spawn import spawn
    measured = spawn(_measure, args.pp, args, timeout=3600)
    p, m = args.pp, args.micro_batches
    print(f"pp={p} micro-batches={m} batch={args.batch}x{args.seq} d_model={args.d_model} layers={args.layers} "
          f"vocab=64 fp32; peak over {args.steps} steps")
    print(f"{'schedule':<10} {'rank':>4} {'held MiB':>9} {'planner':>8} {'meas/plan':>9} {'stash MiB':>10} {'planner':>8}")
    ratios = []
    for name in args.schedules:
        predicted = _predicted(name, p, m, args)
        for r in range(p):
            held, stash = measured[r][name]
            plan_held, plan_stash = predicted[r]
            ratio = held / plan_held
            print(f"{name:<10} {r:>4} {held:9.2f} {plan_held:8.2f} {ratio:9.3f} {stash:10.2f} {plan_stash:8.2f}")
            ratios.append(ratio)
    print(f"held measured/planner over schedules and ranks: median {statistics.median(ratios):.3f}, "
          f"range {min(ratios):.3f}-{max(ratios):.3f}")


if __name__ == "__main__":
    main()
