"""Convergence of the asynchronous pipelines (PipeDream-2BW, PipeDream) against 1F1B on the stdlib corpus.

    PYTHONPATH=. python benchmarks/pp_convergence.py --steps 300 --out docs/pp_async_convergence.png

The same recipe (a GPT on the byte-level stdlib corpus, the same seed, data and
learning-rate schedule, no gradient clipping: PipeDream has no global norm to
clip by, so none of the three clips) trains under each schedule on pp ranks in
one process group, one after the other. The trainer's metrics give each step's
loss and time; one figure draws the training loss (a moving average) against
the step and against the cumulative time, and the validation loss at the end
is printed. What differs is only which weights each update's gradient was
taken on (tessel.parallel.pipeline.weight_versions): 1F1B flushes (the gradient
of the weights it updates), 2BW is one step stale, PipeDream updates every stage
after every micro-batch with a gradient a few updates stale. The last line
prints each schedule's final loss and time per step relative to 1F1B's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch
import torch.distributed as dist

SCHEDULES = ("1f1b", "2bw", "pipedream")


def _config(p: int, name: str, args, out_dir: str):
    from tessel.config import build_config
    raw = {"model": {"vocab_size": 256, "n_layer": args.layers, "n_head": 4, "d_model": args.d_model,
                     "max_seq_len": args.seq},
           "parallel": {"pp": p, "schedule": name, "micro_batches": args.micro_batches,
                        "allow_async": name != "1f1b"},
           "train": {"steps": args.steps, "global_batch": args.batch, "seq_len": args.seq, "lr": args.lr,
                     "min_lr": args.lr / 10, "warmup_steps": 10, "grad_clip": 0.0, "eval_every": args.steps,
                     "eval_batches": 4, "sample_tokens": 0, "seed": 1234},
           "data": {"source": "stdlib", "max_bytes": 4_000_000},
           "logging": {"out_dir": out_dir, "progress": False, "tensorboard": False}}
    return build_config(raw)


def _train(args) -> dict:
    from tessel.apply import parallelize
    from tessel.mesh import make_mesh
    from tessel.models.gpt import GPT
    from tessel.train.trainer import Trainer
    p = dist.get_world_size()
    out = {}
    for name in args.schedules:
        cfg = _config(p, name, args, tempfile.mkdtemp(prefix=f"tessel-conv-{name}-"))
        mesh = make_mesh({"pp": p})
        torch.manual_seed(cfg.train.seed)
        runner = parallelize(GPT(cfg.model), mesh, cfg)
        runner.timeline = False
        trainer = Trainer(cfg, mesh, runner, dist.get_rank())
        summary = trainer.fit()
        out[name] = {"loss": [r["loss"] for r in trainer.history],
                     "time": [r["step_time_s"] for r in trainer.history], "val": summary.val_loss}
    return out


def _smooth(xs: list[float], k: int) -> list[float]:
    return [statistics.mean(xs[max(0, i - k + 1): i + 1]) for i in range(len(xs))]


def _plot(res: dict, path: str, title: str, k: int) -> None:
    import itertools

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for name, r in res.items():
        loss = _smooth(r["loss"], k)
        by_step.plot(range(1, len(loss) + 1), loss, label=name)
        by_time.plot(list(itertools.accumulate(r["time"])), loss, label=name)
    by_step.set_xlabel("step")
    by_time.set_xlabel("seconds")
    by_step.set_ylabel(f"training loss (mean of the last {k} steps)")
    by_step.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--smooth", type=int, default=10)
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    ap.add_argument("--out", default="pp_async_convergence.png")
    args = ap.parse_args()
    from tessel.spawn import spawn
    res = spawn(_train, args.pp, args, timeout=7200)[0]
    title = (f"stdlib corpus (bytes), GPT d{args.d_model} L{args.layers}, pp={args.pp}, m={args.micro_batches}, "
             f"batch {args.batch}x{args.seq}, lr {args.lr:g}, no clipping")
    _plot(res, args.out, title, args.smooth)
    print(title)
    print(f"{'schedule':<10} {'final loss (last 20)':>21} {'val loss':>9} {'ms/step (median)':>17}")
    base = res.get("1f1b")
    rel = []
    for name, r in res.items():
        final = statistics.mean(r["loss"][-20:])
        ms = 1e3 * statistics.median(r["time"][2:])
        print(f"{name:<10} {final:21.4f} {r['val']:9.4f} {ms:17.1f}")
        if base is not None:
            rel.append(f"{name} loss {final / statistics.mean(base['loss'][-20:]):.3f} "
                       f"time/step {ms / (1e3 * statistics.median(base['time'][2:])):.3f}")
    print(f"wrote {args.out}")
    print("relative to 1f1b: " + "  ".join(rel))


if __name__ == "__main__":
    main()
