"""Tensor parallelism at tp=2: tessel's Megatron layers vs PyTorch DTensor TP.

Both sides train the same GPT (same seed, same weights, same batches) on the
same two ranks. PyTorch's side is `parallelize_module` with ColwiseParallel for
q, k, v, gate and up, RowwiseParallel for the output and down projections, a
row-wise (vocab-parallel) embedding, a column-wise head whose logits stay
sharded, and `loss_parallel` for the cross-entropy: the same split as tessel's
plan. One step is forward + loss + backward + AdamW. Steps of the two sides are
interleaved so that load changes on the machine hit both alike; we print the
median of each and the ratio tessel / DTensor last.

    PYTHONPATH=$PWD python benchmarks/tp_vs_dtensor.py [--steps 30] [--warmup 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessel.config import build_config
from tessel.mesh import make_mesh
from tessel.models.gpt import GPT
from tessel.apply import parallelize
from tessel.spawn import spawn


def _config(args):
    raw = {"model": {"vocab_size": args.vocab, "n_layer": args.layers, "n_head": args.heads,
                     "d_model": args.d_model, "max_seq_len": args.seq},
           "parallel": {"tp": 2, "sequence_parallel": args.sp},
           "train": {"global_batch": args.batch, "seq_len": args.seq, "warmup_steps": 0, "sample_tokens": 0},
           "data": {"source": "synthetic"}}
    return build_config(raw)


def _dtensor_model(cfg, sp: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    seq = Shard(1) if sp else Replicate()  # activations between regions: (B, T, C)
    plan = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "layers.*.attn.wq": ColwiseParallel(), "layers.*.attn.wk": ColwiseParallel(),
        "layers.*.attn.wv": ColwiseParallel(), "layers.*.attn.wo": RowwiseParallel(output_layouts=seq),
        "layers.*.mlp.w_gate": ColwiseParallel(), "layers.*.mlp.w_up": ColwiseParallel(),
        "layers.*.mlp.w_down": RowwiseParallel(output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:  # torchtitan's layout: norms on sequence shards, gathered at the region's entry
        plan.update({"layers.*.attn_norm": SequenceParallel(), "layers.*.mlp_norm": SequenceParallel(),
                     "norm": SequenceParallel(),
                     "layers.*.attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                         desired_input_layouts=(Replicate(), None, None)),
                     "layers.*.mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                                        desired_input_layouts=(Replicate(),))})
    return parallelize_module(model, mesh, plan)


def _step_dtensor(model, opt, x, y):
    from torch.distributed.tensor.parallel import loss_parallel
    logits = model(x)  # DTensor (B, T, V) sharded on V
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
    t_bwd = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item(), t_bwd


def _step_tessel(runner, opt, x, y):
    loss = runner.forward_backward(x, y)
    t_bwd = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return loss.item(), t_bwd


def _bench(args) -> dict:
    cfg = _config(args)
    mesh = make_mesh({"tp": 2})
    torch.manual_seed(cfg.train.seed)
    runner = parallelize(GPT(cfg.model), mesh, cfg)
    dt_model = _dtensor_model(cfg, args.sp)
    opt_t = torch.optim.AdamW(runner.parameters(), lr=1e-3)
    opt_d = torch.optim.AdamW(dt_model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq), generator=g)
    y = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq), generator=g)
    times = {"tessel": [], "dtensor": [], "tessel fwd+bwd": [], "dtensor fwd+bwd": []}
    first = {}
    for i in range(args.warmup + args.steps):
        for name in ("tessel", "dtensor") if i % 2 == 0 else ("dtensor", "tessel"):
            dist.barrier()
            t0 = time.perf_counter()
            loss, t_bwd = _step_tessel(runner, opt_t, x, y) if name == "tessel" else \
                _step_dtensor(dt_model, opt_d, x, y)
            dt = time.perf_counter() - t0
            first.setdefault(name, loss)
            if i >= args.warmup:
                times[name].append(dt)
                times[f"{name} fwd+bwd"].append(t_bwd - t0)
    return {"times": times, "first_loss": first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--sp", action="store_true", help="sequence parallelism on both sides")
    ap.add_argument("--threads", type=int, default=1, help="threads per rank")
    args = ap.parse_args()
    results = spawn(_bench, 2, args, timeout=1800, threads=args.threads)
    r0 = results[0]
    print(f"GPT d_model={args.d_model} layers={args.layers} heads={args.heads} vocab={args.vocab} "
          f"batch={args.batch}x{args.seq}, tp=2{' + sequence parallel' if args.sp else ''}, "
          f"{args.threads} thread(s)/rank, gloo on CPU; {args.steps} timed steps after {args.warmup} warm-up")
    print(f"first-step loss: tessel {r0['first_loss']['tessel']:.6f}  dtensor {r0['first_loss']['dtensor']:.6f}")
    # a step lasts as long as its slowest rank
    med = {k: statistics.median(max(r["times"][k][i] for r in results) for i in range(args.steps))
           for k in r0["times"]}
    for k in ("tessel fwd+bwd", "dtensor fwd+bwd"):
        print(f"{k:16s} median {med[k] * 1e3:8.2f} ms")
    for k in ("tessel", "dtensor"):
        print(f"{k:16s} median {med[k] * 1e3:8.2f} ms per step with AdamW "
              f"({args.batch * args.seq / med[k]:,.0f} tokens/s)")
    print(f"ratio tessel/dtensor: {med['tessel'] / med['dtensor']:.3f}")


if __name__ == "__main__":
    main()
