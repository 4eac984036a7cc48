"""train.precision = "fp8" against "bf16" on one GPU: tokens/s, the loss gap after N steps, and the planner's
predicted ratio beside the measured one (issue 33).

    PYTHONPATH=. python benchmarks/fp8.py            # one H100/H200: the Llama-style 1.3B, 200 steps each, ~3 min
    PYTHONPATH=. python benchmarks/fp8.py --smoke    # the CPU, a toy model, emulated float8, seconds

The model is gpu_suite.py's Llama-style 1.3B (tessel's reference GPT: 24 layers, d 2048, 16 heads sharing 8 kv
heads, SwiGLU 5504, vocabulary 50304), batch 4 x 2048, trained by tessel's Trainer with compiled blocks and the
fused loss, on the stdlib corpus (bytes of Python's standard library, so the loss falls), lr 3e-4 after 20
warm-up steps. The same seed, weights and batches for both precisions. Step time: the median over blocks of 4
steps after 20 warm-up steps (the compile among them), each block drained at its ends only; every step's loss
is read one step late, as the trainer does. The loss gap: the mean of the last 20 steps' losses, fp8 over
bf16, minus 1. The planner's ratio: tessel.planner's step time for the same run in fp8 and bf16 on the GPU's
preset. Ratios last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_suite import SMOKE, SUITE, preset_for  # noqa: E402
from one_rank import one_rank_config  # noqa: E402

BLOCK, WARMUP, TAIL = 4, 20, 20


def train_curve(precision: str, args, device) -> dict:
    """Losses of every step and the median step time of one precision's run."""
    from tessel.apply import parallelize
    from tessel.mesh import make_mesh
    from tessel.models.build import build_model
    from tessel.train.trainer import Trainer
    fields, seq, batch = (SMOKE if args.smoke else SUITE)["llama-1.3b"]
    cfg = one_rank_config(fields, seq, batch, tempfile.mkdtemp(), precision, True, args.backend, "stdlib",
                          lr=3e-4, min_lr=3e-5, warmup_steps=WARMUP, steps=args.steps)
    mesh = make_mesh(cfg.parallel.axis_sizes, device=device)
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, mesh, parallelize(build_model(cfg.model).to(device), mesh, cfg), 0)
    losses, blocks, queued = [], [], []
    start = None
    for step in range(args.steps):
        if step >= WARMUP and (step - WARMUP) % BLOCK == 0:
            if start is not None:
                blocks.append(_drained(device) - start)
            start = _drained(device)
        queued.append(trainer.launch_step(step))
        if len(queued) > 1:
            losses.append(trainer.read_row(queued.pop(0))["loss"])
    losses.append(trainer.read_row(queued.pop(0))["loss"])
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"losses": losses, "step_s": statistics.median(blocks) / BLOCK if blocks else None, "peak_gib": peak}


def _drained(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def predicted_ratio(args, preset: str) -> float | None:
    """The planner's fp8 / bf16 step time for the run (None where it does not price fp8)."""
    from tessel.config import ModelConfig
    from tessel.planner.cluster import get_cluster
    from tessel.planner.cost import CostModel
    from tessel.planner.layout import Layout
    from tessel.planner.model_spec import from_config
    fields, seq, batch = (SMOKE if args.smoke else SUITE)["llama-1.3b"]
    spec = from_config(ModelConfig(**fields, max_seq_len=seq), seq, batch)
    times = [CostModel(spec, get_cluster(preset, 1), p, compiled=True, fused_loss=True).estimate(
        Layout(micro_batch=batch)).step_s for p in ("fp8", "bf16")]
    return times[0] / times[1]


def _rank(args) -> dict:
    from tessel.runtime import pick_device
    device = pick_device("cpu" if args.smoke else "auto")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = {"device": name, "torch": torch.__version__, "runs": {}, "errors": []}
    for precision in ("bf16", "fp8"):
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            out["runs"][precision] = train_curve(precision, args, device)
        except Exception as err:
            out["errors"].append(f"{precision}: {type(err).__name__}: {err}"[:300])
        finally:
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


def report(result: dict, args) -> None:
    preset = preset_for(result["device"]) or "h100"
    fields, seq, batch = (SMOKE if args.smoke else SUITE)["llama-1.3b"]
    print(f"{result['device']} (torch {result['torch']}): llama-1.3b shape {'(smoke) ' if args.smoke else ''}"
          f"batch {batch} x {seq}, {args.steps} steps, compiled blocks + fused loss; planner preset {preset}")
    for err in result["errors"]:
        print("error:", err)
    runs = result["runs"]
    for p, r in runs.items():
        tail = statistics.mean(r["losses"][-TAIL:])
        speed = f"{r['step_s'] * 1e3:8.1f} ms/step {batch * seq / r['step_s']:9.0f} tokens/s" if r["step_s"] else ""
        mem = f" peak {r['peak_gib']:.1f} GiB" if r["peak_gib"] else ""
        print(f"{p:5s} {speed} first loss {r['losses'][0]:.4f} mean of last {TAIL}: {tail:.4f}{mem}")
    try:
        planned = predicted_ratio(args, preset)
    except Exception as err:
        planned = None
        print(f"planner: {type(err).__name__}: {err}"[:200])
    if len(runs) == 2:
        gap = statistics.mean(runs["fp8"]["losses"][-TAIL:]) / statistics.mean(runs["bf16"]["losses"][-TAIL:]) - 1
        print(f"loss gap after {args.steps} steps (fp8 / bf16 - 1, mean of the last {TAIL}): {gap:+.4f}")
        if runs["fp8"]["step_s"] and runs["bf16"]["step_s"]:
            if planned is not None:
                print(f"planner tokens/s ratio fp8 / bf16: {1 / planned:.3f}")
            print(f"ratio tokens/s fp8 / bf16: {runs['bf16']['step_s'] / runs['fp8']['step_s']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a toy model on the CPU, emulated float8")
    ap.add_argument("--steps", type=int, default=None, help="steps per precision (200; smoke 32)")
    ap.add_argument("--backend", default=None, help="torch.compile backend (inductor; smoke aot_eager)")
    args = ap.parse_args()
    args.steps = args.steps or (32 if args.smoke else 200)
    args.backend = args.backend or ("aot_eager" if args.smoke else "inductor")
    from tessel.spawn import spawn
    backend = "nccl" if torch.cuda.is_available() and not args.smoke else "gloo"
    result = spawn(_rank, 1, args, timeout=1200, backend=backend, threads=1)[0]
    report(result, args)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "fp8.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
