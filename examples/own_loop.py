"""Train a Hugging Face model with tessel from your own training loop.

    torchrun --nproc-per-node 4 examples/own_loop.py --dp 2 --tp 2 --layout zero_stage=1
    torchrun --nproc-per-node 2 examples/own_loop.py --pp 2 --config path/to/config.json

The model is transformers' own, built from a local config (a tiny Llama when none is given); tessel
cuts it over the mesh by the layout, and the loop below is yours: data, optimizer, schedule, logging.
Nothing is downloaded. tests/test_api.py runs `train` under dp2, dp2 with ZeRO-1, tp2 with sequence
parallelism and pp2, and checks it against the same model trained alone.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig

import tessel


def tiny_llama() -> LlamaConfig:
    return LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)


def batches(vocab: int, steps: int, batch: int, seq: int, seed: int = 1):
    """The same global batches on every rank: (input_ids, targets), targets the next tokens."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        yield tokens[:, :-1], tokens[:, 1:]


def train(config: PretrainedConfig, mesh_sizes: dict[str, int], layout: str = "", steps: int = 3, batch: int = 4,
          seq: int = 16, lr: float = 1e-2, weight_decay: float = 0.1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Each step's loss and the final weights, whole, under the model's own names (every rank)."""
    mesh = tessel.make_mesh(mesh_sizes)  # one mesh, named axes: pp, dp, ep, tp
    torch.manual_seed(0)  # the same initial weights on every rank (or load pretrained ones)
    model = AutoModelForCausalLM.from_config(config)
    job = tessel.parallelize(model, mesh, layout)  # e.g. "zero_stage=1", "sequence_parallel=true", "recompute=full"
    opt = job.optimizer(lr=lr, weight_decay=weight_decay)
    losses = []
    for input_ids, targets in batches(config.vocab_size, steps, batch, seq):
        loss = job.step(job.shard(input_ids), job.shard(targets))  # forward + backward of this rank's rows
        job.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())  # the global batch's mean loss, the same on every rank
    return losses, job.full_state_dict()  # -> model.load_state_dict / save_pretrained of an uncut copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a transformers config.json or its folder (default: a tiny Llama)")
    for axis in ("dp", "tp", "pp"):
        parser.add_argument(f"--{axis}", type=int, default=1)
    parser.add_argument("--layout", default="", help="more layout keys, as `tessel plan --layout` takes them")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    dist.init_process_group("gloo")  # torchrun sets the rank, the world and the rendezvous
    config = AutoConfig.from_pretrained(args.config) if args.config else tiny_llama()
    losses, state = train(config, {"dp": args.dp, "tp": args.tp, "pp": args.pp}, args.layout, steps=args.steps)
    if dist.get_rank() == 0:
        print("losses:", " ".join(f"{x:.4f}" for x in losses))
        print(f"{len(state)} tensors, {sum(t.numel() for t in state.values()):,} values")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
