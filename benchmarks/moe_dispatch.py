"""MoE dispatch cost and MoE-vs-dense throughput, on `--world` ranks.

1. One MoE layer's all-to-all dispatch + combine (AllToAllDispatcher: sort
   and gather of the kept rows, count exchange, variable-split
   all_to_all_single both ways, regrouping by local expert, gate-weighted
   scatter back to token order),
   against the floor: two bare all_to_all_single calls moving the same rows
   with the same split sizes (PyTorch's collective alone).
2. Training tokens/s of an MoE GPT (experts sharded over ep = world) against
   a dense GPT with the same active parameters per token (same d_model and
   SwiGLU width, top-1 routing; data parallel over the same ranks).

    PYTHONPATH=. python benchmarks/moe_dispatch.py --world 2
    PYTHONPATH=. python benchmarks/moe_dispatch.py --world 2 --dispatch-only --keep-freed-memory

Medians over timed iterations after warm-up; ratios (tessel / peer) last.

--keep-freed-memory: glibc keeps the buffers a rank frees (its mmap and trim thresholds raised) instead of
returning each 4 MiB block to the kernel, as the CUDA caching allocator keeps them on a GPU; by default every
fresh buffer of the dispatch (the floor's are allocated once) page-faults on the CPU, which costs more than
the copies themselves.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from tessel.config import ModelConfig, build_config
from tessel.mesh import make_mesh
from tessel.models.gpt import GPT
from tessel.models.moe import Router
from tessel.parallel.expert.expert_parallel import AllToAllDispatcher
from tessel.apply import parallelize
from tessel.spawn import spawn
from tessel.train.trainer import Trainer


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fns, iters: int, device: torch.device) -> list[float]:
    """Median ms of each fn; the fns take turns, so a noisy machine weighs on all of them alike."""
    for fn in fns:
        for _ in range(3):
            fn()
    times = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times):
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            ts.append((time.perf_counter() - t0) * 1e3)
    # every rank waits for the slowest: report the max over ranks of each median
    med = torch.tensor([statistics.median(ts) for ts in times], device=device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return med.tolist()


def bench_dispatch(tokens: int, d_model: int, n_experts: int, iters: int) -> dict:
    world, device = dist.get_world_size(), _device()
    mesh = make_mesh({"ep": world}, device=device)
    cfg = ModelConfig(d_model=d_model, n_head=4, n_experts=n_experts, capacity_factor=1.25)
    torch.manual_seed(dist.get_rank())
    router = Router(cfg).to(device)
    x = torch.randn(tokens, d_model, device=device)
    with torch.no_grad():
        r = router(x)
    rows, expert = x.index_select(0, r.token), r.expert
    disp = AllToAllDispatcher(n_experts, mesh.group("ep"), world)

    def tessel_round_trip():
        grouped, _, state = disp.dispatch(x, r)  # the experts would run here (not timed)
        disp.combine(grouped, state)

    # the floor: the same rows with the same splits, already sorted, buffers ready
    counts = torch.bincount(expert, minlength=n_experts)
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=mesh.group("ep"))
    send_splits = counts.view(world, -1).sum(1).tolist()
    recv_splits = recv.view(world, -1).sum(1).tolist()
    sorted_rows = rows[torch.argsort(expert, stable=True)].contiguous()
    arrived = rows.new_empty(sum(recv_splits), d_model)
    back = torch.empty_like(sorted_rows)

    def floor_round_trip():
        dist.all_to_all_single(arrived, sorted_rows, recv_splits, send_splits, group=mesh.group("ep"))
        dist.all_to_all_single(back, arrived, send_splits, recv_splits, group=mesh.group("ep"))

    with torch.no_grad():
        t_tessel, t_floor = _median_ms([tessel_round_trip, floor_round_trip], iters, device)
    return {"tessel_ms": t_tessel, "floor_ms": t_floor, "rows": rows.size(0),
            "mb_each_way": rows.numel() * rows.element_size() / 2**20}


def _trainer(overrides: list[str]) -> Trainer:
    cfg = build_config({}, overrides)
    p = cfg.parallel
    device = _device()
    mesh = make_mesh({"pp": p.pp, "dp": p.dp, "ep": p.ep, "tp": p.tp}, device=device)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model).to(device)
    return Trainer(cfg, mesh, parallelize(model, mesh, cfg), dist.get_rank())


def bench_models(d_model: int, n_experts: int, steps: int, batch: int, seq: int) -> dict:
    world = dist.get_world_size()
    common = [f"model.d_model={d_model}", "model.n_layer=4", "model.n_head=4", f"model.max_seq_len={seq}",
              f"train.steps={steps}", f"train.global_batch={batch}", f"train.seq_len={seq}", "train.warmup_steps=1",
              "train.eval_every=0", "train.sample_tokens=0", "data.source=\"synthetic\"",
              "logging.tensorboard=false", "logging.progress=false", "logging.peak_flops=1e12",
              "logging.out_dir=\"/tmp/tessel-bench-moe\"", f"runtime.device=\"{_device().type}\""]
    moe = _trainer([*common, f"model.n_experts={n_experts}", "model.moe_every=1", "model.capacity_factor=1.25",
                    f"parallel.ep={world}"])
    dense = _trainer([*common, f"parallel.dp={world}"])
    tps: dict[str, list[float]] = {"moe_tps": [], "dense_tps": []}
    for step in range(steps):  # alternate, so that load from elsewhere hits both alike
        for key, trainer in (("moe_tps", moe), ("dense_tps", dense)):
            tps[key].append(trainer.train_step(step)["tokens_per_s"])
    return {key: statistics.median(v[3:]) for key, v in tps.items()}  # first steps: warm-up


def _rank(args) -> dict:
    out = bench_dispatch(args.tokens, args.d_model, args.experts, args.iters)
    if not args.dispatch_only:
        out.update(bench_models(args.model_d, args.experts, args.steps, args.batch, args.seq))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank entering the MoE layer")
    ap.add_argument("--d-model", dest="d_model", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--model-d", dest="model_d", type=int, default=128, help="d_model of the GPTs")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dispatch-only", dest="dispatch_only", action="store_true", help="skip the training half")
    ap.add_argument("--keep-freed-memory", dest="keep_freed", action="store_true",
                    help="glibc keeps freed buffers, as a GPU's caching allocator does (module docstring)")
    args = ap.parse_args()
    if args.keep_freed:  # read by glibc when each rank's process starts
        os.environ["GLIBC_TUNABLES"] = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"
    r = spawn(_rank, args.world, args, timeout=1200, backend=args.backend)[0]
    print(f"world {args.world} ({args.backend}), {args.experts} experts, top-1, capacity factor 1.25")
    print(f"dispatch+combine, {r['rows']} rows x {args.d_model} fp32 ({r['mb_each_way']:.2f} MiB/rank each way)")
    print(f"  tessel AllToAllDispatcher       median {r['tessel_ms']:8.3f} ms")
    print(f"  all_to_all_single x2 (floor)    median {r['floor_ms']:8.3f} ms")
    if args.dispatch_only:
        print(f"ratio dispatch/all_to_all_single (tessel/floor): {r['tessel_ms'] / r['floor_ms']:.3f}")
        return
    print(f"training, d_model {args.model_d}, 4 layers, batch {args.batch}x{args.seq}")
    print(f"  MoE GPT (ep={args.world})             median {r['moe_tps']:10,.0f} tokens/s")
    print(f"  dense GPT, same active params (dp={args.world}) median {r['dense_tps']:10,.0f} tokens/s")
    print(f"ratio MoE/dense tokens/s: {r['moe_tps'] / r['dense_tps']:.3f}")
    print(f"ratio dispatch/all_to_all_single (tessel/floor): {r['tessel_ms'] / r['floor_ms']:.3f}")


if __name__ == "__main__":
    main()
