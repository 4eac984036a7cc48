"""Tensor parallelism on a Hugging Face model at tp=2: tessel's plan vs transformers' own.

Both sides train transformers' causal LM of the chosen family (`--family`:
Llama, Qwen3 with its per-head q/k norms, Gemma 2 with its soft-capping and
four norms a layer) built from the same local
config with the same seed (so the same weights; the first-step losses are
printed to show it) on the same batch, on the same two ranks. tessel's side is
`tessel.parallelize` with the plan it derives from the model (Megatron layers,
a vocabulary-parallel embedding and head, the vocab-parallel loss that never
gathers the logits). transformers' side is its own tensor parallelism with the
model's plan ("auto": `base_model_tp_plan` plus the model's `_tp_plan`, DTensor
styles, the head gathering whole logits for the loss), applied by the two
class methods `from_pretrained(..., distributed_config=DistributedConfig(
tp_plan="auto"))` calls (`prepare_distribute_model`, `maybe_distribute_model`):
from_pretrained itself insists on the `accelerate` package, which tessel does
not install, before it reaches them. One step is forward + loss + backward +
AdamW. Steps of the two sides are interleaved so that load changes on the
machine hit both alike; we print the median of each and the ratio tessel /
transformers last.

    PYTHONPATH=$PWD python benchmarks/hf_tp_vs_dtensor.py [--family qwen3] [--steps 30] [--warmup 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessel.config import build_config
from tessel.mesh import make_mesh
from tessel.models.build import build_model
from tessel.apply import parallelize
from tessel.spawn import spawn


def _write_config(args) -> str:
    doc = {"model_type": args.family, "head_dim": args.hidden // args.heads, "vocab_size": args.vocab,
           "hidden_size": args.hidden,
           "intermediate_size": args.ffn, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
           "num_key_value_heads": args.kv_heads, "max_position_embeddings": args.seq,
           "bos_token_id": 1, "eos_token_id": 2,
           # an untied head on every family (Gemma 2 ties it by default): transformers' tensor parallelism cannot
           # place a tied head (its apply_tensor_parallelism looks for lm_head.weight among the modules' own
           # parameters: KeyError), and the two sides must train the same model
           "tie_word_embeddings": False}
    path = Path(tempfile.mkdtemp(prefix="tessel-hf-tp-")) / "config.json"
    path.write_text(json.dumps(doc))
    return str(path)


def _config(args, path: str):
    raw = {"model": {"hf_config": path}, "parallel": {"tp": 2},
           "train": {"global_batch": args.batch, "seq_len": args.seq, "warmup_steps": 0, "sample_tokens": 0},
           "data": {"source": "synthetic"}}
    return build_config(raw)


def _transformers_model(cfg):
    """transformers' own tensor parallelism on the same model (same seed, same weights)."""
    from transformers.distributed import DistributedConfig
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)  # <Family>ForCausalLM.from_config; its hook returns the logits
    cls = type(model)
    distributed, _, meshes = cls.prepare_distribute_model(DistributedConfig(tp_size=2, tp_plan="auto"))
    return cls.maybe_distribute_model(model, distributed, meshes)


def _step_transformers(model, opt, x, y):
    logits = model(x)  # (B, T, V): the head gathers the whole vocabulary on every rank
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    t_bwd = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return loss.item(), t_bwd


def _step_tessel(runner, opt, x, y):
    loss = runner.forward_backward(x, y)
    t_bwd = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return loss.item(), t_bwd


def _bench(args, path: str) -> dict:
    cfg = _config(args, path)
    mesh = make_mesh({"tp": 2})
    torch.manual_seed(cfg.train.seed)
    runner = parallelize(build_model(cfg.model), mesh, cfg)
    peer = _transformers_model(cfg)
    # foreach=False on both: transformers' side mixes DTensor and plain parameters
    opt_t = torch.optim.AdamW(runner.parameters(), lr=1e-3, foreach=False)
    opt_p = torch.optim.AdamW(peer.parameters(), lr=1e-3, foreach=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq), generator=g)
    y = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq), generator=g)
    times = {"tessel": [], "transformers": [], "tessel fwd+bwd": [], "transformers fwd+bwd": []}
    first = {}
    for i in range(args.warmup + args.steps):
        for name in ("tessel", "transformers") if i % 2 == 0 else ("transformers", "tessel"):
            dist.barrier()
            t0 = time.perf_counter()
            loss, t_bwd = _step_tessel(runner, opt_t, x, y) if name == "tessel" else \
                _step_transformers(peer, opt_p, x, y)
            dt = time.perf_counter() - t0
            first.setdefault(name, loss)
            if i >= args.warmup:
                times[name].append(dt)
                times[f"{name} fwd+bwd"].append(t_bwd - t0)
    return {"times": times, "first_loss": first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="llama", choices=("llama", "qwen3", "gemma2"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=688)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1, help="threads per rank")
    args = ap.parse_args()
    results = spawn(_bench, 2, args, _write_config(args), timeout=1800, threads=args.threads)
    r0 = results[0]
    print(f"HF {args.family} hidden={args.hidden} layers={args.layers} heads={args.heads}/{args.kv_heads} kv "
          f"ffn={args.ffn} vocab={args.vocab} batch={args.batch}x{args.seq}, tp=2, {args.threads} thread(s)/rank, "
          f"gloo on CPU; {args.steps} timed steps after {args.warmup} warm-up")
    print(f"first-step loss: tessel {r0['first_loss']['tessel']:.6f}  "
          f"transformers {r0['first_loss']['transformers']:.6f}")
    # a step lasts as long as its slowest rank
    med = {k: statistics.median(max(r["times"][k][i] for r in results) for i in range(args.steps))
           for k in r0["times"]}
    for k in ("tessel fwd+bwd", "transformers fwd+bwd"):
        print(f"{k:21s} median {med[k] * 1e3:8.2f} ms")
    for k in ("tessel", "transformers"):
        print(f"{k:21s} median {med[k] * 1e3:8.2f} ms per step with AdamW "
              f"({args.batch * args.seq / med[k]:,.0f} tokens/s)")
    print(f"ratio tessel/transformers: {med['tessel'] / med['transformers']:.3f}")


if __name__ == "__main__":
    main()
