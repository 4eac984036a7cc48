"""The recipe a one-rank benchmark trains with: a model's fields at a batch and sequence, synthetic data, no
evaluation, sampling, progress bar or TensorBoard, and the speed knobs (train.compile, train.fused_loss) to
compare. Shared by single_gpu.py, compile_cpu.py and gpu_suite.py (each imports it from its own folder)."""

from __future__ import annotations


def one_rank_config(model: dict, seq: int, batch: int, out: str, precision: str = "fp32", compiled: bool = False,
                    backend: str = "inductor", data: str = "synthetic", **train):
    """compiled: train.compile = "blocks" and train.fused_loss on, with `backend`; else eager and unfused.
    data: the data source (synthetic tokens by default); train: further train.* fields (lr, ...)."""
    from tessel.config import build_config
    return build_config({
        "model": {**model, "max_seq_len": seq},
        "train": {"steps": 10_000, "global_batch": batch, "seq_len": seq, "precision": precision, "warmup_steps": 10,
                  "eval_every": 0, "sample_tokens": 0, "grad_clip": 1.0, "compile": "blocks" if compiled else "off",
                  "compile_backend": backend, "fused_loss": compiled, **train},
        "data": {"source": data},
        "logging": {"out_dir": out, "progress": False, "tensorboard": False}})
