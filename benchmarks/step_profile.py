"""Where a training step's time goes on one GPU: tessel's compiled step against a compiled plain loop, under
torch.profiler, to explain gpu_suite.py's gap between them (issue 30's target: tessel compiled at least as fast).

    PYTHONPATH=. python benchmarks/step_profile.py                 # GPT-2 124M, 16 x 1024, on a GPU
    PYTHONPATH=. python benchmarks/step_profile.py --model llama-1.3b
    PYTHONPATH=. python benchmarks/step_profile.py --smoke         # the CPU, toy shapes

For each run: wall ms per step (4 steps back to back, drained at the ends), the device's busy ms per step (the
sum of its kernels' times; on the CPU the operators' self time), and the heaviest kernels by total time. A step
whose wall time exceeds its kernels' time waits on the host (launches, Python, synchronizations); one whose
kernels take longer does more or slower device work. Ratios last.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_suite import SMOKE, SUITE, plain_step, tessel_step  # noqa: E402
from one_rank import one_rank_config  # noqa: E402

STEPS = 4


def profile(step, device, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile as torch_profile
    for _ in range(3):  # warm-up, the compile among it
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
    sync()
    wall = (time.perf_counter() - t0) / STEPS
    with torch_profile(activities=activities) as prof:
        for _ in range(STEPS):
            step()
        sync()
    events = prof.key_averages()
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    rows = sorted(events, key=lambda e: getattr(e, attr, 0), reverse=True)
    busy = sum(getattr(e, attr, 0) for e in events if device.type != "cuda" or e.device_type.name == "CUDA")
    return {"wall_ms": wall * 1e3, "busy_ms": busy / 1e3 / STEPS,
            "top": [(e.key[:90], getattr(e, attr, 0) / 1e3 / STEPS, e.count // STEPS) for e in rows[:top]]}


def _rank(args) -> dict:
    from tessel.runtime import pick_device
    device = pick_device("cpu" if args.smoke else "auto")
    fields, seq, batch = (SMOKE if args.smoke else SUITE)[args.model]
    out = {}
    for name in ("tessel compiled", "compiled plain loop"):
        cfg = one_rank_config(fields, seq, batch, tempfile.mkdtemp(), "bf16", True, args.backend)
        step = tessel_step(cfg, device) if name == "tessel compiled" else plain_step(cfg, device, args.backend)
        try:
            out[name] = profile(step, device, args.top)
        except Exception as err:
            out[name] = {"error": f"{type(err).__name__}: {err}"[:200]}
        step = None
        torch._dynamo.reset()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2-124m", choices=sorted(SUITE))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    args.backend = "aot_eager" if args.smoke else "inductor"
    from tessel.spawn import spawn
    backend = "nccl" if torch.cuda.is_available() and not args.smoke else "gloo"
    result = spawn(_rank, 1, args, timeout=900, backend=backend, threads=1)[0]
    for name, r in result.items():
        if "error" in r:
            print(f"{name}: {r['error']}")
            continue
        print(f"== {name}: wall {r['wall_ms']:.1f} ms/step, device busy {r['busy_ms']:.1f} ms/step")
        for key, ms, count in r["top"]:
            print(f"   {ms:8.2f} ms  x{count:<4d} {key}")
    if all("wall_ms" in r for r in result.values()):
        a, b = result["tessel compiled"], result["compiled plain loop"]
        print(f"ratio busy tessel / plain: {a['busy_ms'] / b['busy_ms']:.3f}")
        print(f"ratio wall tessel / plain: {a['wall_ms'] / b['wall_ms']:.3f}")


if __name__ == "__main__":
    main()
