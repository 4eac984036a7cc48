"""tessel on one GPU against a compiled plain PyTorch loop and torchtitan, beside the planner's predictions.

    PYTHONPATH=. python benchmarks/gpu_suite.py            # one H100 or H200: under 8 minutes
    PYTHONPATH=. python benchmarks/gpu_suite.py --smoke    # the CPU, toy shapes, seconds (the test suite runs it)
    PYTHONPATH=. python benchmarks/gpu_suite.py --predict h100   # the planner's step times alone, no run

(benchmarks/gpu_carry.txt says what to carry to a GPU machine without a package index, and the one-line
command that installs it there and runs this.)

Two models, both tessel's reference GPT (tessel.models.gpt: RMSNorm, rotary, SwiGLU, no biases) at the
shapes of:
- GPT-2 124M, sequence 1024, batch 16: 12 layers, d 768, 12 heads, vocabulary 50304, tied embeddings
  (124M parameters). GPT-2 proper has LayerNorms with biases, learned positions, a 4x GELU MLP (2 x 3072
  where ours is SwiGLU 3 x 2048: the same parameters per block) and its vocabulary unpadded (50257).
- a Llama-style 1.3B, sequence 2048, batch 4: 24 layers, d 2048, 16 heads of 128 sharing 8 kv heads
  (grouped-query), SwiGLU width 5504, vocabulary 50304, untied (1.3B parameters).

Each is trained, in one process on one GPU, by
- tessel eager: tessel's Trainer step (`tessel train`'s), bf16 autocast over fp32 weights;
- tessel compiled: the same with train.compile = "blocks" and train.fused_loss = true;
- a compiled plain loop: torch.compile(model), the cross-entropy on its logits, AdamW(fused=True);
- torchtitan: its Llama 3 at the same shapes, its regional compile, compiled loss and fused AdamW
  (benchmarks/titan_peer.py says how it runs without its Trainer).
Rows run one after another (four 1.3B models do not fit at once); each is the median, over blocks of 4
steps run back to back and drained only at the block's ends (as a run queues its next step while the device
works), of the seconds a step, after warm-up (the compile). No side reads its loss inside a block but
tessel, which reads each step's row one step late, as its trainer does. MFU is against
tessel.observe.metrics.device_peak_flops (the spec sheet's dense bf16: 989 TFLOP/s for H100 and H200).
Beside each, the planner's step time for the same model, batch and settings on the GPU's preset
(tessel.planner: the roofline per op, its GEMMs from the measured table where one is committed).

The matmul section times every GEMM shape the planner prices for these models (and the tp = 8 shards of
GPT-3 13B and 175B, where its predictions were furthest off), against the planner's roofline prior for
each. With $OUT set it writes $OUT/gemm_<preset>.json: commit it as tessel/planner/gemm_tables/<preset>.json
and the planner prices GEMMs from it. Everything also goes to $OUT/gpu_suite.json.

Each section runs in its own try/except (a failure prints one line and the suite goes on) within a time
budget (--budget seconds in all; rows that would start past it are skipped and say so). Ratios last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from one_rank import one_rank_config  # beside this file (sys.path[0] when run as a script)

SUITE = {  # name: (model fields, sequence, batch)
    "gpt2-124m": (dict(vocab_size=50304, n_layer=12, n_head=12, d_model=768, tie_embeddings=True), 1024, 16),
    "llama-1.3b": (dict(vocab_size=50304, n_layer=24, n_head=16, n_kv_head=8, d_model=2048, d_ff=5504), 2048, 4),
}
SMOKE = {
    "gpt2-124m": (dict(vocab_size=256, n_layer=2, n_head=4, d_model=64, tie_embeddings=True), 64, 4),
    "llama-1.3b": (dict(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=176), 64, 2),
}
RUNS = ("tessel eager", "tessel compiled", "compiled plain loop", "torchtitan")
# (compiled, fused_loss) the planner prices each run with; torchtitan's loss is compiled but not fused
PRICED = {"tessel eager": (False, False), "tessel compiled": (True, True), "compiled plain loop": (True, False),
          "torchtitan": (True, False)}
TP8_SHAPES = ("gpt3-13b", "gpt3-175b")  # their tp = 8 shards' GEMMs, one sequence per micro-batch


# ---- the planner's side (no torch) ------------------------------------------------------------------

def preset_for(device_name: str) -> str | None:
    """The planner's preset for a GPU torch names ("NVIDIA H100 80GB HBM3" -> h100)."""
    for key in ("h200", "h100", "a100"):
        if key in device_name.lower():
            return key
    return None


def predicted_step(fields: dict, seq: int, batch: int, preset: str, compiled: bool, fused_loss: bool) -> float:
    from tessel.config import ModelConfig
    from tessel.planner.cluster import get_cluster
    from tessel.planner.cost import CostModel
    from tessel.planner.layout import Layout
    from tessel.planner.model_spec import from_config
    spec = from_config(ModelConfig(**fields, max_seq_len=seq), seq, batch)
    cm = CostModel(spec, get_cluster(preset, 1), "bf16", compiled=compiled, fused_loss=fused_loss)
    return cm.estimate(Layout(micro_batch=batch)).step_s


def planned_gemms(models: dict, preset: str) -> list:
    """The distinct GEMMs the planner prices for the suite's models and the tp = 8 shards of big GPT-3s."""
    from tessel.config import ModelConfig
    from tessel.planner.cluster import get_cluster
    from tessel.planner.cost import CostModel
    from tessel.planner.layout import Layout
    from tessel.planner.model_spec import from_config, preset as model_preset
    cl = get_cluster(preset, 8)
    out = []
    for fields, seq, batch in models.values():
        out += CostModel(from_config(ModelConfig(**fields, max_seq_len=seq), seq, batch), cl, "bf16").gemms(
            Layout(micro_batch=batch))
    if models is SUITE:
        for name in TP8_SHAPES:
            out += CostModel(model_preset(name), cl, "bf16").gemms(Layout(tp=8, micro_batch=1))
    return list(dict.fromkeys(out))


# ---- the rank's side -------------------------------------------------------------------------------

def _config(fields: dict, seq: int, batch: int, compiled: bool, backend: str, out: str):
    return one_rank_config(fields, seq, batch, out, "bf16", compiled, backend)


def tessel_step(cfg, device):
    """tessel's Trainer step on a one-rank mesh, as `tessel train` runs it."""
    from tessel.apply import parallelize
    from tessel.mesh import make_mesh
    from tessel.models.build import build_model
    from tessel.train.trainer import Trainer
    mesh = make_mesh(cfg.parallel.axis_sizes, device=device)
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, mesh, parallelize(build_model(cfg.model).to(device), mesh, cfg), 0)
    count = iter(range(1 << 30))
    queued = []

    def step() -> None:  # as Trainer.fit runs a steady step: queue step n, then read step n-1's row
        queued.append(trainer.launch_step(next(count)))
        if len(queued) > 1:
            trainer.read_row(queued.pop(0))
    return step


def plain_step(cfg, device, backend: str):
    """The loop a user writes: torch.compile(model), the loss on its logits, fused AdamW (foreach on a CPU)."""
    from tessel.models.gpt import GPT, cross_entropy
    from tessel.parallel.weight_decay import param_groups
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model).to(device)
    compiled = torch.compile(model, backend=backend)
    t = cfg.train
    opt = torch.optim.AdamW(param_groups(model.parameters(), t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                            **({"fused": True} if device.type == "cuda" else {"foreach": True}))
    g = torch.Generator().manual_seed(1)

    def step() -> float:
        x = torch.randint(0, cfg.model.vocab_size, (t.global_batch, t.seq_len + 1), generator=g).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = cross_entropy(compiled(x[:, :-1]), x[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()  # read when the user logs it; a steady step does not wait for it
    return step


def _titan(cfg, device, backend: str):
    if device.type != "cuda":  # checked on torch 2.13: its mesh asks for CUDA, and flex attention's CPU kernel
        # has no backward (torchtitan 0.3.0 dropped SDPA for language models). With both stood in for on a CPU
        # (its device type set to "cpu", flex replaced by causal SDPA), titan_step built, compiled (aot_eager)
        # and trained a 2-layer model for 4 steps at loss ln(256)
        raise RuntimeError("torchtitan trains its Llama only on a GPU (flex attention has no CPU backward)")
    sys.path.insert(0, str(Path(__file__).parent))
    from titan_peer import titan_step
    return titan_step({**cfg.model.model_dump(), "ffn_dim": cfg.model.ffn_dim}, cfg.train.global_batch,
                      cfg.train.seq_len, device, backend)[0]


BLOCK = 4  # steps timed together: the device drained before and after each block, never inside it


def timed(step, device, warmup: int, steps: int, deadline: float) -> list[float]:
    """Seconds a step, per block of BLOCK steps run back to back (as a training run runs them: the host queues
    the next step while the device works, which a drain after every step would hide), after `warmup` untimed
    steps; fewer blocks where the deadline comes first."""
    from tessel.observe.metrics import synced_seconds

    def block() -> None:
        for _ in range(BLOCK):
            step()
    for _ in range(warmup):
        step()
    out = []
    for _ in range(max(1, steps // BLOCK)):
        out.append(synced_seconds(block, device) / BLOCK)
        if time.monotonic() + BLOCK * statistics.median(out) > deadline and len(out) >= 2:
            break
    return out


def run_model(name: str, fields: dict, seq: int, batch: int, args, device, peak: float, deadline: float) -> list:
    from tessel.models.flops import training_flops_per_token
    from tessel.models.gpt import GPT
    rows = []
    cfg = _config(fields, seq, batch, False, args.backend, args.out)
    with torch.device("meta"):
        flops = training_flops_per_token(GPT(cfg.model), cfg.model, seq)
    for run in RUNS:
        row = {"model": name, "run": run, "tokens": batch * seq}
        rows.append(row)
        left = deadline - time.monotonic()
        if left < args.row_floor:
            row["error"] = f"skipped: {left:.0f} s left of the time budget"
            continue
        try:
            compiled = run == "tessel compiled"
            cfg = _config(fields, seq, batch, compiled, args.backend, args.out)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            step = {"tessel eager": lambda: tessel_step(cfg, device),
                    "tessel compiled": lambda: tessel_step(cfg, device),
                    "compiled plain loop": lambda: plain_step(cfg, device, args.backend),
                    "torchtitan": lambda: _titan(cfg, device, args.backend)}[run]()
            t0 = time.monotonic()
            times = timed(step, device, args.warmup, args.steps, min(deadline, t0 + args.row_budget))
            s = statistics.median(times)
            row.update(step_s=s, steps=len(times), tokens_per_s=batch * seq / s, mfu=flops * batch * seq / s / peak,
                       seconds=time.monotonic() - t0)
            if device.type == "cuda":
                row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        except Exception as err:  # one line, and the suite goes on
            row["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:160] if str(err).strip() else ''}"
        finally:  # this run's model, optimizer and compiled code go before the next is built
            step = None
            gc.collect()
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def matmuls(shapes: list, device, deadline: float) -> list:
    """Median seconds of each GEMM (bf16 operands; torch.bmm for batched ones)."""
    out = []
    dtype = torch.bfloat16
    for g in shapes:
        if time.monotonic() > deadline:
            out.append({"m": g.m, "n": g.n, "k": g.k, "batch": g.batch, "error": "skipped: time budget"})
            continue
        try:
            a = torch.randn(g.batch, g.m, g.k, device=device, dtype=dtype)
            b = torch.randn(g.batch, g.k, g.n, device=device, dtype=dtype)
            fn = (lambda: torch.matmul(a[0], b[0])) if g.batch == 1 else (lambda: torch.bmm(a, b))
            out.append({"m": g.m, "n": g.n, "k": g.k, "batch": g.batch, "seconds": _gemm_seconds(fn, device)})
            del a, b
        except Exception as err:
            out.append({"m": g.m, "n": g.n, "k": g.k, "batch": g.batch, "error": f"{type(err).__name__}: {err}"[:160]})
    return out


def _gemm_seconds(fn, device) -> float:
    """Median over 5 rounds of the mean of enough back-to-back calls to fill ~20 ms (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            rounds.append(time.perf_counter() - t0)
        return statistics.median(rounds)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    reps = max(1, min(1000, int(0.02 / max(start.elapsed_time(end) / 1e3, 1e-6))))
    rounds = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(rounds)


def _rank(args) -> dict:
    from tessel.observe.metrics import device_peak_flops
    from tessel.runtime import pick_device
    device = pick_device("cpu" if args.smoke else "auto")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    begin = time.monotonic()
    deadline = begin + args.budget
    models = SMOKE if args.smoke else SUITE
    result = {"device": name, "torch": torch.__version__, "rows": [], "gemms": [], "errors": []}
    preset = preset_for(name) or "h100"
    try:
        shapes = planned_gemms(models, preset)
        result["gemms"] = matmuls(shapes, device, begin + args.budget * args.gemm_share)
    except Exception as err:
        result["errors"].append(f"matmul section: {type(err).__name__}: {err}"[:200])
    try:
        peak = device_peak_flops(device, "bf16")
    except Exception as err:
        peak = float("nan")
        result["errors"].append(f"peak FLOP/s: {type(err).__name__}: {err}"[:200])
    result["peak"] = peak
    for model, (fields, seq, batch) in models.items():
        try:
            result["rows"] += run_model(model, fields, seq, batch, args, device, peak, deadline)
        except Exception as err:
            result["errors"].append(f"{model}: {type(err).__name__}: {err}"[:200])
    return result


# ---- the report -----------------------------------------------------------------------------------

def add_predictions(result: dict, models: dict) -> str:
    """Each row's planner step time on the GPU's preset (h100 where torch names no known GPU); the preset."""
    preset = preset_for(result["device"]) or "h100"
    for row in result["rows"]:
        fields, seq, batch = models[row["model"]]
        try:
            row["predicted_s"] = predicted_step(fields, seq, batch, preset, *PRICED[row["run"]])
        except Exception as err:
            row["prediction_error"] = f"{type(err).__name__}: {err}"[:160]
    return preset


def print_report(result: dict, preset: str, smoke: bool) -> None:
    from tessel.planner.cluster import get_cluster
    from tessel.planner.gemm import Gemm, prior_seconds, source
    cl = get_cluster(preset, 1)
    print(f"{result['device']} (torch {result['torch']}), bf16; planner preset {preset}"
          f"{' (toy shapes: --smoke)' if smoke else ''}; {source(cl)}")
    print(f"{'model':<11} {'run':<20} {'ms/step':>9} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} "
          f"{'planner ms':>11} {'planner/measured':>17}")
    for r in result["rows"]:
        pred = r.get("predicted_s")
        if "error" in r:
            print(f"{r['model']:<11} {r['run']:<20} not run: {r['error']}"
                  + (f" (planner {pred * 1e3:.4g} ms)" if pred else ""))
            continue
        mem = f"{r['peak_gib']:9.1f}" if "peak_gib" in r else f"{'-':>9}"
        print(f"{r['model']:<11} {r['run']:<20} {r['step_s'] * 1e3:9.1f} {r['tokens_per_s']:10.0f} {r['mfu']:6.3f} "
              f"{mem} {pred * 1e3 if pred else float('nan'):11.4g} "
              f"{pred / r['step_s'] if pred else float('nan'):17.3g}")
    print(f"matmuls at the planner's GEMM shapes, measured against its roofline prior on {preset}:")
    print(f"{'M':>6} {'N':>6} {'K':>6} {'batch':>5} {'measured TFLOP/s':>17} {'prior TFLOP/s':>14} "
          f"{'measured/prior':>15}")
    for g in result["gemms"]:
        if "error" in g:
            print(f"{g['m']:>6} {g['n']:>6} {g['k']:>6} {g['batch']:>5} not run: {g['error']}")
            continue
        flops = 2 * g["m"] * g["n"] * g["k"] * g["batch"]
        prior = prior_seconds(Gemm(g["m"], g["n"], g["k"], g["batch"]), cl, "bf16")
        print(f"{g['m']:>6} {g['n']:>6} {g['k']:>6} {g['batch']:>5} {flops / g['seconds'] / 1e12:17.1f} "
              f"{flops / prior / 1e12:14.1f} {prior / g['seconds']:15.2f}")
    for e in result["errors"]:
        print(f"not run: {e}")
    print_ratios(result)


def print_ratios(result: dict) -> None:
    """Step-time ratios (lower is better for tessel compiled), then the planner's median error: last."""
    steps = {(r["model"], r["run"]): r["step_s"] for r in result["rows"] if "step_s" in r}
    for model in dict.fromkeys(r["model"] for r in result["rows"]):
        for peer in ("tessel eager", "compiled plain loop", "torchtitan"):
            a, b = steps.get((model, "tessel compiled")), steps.get((model, peer))
            text = f"{a / b:.3f}" if a and b else "n/a (a side did not run)"
            print(f"ratio {model} tessel compiled / {peer} (median step time): {text}")
    errs = [abs(r["predicted_s"] / r["step_s"] - 1) for r in result["rows"] if "step_s" in r and r.get("predicted_s")]
    measured = [g for g in result["gemms"] if "seconds" in g]
    if measured:
        print(f"GEMMs timed: {len(measured)} of {len(result['gemms'])}")
    print(f"planner: median |predicted/measured - 1| over {len(errs)} runs: "
          + (f"{statistics.median(errs):.1%}" if errs else "n/a"))


def print_predictions(preset: str) -> None:
    """The planner's step, tokens/s, MFU and memory for each run of the suite on `preset`."""
    from tessel.config import ModelConfig
    from tessel.planner.cluster import get_cluster
    from tessel.planner.cost import CostModel
    from tessel.planner.gemm import source
    from tessel.planner.layout import Layout
    from tessel.planner.model_spec import from_config
    cl = get_cluster(preset, 1)
    print(f"planner, {preset} preset, bf16; {source(cl)}")
    print(f"{'model':<11} {'run (as priced)':<20} {'ms/step':>9} {'tokens/s':>10} {'MFU':>6} {'GiB':>6}")
    for name, (fields, seq, batch) in SUITE.items():
        spec = from_config(ModelConfig(**fields, max_seq_len=seq), seq, batch)
        for run, (compiled, fused) in PRICED.items():
            e = CostModel(spec, cl, "bf16", compiled=compiled, fused_loss=fused).estimate(Layout(micro_batch=batch))
            print(f"{name:<11} {run:<20} {e.step_s * 1e3:9.1f} {e.tokens_per_s:10.0f} {e.mfu:6.3f} "
                  f"{e.memory_total / 2**30:6.1f}")


def gemm_table(result: dict, command: str) -> dict:
    from tessel.planner.gemm import Gemm, GemmTable
    points = tuple((Gemm(g["m"], g["n"], g["k"], g["batch"]), g["seconds"]) for g in result["gemms"] if "seconds" in g)
    return GemmTable(result["device"], time.strftime("%Y-%m-%d"), command, points, "bf16", result["torch"]).to_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="toy shapes on the CPU, seconds")
    ap.add_argument("--budget", type=float, default=None, help="seconds for everything (default 400; smoke 120)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run, in blocks of 4 (default 16; smoke 4)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps, the compile among them (3; smoke 1)")
    ap.add_argument("--backend", default=None, help="torch.compile backend (inductor; smoke: aot_eager)")
    ap.add_argument("--predict", default=None, metavar="PRESET",
                    help="only the planner's step times for the suite on a preset (h100, h200): no torch run")
    args = ap.parse_args()
    if args.predict:
        print_predictions(args.predict)
        return
    smoke = args.smoke
    args.budget = args.budget or (120.0 if smoke else 400.0)
    args.steps = args.steps or (4 if smoke else 16)
    args.warmup = args.warmup or (1 if smoke else 3)
    args.backend = args.backend or ("aot_eager" if smoke else "inductor")
    args.row_budget = args.budget / 8  # one run's timed steps (its compile happens in the warm-up)
    args.row_floor = 5.0 if smoke else 60.0  # a run that cannot compile and time in this little is skipped
    args.gemm_share = 0.15  # of the budget for the matmul section
    args.out = tempfile.mkdtemp(prefix="tessel-gpu-suite-")
    from tessel.spawn import spawn
    backend = "nccl" if torch.cuda.is_available() and not smoke else "gloo"
    threads = 1 if backend == "nccl" else max(1, min(torch.get_num_threads(), 2))
    result = spawn(_rank, 1, args, timeout=args.budget + 300, backend=backend, threads=threads)[0]
    preset = add_predictions(result, SMOKE if smoke else SUITE)
    print_report(result, preset, smoke)
    out = os.environ.get("OUT")
    if out:
        command = "python benchmarks/gpu_suite.py" + (" --smoke" if smoke else "")
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_suite.json").write_text(json.dumps(result, indent=1))
        (Path(out) / f"gemm_{preset}.json").write_text(json.dumps(gemm_table(result, command), indent=1))


if __name__ == "__main__":
    main()
