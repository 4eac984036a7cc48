"""torchtitan's Llama 3 at a given shape, one training step as torchtitan's Trainer runs it, in this process.

torchtitan's Trainer wants torchrun, a TOML (or its config registry), a tokenizer and a Hugging Face data
set; none of that is what is measured, so this builds the pieces the Trainer builds, with torchtitan's own
functions (torchtitan 0.3.0, the wheel benchmarks/gpu_carry.txt lists): the Llama 3 model from its own
block configs (`_build_llama3_layers`, as its flavours are built) at our shapes, `parallelize_llama` on a
one-rank mesh (its regional compile of each TransformerBlock, and FSDP2 at degree 1, which is how its
bf16 mixed precision is applied: bf16 parameters in compute, fp32 master weights and reductions), its
compiled cross-entropy loss, its fused AdamW (OptimizersContainer's 'fused' implementation is torch's
AdamW(fused=True)), and its step: forward with the causal flex-attention mask built from positions, loss
summed over tokens / valid tokens, backward, gradient clipping, step.

Needs a process group (the suite runs inside a one-rank tessel.spawn) and torchtitan importable; every
failure propagates to the caller, which prints it in one line.
"""

from __future__ import annotations

import tempfile

import torch


def titan_step(shape: dict, batch: int, seq: int, device: torch.device, backend: str, lr: float = 3e-4):
    """(one training step as a function, its model's parameter count)."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import parallelize_llama

    dist_utils.set_spmd_backend("partial_dtensor")  # as its Trainer does from parallelism.spmd_backend
    model = _build(shape, seq)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1,
                        spmd_backend="partial_dtensor")
    dims.build_mesh()
    compile_cfg = CompileConfig(enable=True, components=["model", "loss"], backend=backend)
    training = TrainingConfig(local_batch_size=batch, seq_len=seq, mixed_precision_param="bfloat16")
    model = parallelize_llama(model, parallel_dims=dims, training=training,
                              parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
                              compile_config=compile_cfg, ac_config=None, dump_folder=tempfile.mkdtemp())
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = CrossEntropyLoss.Config().build(compile_config=compile_cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8,
                            **({"fused": True} if device.type == "cuda" else {"foreach": True}))
    g = torch.Generator().manual_seed(1)
    vocab = shape["vocab_size"]
    positions = torch.arange(seq, device=device).expand(batch, seq)

    def step() -> float:
        x = torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)
        inputs, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()
        masks = model.get_attention_masks(positions=positions)
        pred = model(inputs, positions=positions, attention_masks=masks)
        loss, _ = loss_fn(pred, labels, torch.tensor(labels.numel(), device=device))
        del pred
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()  # read when logged (torchtitan logs every log_freq steps): no wait in a steady step
    return step, sum(p.numel() for p in model.parameters())


def _build(shape: dict, seq: int):
    """torchtitan's Llama3Model at `shape` (tessel's ModelConfig fields), built on the meta device as its
    Trainer builds it."""
    from functools import partial

    import torch.nn as nn
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    dim, vocab, heads = shape["d_model"], shape["vocab_size"], shape["n_head"]
    layers = _build_llama3_layers(
        n_layers=shape["n_layer"], dim=dim, n_heads=heads, n_kv_heads=shape.get("n_kv_head") or heads,
        hidden_dim=shape["ffn_dim"], attn_backend="flex",
        rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=seq, theta=shape.get("rope_theta", 10000.0),
                                scaling="none"))
    init = {"weight": partial(nn.init.normal_, std=0.02)}
    cfg = Llama3Model.Config(
        dim=dim, vocab_size=vocab, enable_weight_tying=bool(shape.get("tie_embeddings")),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=init),
        norm=RMSNorm.Config(normalized_shape=dim, param_init={"weight": nn.init.ones_}),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=init), layers=layers)
    with torch.device("meta"):
        return cfg.build()
