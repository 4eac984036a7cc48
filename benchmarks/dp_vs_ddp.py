"""tessel data parallelism vs torch DistributedDataParallel, same model and batch, 2 ranks.

Both start from the same weights and see the same batches. Steps alternate
between the two in rounds, so drift in machine load hits both alike. Prints
per-step medians, then the ratio tessel/DDP as the last line.

    python benchmarks/dp_vs_ddp.py [--steps 30] [--d-model 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tessel.config import ModelConfig
from tessel.mesh import make_mesh
from tessel.models.gpt import GPT, cross_entropy
from tessel.parallel.data.data_parallel import data_parallel
from tessel.spawn import spawn


def _timed_step(model, opt, x, y) -> tuple[float, float]:
    dist.barrier()
    start = time.perf_counter()
    loss = cross_entropy(model(x), y)
    loss.backward()  # both implementations finish their reduction inside backward
    opt.step()
    opt.zero_grad(set_to_none=False)
    return time.perf_counter() - start, loss.item()


def _bench(args) -> dict:
    cfg = ModelConfig(vocab_size=256, n_layer=args.layers, n_head=4, d_model=args.d_model, max_seq_len=args.seq)
    torch.manual_seed(0)
    base = GPT(cfg)
    torch.manual_seed(0)
    twin = GPT(cfg)
    mesh = make_mesh({"dp": dist.get_world_size()})
    ours = data_parallel(base, mesh, bucket_mb=args.bucket_mb)
    peer = DDP(twin, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
    opts = {"tessel": torch.optim.AdamW(ours.parameters(), lr=1e-3),
            "ddp": torch.optim.AdamW(peer.parameters(), lr=1e-3)}
    models = {"tessel": ours, "ddp": peer}
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    times = {k: [] for k in models}
    losses = {k: [] for k in models}
    rounds = (args.warmup + args.steps) // args.per_round
    for r in range(rounds):
        for name in ("tessel", "ddp") if r % 2 == 0 else ("ddp", "tessel"):
            for i in range(args.per_round):
                g = torch.Generator().manual_seed(1000 * r + i + 7 * dist.get_rank())
                x = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
                t, loss = _timed_step(models[name], opts[name], x[:, :-1], x[:, 1:])
                times[name].append(t)
                losses[name].append(loss)
    del gen
    return {"times": times, "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per implementation")
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--per-round", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    res = spawn(_bench, args.world, args, timeout=1800)[0]
    skip = args.warmup
    med = {k: statistics.median(v[skip:]) for k, v in res["times"].items()}
    n = len(res["times"]["tessel"]) - skip
    drift = max(abs(a - b) for a, b in zip(res["losses"]["tessel"], res["losses"]["ddp"]))
    print(f"model d={args.d_model} L={args.layers} seq={args.seq} batch/rank={args.batch} "
          f"world={args.world} bucket={args.bucket_mb}MB; {n} timed steps each after {skip} warm-up")
    print(f"{'impl':<8}{'median step (ms)':>18}{'p10':>10}{'p90':>10}")
    for k, v in res["times"].items():
        q = statistics.quantiles(v[skip:], n=10)
        print(f"{k:<8}{1e3 * med[k]:>18.1f}{1e3 * q[0]:>10.1f}{1e3 * q[-1]:>10.1f}")
    print(f"max |loss tessel - loss DDP| over all steps: {drift:.2e} (same weights, same batches)")
    print(f"ratio tessel/DDP (median step time): {med['tessel'] / med['ddp']:.3f}")


if __name__ == "__main__":
    main()
