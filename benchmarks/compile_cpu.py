"""What compiled blocks and the fused loss buy on this CPU: the loss's peak memory, then step times.

    PYTHONPATH=. python benchmarks/compile_cpu.py           # a couple of minutes on 2 cores (inductor builds with gcc)
    PYTHONPATH=. python benchmarks/compile_cpu.py --smoke   # toy shapes, the aot_eager backend: seconds

Three measurements, each through the recipe's knobs (train.compile = "blocks", train.fused_loss) on a
one-rank process group, as `tessel train` runs them:

1. The fused loss's peak memory against the unfused one, at vocabulary 50304 and d_model 768 (GPT-2
   124M's head) over --loss-tokens tokens (one sequence), fp32 as tessel trains on a CPU. Each side runs
   in its own process; the model is one block, its gradients are allocated (zeros) before the baseline,
   so what one forward and backward adds is the loss's (and one small block's) transient memory. Two
   measures: torch's own record of the bytes its tensors hold at the peak (tessel.observe.memory.
   allocated_peak: the profiler's allocation events, the CPU twin of CUDA's max_memory_allocated, which
   is what bounds a GPU's batch), the target's measure (0.25 or less); and the process's resident
   high-water mark (getrusage's ru_maxrss) over its resident set before, which also counts what glibc
   keeps of freed blocks (its dynamic mmap threshold moves freed large blocks onto the heap).
2. Compiled / eager step time on GPT-2 124M's shape (12 layers, d 768, vocabulary 50304, tied) at a short
   sequence: tessel's Trainer step, both trainers built in one process from one seed, steps interleaved
   ABBA after a warm-up (the compile); the ratio is the median of each step's compiled/eager pair (a
   shared machine's load drifts slower than a pair of steps), with the pairs' range.
3. Last, the same on the demo model (recipes/demo.toml's: 4 layers, d 128, vocabulary 256, sequence 128)
   at one rank's share of its batch (8 of 16 sequences: the demo runs dp = 2). Target: 0.85 or less.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile

import torch
from one_rank import one_rank_config  # beside this file (sys.path[0] when run as a script)

GPT2 = dict(vocab_size=50304, n_layer=12, n_head=12, d_model=768, tie_embeddings=True)
DEMO = dict(vocab_size=256, n_layer=4, n_head=4, d_model=128, tie_embeddings=True)


def _config(fields: dict, seq: int, batch: int, compiled: bool, backend: str):
    return one_rank_config(fields, seq, batch, tempfile.mkdtemp(prefix="tessel-compile-cpu-"), "fp32", compiled,
                           backend)


def _runner(cfg):
    from tessel.apply import parallelize
    from tessel.mesh import make_mesh
    from tessel.models.build import build_model
    device = torch.device("cpu")
    mesh = make_mesh(cfg.parallel.axis_sizes, device=device)
    torch.manual_seed(cfg.train.seed)
    return mesh, parallelize(build_model(cfg.model), mesh, cfg)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def loss_peak(fused: bool, tokens: int, fields: dict, backend: str) -> tuple[int, int]:
    """(bytes torch's tensors hold at the peak of one forward and backward over those before it, bytes it adds
    to this process's resident high-water mark): a fresh rank, so both are its own."""
    from tessel.observe.memory import allocated_peak
    cfg = _config({**fields, "n_layer": 1}, tokens, 1, fused, backend)
    _, runner = _runner(cfg)
    for p in runner.parameters():
        p.grad = torch.zeros_like(p)  # gradients exist before the baseline: both sides keep the same ones
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (1, tokens), generator=g)
    y = torch.randint(0, cfg.model.vocab_size, (1, tokens), generator=g)
    base = _resident_bytes()
    allocated = allocated_peak(lambda: runner.forward_backward(x, y), torch.device("cpu"))
    return allocated, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base


def step_times(fields: dict, seq: int, batch: int, steps: int, warmup: int, backend: str) -> tuple[list, list]:
    """(eager, compiled) seconds of interleaved Trainer steps (ABBA) after `warmup` each."""
    import time

    from tessel.train.trainer import Trainer
    trainers = []
    for compiled in (False, True):
        cfg = _config(fields, seq, batch, compiled, backend)
        mesh, runner = _runner(cfg)
        trainers.append(Trainer(cfg, mesh, runner, 0))
    times: tuple[list, list] = ([], [])
    for i in range(warmup + steps):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for side in order:
            t0 = time.perf_counter()
            trainers[side].train_step(i)
            if i >= warmup:
                times[side].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="toy shapes, aot_eager, 2 steps: seconds")
    ap.add_argument("--loss-tokens", type=int, default=None, help="tokens of the loss measurement (2048; smoke 256)")
    ap.add_argument("--seq", type=int, default=64, help="GPT-2 124M's sequence here (short: a CPU)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps a side, the demo twice as many (6; smoke 2)")
    ap.add_argument("--threads", type=int, default=1, help="threads of the rank (1: as tessel runs each CPU rank)")
    ap.add_argument("--backend", default=None, help="torch.compile backend (inductor; smoke aot_eager)")
    args = ap.parse_args()
    smoke = args.smoke
    backend = args.backend or ("aot_eager" if smoke else "inductor")
    tokens = args.loss_tokens or (256 if smoke else 2048)
    steps = args.steps or (2 if smoke else 6)
    gpt2 = dict(GPT2, n_layer=2, d_model=64, n_head=4, vocab_size=50304) if smoke else GPT2
    from tessel.spawn import spawn

    def one_rank(fn, *a):
        return spawn(fn, 1, *a, timeout=1800, backend="gloo", threads=args.threads)[0]
    plain, plain_rss = one_rank(loss_peak, False, tokens, gpt2, backend)
    fused, fused_rss = one_rank(loss_peak, True, tokens, gpt2, backend)
    print(f"loss over {tokens} tokens x vocabulary {gpt2['vocab_size']} (d {gpt2['d_model']}, fp32): peak memory "
          f"added by forward+backward, tensors allocated: unfused {plain / 2**20:.1f} MiB, fused "
          f"{fused / 2**20:.1f} MiB; resident set: unfused {plain_rss / 2**20:.1f} MiB, fused "
          f"{fused_rss / 2**20:.1f} MiB (ratio {fused_rss / plain_rss:.3f})")
    rows = [(f"GPT-2 124M shape{' (smoke: 2 layers, d 64)' if smoke else ''}", gpt2, 16 if smoke else args.seq, 2),
            ("demo model (recipes/demo.toml, one rank's 8 sequences)", DEMO, 32 if smoke else 128, 2 if smoke else 8)]
    ratios = []
    for (name, fields, seq, batch), n in zip(rows, (steps, 2 * steps)):  # the demo's steps are cheap: twice as many
        eager, compiled = one_rank(step_times, fields, seq, batch, n, 1 if smoke else 2, backend)
        # each step beside its neighbour on the other side: the pairs cancel the load's slow drift on a
        # shared machine, which the two sides' separate medians do not
        pairs = sorted(c / e for e, c in zip(eager, compiled))
        ratios.append((name, statistics.median(pairs), pairs[0], pairs[-1]))
        print(f"{name}, batch {batch}x{seq}, {backend}, {len(eager)} interleaved steps a side: "
              f"median eager {statistics.median(eager) * 1e3:.1f} ms, "
              f"compiled {statistics.median(compiled) * 1e3:.1f} ms")
    print(f"ratio fused/unfused loss peak memory (tensors allocated): {fused / plain:.3f} (target 0.25 or less)")
    for name, r, lo, hi in ratios:
        print(f"ratio compiled/eager step time, {name}: {r:.3f} (median of step pairs; {lo:.2f}-{hi:.2f})"
              + (" (target 0.85 or less)" if "demo" in name else ""))


if __name__ == "__main__":
    main()
