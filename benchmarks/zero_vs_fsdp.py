"""tessel ZeRO-3 vs PyTorch FSDP2 (fully_shard) on the same GPT at dp=2.

Both shard every transformer block as one unit plus the rest of the model as
the root, keep fp32 parameters, gradients and AdamW state, and train on the
same batches from the same initial weights (the losses are printed to show it).
With --param-dtype bf16 both store, all-gather and compute with bf16 parameters
and reduce gradients in --reduce-dtype, keeping fp32 masters and AdamW state:
tessel's param_dtype/reduce_dtype and FSDP2's MixedPrecisionPolicy.

Step time: the two implementations alternate step by step so that load on a
shared machine hits both alike. The ratio is the median over steps of the
paired ratios (tessel step i / FSDP2 step i, adjacent in time), the median of
the ranks; the medians of each side are printed too.

Peak memory per rank, over one steady-state training step (forward, backward,
optimizer step, zero_grad):
- CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats.
- CPU: the bytes live when the step starts plus the highest rise during it.
  The first is the sum of the storages of every live tensor (found with gc,
  each storage once, a DTensor by its local shard); nothing else is live
  between steps (no autograd graph). The second is measured by the allocator:
  the profiler (profile_memory=True) reports every CPU allocation and free with
  the running total, and the rise is that total's maximum. Frees of memory
  allocated before the step would be missed (the profiler warns); neither
  implementation frees such memory in a steady step.

Prints medians, then the ratios tessel/FSDP2 as the last line.
    PYTHONPATH=$PWD python benchmarks/zero_vs_fsdp.py [--d-model 256 --layers 4] [--param-dtype bf16 --reduce-dtype fp32]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
import torch.distributed as dist

from tessel.config import ModelConfig
from tessel.mesh import make_mesh
from tessel.models.gpt import GPT, cross_entropy
from tessel.parallel.zero.zero_parallel import zero_parallel
from tessel.spawn import spawn
from tessel.parallel.weight_decay import param_groups

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _dtypes(args) -> tuple[torch.dtype, torch.dtype]:
    return DTYPES[args.param_dtype], DTYPES[args.reduce_dtype or args.param_dtype]


def build_tessel(cfg: ModelConfig, args):
    torch.manual_seed(0)
    model = GPT(cfg)
    param_dtype, reduce_dtype = _dtypes(args)
    groups = param_groups(model.parameters(), HYPER["weight_decay"])
    wrapped, opt = zero_parallel(model, make_mesh({"dp": dist.get_world_size()}), 3, groups, **HYPER,
                                 param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    return wrapped, opt


def build_fsdp(cfg: ModelConfig, args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    model = GPT(cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    param_dtype, reduce_dtype = _dtypes(args)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": HYPER["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=HYPER["lr"], betas=HYPER["betas"])
    return model, opt


def batch(step: int, args, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(model, opt, x, y) -> float:
    loss = cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def live_tensor_bytes() -> int:
    from torch.distributed.tensor import DTensor
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor) or obj.device.type != "cpu":
            continue
        t = obj._local_tensor if isinstance(obj, DTensor) else obj
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def peak_step_bytes(model, opt, x, y) -> tuple[int, int]:
    """(bytes live at the start of a step, the highest rise during it)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        train_step(model, opt, x, y)
        return start, torch.cuda.max_memory_allocated() - start
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile
    start = live_tensor_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train_step(model, opt, x, y)
    rise = 0
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            rise = max(rise, e.extra_fields.total_allocated)
        stack.extend(e.children)
    return start, rise


def measure_memory(build, cfg, args, device) -> tuple[tuple[int, int], list[float]]:
    model, opt = build(cfg, args)
    losses = [train_step(model, opt, *batch(s, args, cfg.vocab_size, device)) for s in range(2)]
    peak = peak_step_bytes(model, opt, *batch(2, args, cfg.vocab_size, device))
    del model, opt
    gc.collect()
    return peak, losses


def rank_main(args) -> dict:
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(vocab_size=256, n_layer=args.layers, n_head=4, d_model=args.d_model,
                      max_seq_len=args.seq)
    device = torch.device("cuda", dist.get_rank()) if torch.cuda.is_available() else torch.device("cpu")
    mem_t, losses_t = measure_memory(build_tessel, cfg, args, device)
    mem_f, losses_f = measure_memory(build_fsdp, cfg, args, device)
    runs = {"tessel": build_tessel(cfg, args), "fsdp2": build_fsdp(cfg, args)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for step in range(args.warmup + args.steps):
        x, y = batch(step, args, cfg.vocab_size, device)
        for name, (model, opt) in (runs.items() if step % 2 else reversed(runs.items())):
            dist.barrier()
            t0 = time.perf_counter()
            train_step(model, opt, x, y)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    return {"mem": {"tessel": mem_t, "fsdp2": mem_f}, "losses": {"tessel": losses_t, "fsdp2": losses_f},
            "time": {k: statistics.median(v) for k, v in times.items()},
            "paired": statistics.median(a / b for a, b in zip(times["tessel"], times["fsdp2"])),
            "params": sum(p.numel() for p in GPT(cfg).parameters())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--param-dtype", choices=DTYPES, default="fp32", help="parameters gathered and computed in")
    ap.add_argument("--reduce-dtype", choices=DTYPES, default=None, help="gradients reduced in (default: param)")
    args = ap.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    results = spawn(rank_main, 2, args, backend=backend, timeout=1800, threads=args.threads)
    r0 = results[0]
    print(f"GPT d_model={args.d_model} layers={args.layers} params={r0['params']:,} seq={args.seq} "
          f"batch/rank={args.batch} dp=2 param={args.param_dtype} reduce={args.reduce_dtype or args.param_dtype} "
          f"(fp32 masters) backend={backend}")
    print(f"first losses  tessel {r0['losses']['tessel']}  fsdp2 {r0['losses']['fsdp2']}")
    time_t = statistics.median(r["time"]["tessel"] for r in results)
    time_f = statistics.median(r["time"]["fsdp2"] for r in results)
    mem_t = max(sum(r["mem"]["tessel"]) for r in results)
    mem_f = max(sum(r["mem"]["fsdp2"]) for r in results)
    paired = statistics.median(r["paired"] for r in results)
    print(f"step time (median)  tessel {time_t * 1e3:.1f} ms  fsdp2 {time_f * 1e3:.1f} ms  "
          f"(ratio of medians {time_t / time_f:.3f})")
    for name in ("tessel", "fsdp2"):
        start, rise = r0["mem"][name]
        print(f"peak memory, rank 0, {name}: {(start + rise) / 2**20:.2f} MiB "
              f"= {start / 2**20:.2f} live at step start + {rise / 2**20:.2f} rise in the step")
    print(f"peak memory / rank (max over ranks)  tessel {mem_t / 2**20:.2f} MiB  fsdp2 {mem_f / 2**20:.2f} MiB")
    print(f"ratio tessel/fsdp2: step time {paired:.3f} (paired median)  peak memory {mem_t / mem_f:.3f}")


if __name__ == "__main__":
    main()
