"""tessel's trainer against a plain PyTorch training loop on one device: the price of tessel's step.

    PYTHONPATH=. python benchmarks/single_gpu.py                      # a GPT-2-small-sized model, bf16, on a GPU
    PYTHONPATH=. python benchmarks/single_gpu.py --d-model 64 --heads 4 --layers 2 --seq 64 --batch 4   # a CPU smoke run

Both sides train the same GPT (tessel.models.gpt, built from one seed) on
batches of the same shape, with the same AdamW parameter groups and schedule
(tessel.train.optim), gradient clipping at 1.0, and bf16 autocast. tessel's
side is what `tessel train` runs on a rank: the Trainer's step (its batch
sampler, the runner's forward and backward, the cohort's loss mean, gradient
norm and non-finite check, the optimizer and the metrics row) on a one-rank
process group (NCCL on a GPU). The peer is the loop a user writes by hand
(nanoGPT's shape): forward under autocast, backward, clip, step, zero the
gradients, and read the loss back each step (tessel's progress bar and
metrics need it each step too). Steps alternate between the two, which goes
first alternating too (ABBA). Prints each side's median step, tokens/s and MFU
against the device's dense bf16 spec-sheet peak (tessel.observe.metrics), then,
last, the ratio tessel/plain of median step times (lower is better for tessel).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from one_rank import one_rank_config  # beside this file (sys.path[0] when run as a script)


def _config(args):
    model = {"vocab_size": args.vocab, "n_layer": args.layers, "n_head": args.heads, "d_model": args.d_model}
    return one_rank_config(model, args.seq, args.batch, args.out, args.precision)


def _plain_loop(cfg, device: torch.device):
    """The hand-written loop: one step of it as a function."""
    from tessel.models.gpt import GPT, cross_entropy
    from tessel.train.optim import build_optimizer, build_scheduler
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model).to(device)
    opt = build_optimizer(list(model.parameters()), cfg.train)
    sched = build_scheduler(opt, cfg.train)
    t = cfg.train
    g = torch.Generator().manual_seed(1)

    def step() -> float:
        x = torch.randint(0, cfg.model.vocab_size, (t.global_batch, t.seq_len + 1), generator=g).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.precision == "bf16"):
            loss = cross_entropy(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def _bench(args) -> dict:
    from tessel.apply import parallelize
    from tessel.mesh import make_mesh
    from tessel.models.build import build_model
    from tessel.models.flops import training_flops_per_token
    from tessel.observe.metrics import device_peak_flops, synced_seconds
    from tessel.runtime import pick_device
    from tessel.train.trainer import Trainer
    device = pick_device("auto")
    cfg = _config(args)
    mesh = make_mesh(cfg.parallel.axis_sizes, device=device)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model).to(device)
    trainer = Trainer(cfg, mesh, parallelize(model, mesh, cfg), 0)
    plain = _plain_loop(cfg, device)
    ours, theirs = [], []
    for i in range(args.warmup + args.steps):
        if i % 2 == 0:
            a, b = synced_seconds(lambda: trainer.train_step(i), device), synced_seconds(plain, device)
        else:
            b, a = synced_seconds(plain, device), synced_seconds(lambda: trainer.train_step(i), device)
        if i >= args.warmup:
            ours.append(a)
            theirs.append(b)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "ours": statistics.median(ours), "theirs": statistics.median(theirs),
            "flops_per_token": training_flops_per_token(model, cfg.model, cfg.train.seq_len),
            "peak": device_peak_flops(device, cfg.train.precision) if device.type == "cuda" else None,
            "params": sum(p.numel() for p in model.parameters()),
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    args = ap.parse_args()
    import tempfile

    from tessel.spawn import spawn
    args.out = tempfile.mkdtemp(prefix="tessel-single-gpu-")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    threads = 1 if backend == "nccl" else torch.get_num_threads()
    r = spawn(_bench, 1, args, timeout=1800, backend=backend, threads=threads)[0]
    tokens = args.batch * args.seq
    print(f"{r['device']}: GPT {r['params'] / 1e6:.0f}M parameters, batch {args.batch}x{args.seq}, {args.precision}, "
          f"median of {args.steps} steps (one rank, {backend})")
    for side, t in (("tessel Trainer", r["ours"]), ("plain PyTorch loop", r["theirs"])):
        mfu = f", MFU {r['flops_per_token'] * tokens / t / r['peak']:.3f}" if r["peak"] else ""
        print(f"{side:<20} {t * 1e3:8.1f} ms/step  {tokens / t:10.0f} tokens/s{mfu}")
    if r["peak_mem_gib"] is not None:
        print(f"peak GPU memory of both models together: {r['peak_mem_gib']:.1f} GiB")
    print(f"ratio tessel/plain (median step time): {r['ours'] / r['theirs']:.3f}")


if __name__ == "__main__":
    main()
