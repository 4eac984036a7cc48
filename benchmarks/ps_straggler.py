"""One straggler (3x slower): parameter server BSP / SSP / ASP vs all-reduce data parallelism.

    PYTHONPATH=. python benchmarks/ps_straggler.py [--seconds 20] [--workers 3] [--out runs/ps_straggler.png]

A tiny GPT trains on the stdlib corpus (byte tokens). Worker 0 is slowed 3x by
an injected sleep of twice its own compute time after every step. Each mode
trains for the same wall-clock budget: the parameter server with one server
rank and `--workers` workers (tessel.parallel.ps.parameter_server), and the PyTorch peer,
all-reduce DP over the same number of ranks (tessel.parallel.data.data_parallel with the
backend's all-reduce). Reported: worker steps/s (gradients computed per second,
all workers together), optimizer updates/s, and the training loss of a fast
worker against time (saved as a plot). The last line is the ASP/BSP
throughput ratio. Timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tessel.config import DataConfig, ModelConfig  # noqa: E402
from tessel.models.gpt import GPT, cross_entropy  # noqa: E402
from tessel.spawn import spawn  # noqa: E402

MODEL = ModelConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, max_seq_len=64)
SEQ, BATCH, LR, SLOW = 64, 8, 3e-3, 3.0


def _tokens():
    from tessel.train.data import load_tokens
    return torch.from_numpy(load_tokens(DataConfig(source="stdlib", max_bytes=2_000_000), 256).train[:].astype("int64"))


def _batch(tokens, worker, step):
    g = torch.Generator().manual_seed(100_003 * worker + step)
    starts = torch.randint(0, len(tokens) - SEQ - 1, (BATCH,), generator=g)
    rows = torch.stack([tokens[s: s + SEQ + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def _straggle(worker: int, compute_s: float) -> None:
    if worker == 0:
        time.sleep((SLOW - 1) * compute_s)  # 3x the step's own compute time


def _ps_run(mode: str, seconds: float, staleness: int):
    from tessel.parallel.ps.parameter_server import ParameterServer
    torch.manual_seed(0)
    model = GPT(MODEL)
    workers = list(range(1, dist.get_world_size()))
    ps = ParameterServer(model, servers=[0], workers=workers, mode=mode, staleness=staleness,
                         optimizer=lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=0.0))
    if ps.is_server:
        st = ps.serve()
        return {"updates": st.updates, "max_staleness": st.max_staleness}
    tokens, w = _tokens(), dist.get_rank() - 1
    ps.pull()  # the first answer waits for the server's start-up (optimizer imports): not timed
    curve, steps, t0 = [], 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x, y = _batch(tokens, w, steps)
        c0 = time.perf_counter()
        loss = ps.step(lambda m: cross_entropy(m(x), y))
        _straggle(w, time.perf_counter() - c0)
        steps += 1
        curve.append((time.perf_counter() - t0, loss))
    elapsed = time.perf_counter() - t0
    ps.finish()
    return {"steps": steps, "elapsed": elapsed, "curve": curve}


def _dp_run(seconds: float):
    from tessel.mesh import make_mesh
    from tessel.parallel.data.data_parallel import data_parallel
    torch.manual_seed(0)
    mesh = make_mesh({"dp": dist.get_world_size()})
    model = data_parallel(GPT(MODEL), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    tokens, w = _tokens(), dist.get_rank()
    curve, steps, t0 = [], 0, time.perf_counter()
    go = torch.ones(1)
    while go.item():
        x, y = _batch(tokens, w, steps)
        c0 = time.perf_counter()
        loss = cross_entropy(model(x), y)
        loss.backward()  # the all-reduce waits here for the straggler
        opt.step()
        opt.zero_grad(set_to_none=False)
        _straggle(w, time.perf_counter() - c0)
        steps += 1
        curve.append((time.perf_counter() - t0, loss.item()))
        go.fill_(float(time.perf_counter() - t0 < seconds))
        dist.broadcast(go, src=1)  # a fast rank decides when time is up, for everyone
    return {"steps": steps, "elapsed": time.perf_counter() - t0, "curve": curve, "updates": steps}


def _smooth(curve, k=0.9):
    out, ema = [], None
    for t, v in curve:
        ema = v if ema is None else k * ema + (1 - k) * v
        out.append((t, ema))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--out", default="runs/ps_straggler.png")
    args = ap.parse_args()
    _tokens()  # build the corpus cache once, before ranks race for it
    W, T = args.workers, args.seconds
    runs = {}
    for mode in ("bsp", "ssp", "asp"):
        res = spawn(_ps_run, W + 1, mode, T, args.staleness, timeout=T * 6 + 120)
        workers = res[1:]
        runs[mode] = {"steps": sum(r["steps"] for r in workers), "elapsed": max(r["elapsed"] for r in workers),
                      "updates": res[0]["updates"], "curve": workers[1]["curve"],
                      "max_staleness": res[0]["max_staleness"]}
    res = spawn(_dp_run, W, T, timeout=T * 6 + 120)
    runs["allreduce-dp"] = {"steps": sum(r["steps"] for r in res), "elapsed": max(r["elapsed"] for r in res),
                            "updates": res[0]["updates"], "curve": res[1]["curve"], "max_staleness": 0}
    print(f"tiny GPT ({MODEL.n_layer}x{MODEL.d_model}) on the stdlib corpus, {W} workers (+1 server for PS), "
          f"worker 0 slowed {SLOW:.0f}x, {T:.0f}s per mode; SSP staleness {args.staleness}; noisy shared machine")
    print(f"{'mode':>13} {'worker steps/s':>15} {'updates/s':>10} {'max stale':>10} {'loss start':>11} {'loss end':>9}")
    for mode, r in runs.items():
        sm = _smooth(r["curve"])
        print(f"{mode:>13} {r['steps'] / r['elapsed']:>15.2f} {r['updates'] / r['elapsed']:>10.2f} "
              f"{r['max_staleness']:>10} {r['curve'][0][1]:>11.3f} {statistics.mean(v for _, v in sm[-5:]):>9.3f}")
    _plot(runs, args.out)
    print(f"plot: {args.out}")
    bsp, asp = (runs[m]["steps"] / runs[m]["elapsed"] for m in ("bsp", "asp"))
    print(f"ASP/BSP throughput (worker steps/s): {asp / bsp:.2f}x")


def _plot(runs, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, r in runs.items():
        t, v = zip(*_smooth(r["curve"]))
        ax.plot(t, v, label=f"{mode} ({r['steps'] / r['elapsed']:.1f} steps/s)")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("training loss of a fast worker (EMA 0.9)")
    ax.set_title("one worker slowed 3x: BSP / SSP / ASP parameter server vs all-reduce DP")
    ax.legend()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
