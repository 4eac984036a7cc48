"""Typed, validated configuration.

A recipe is a TOML file with the sections below. Every rule that can be
checked without a process group is checked here, before anything is spawned,
so a bad recipe fails in a second with a message that names the field.
"""

from __future__ import annotations

import functools
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Literal

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tessel.axes import AXES, Axis, full_order
from tessel.errors import ConfigError
from tessel.hf_check import hf_config_problem
from tessel.hf_context import hf_cp_refusal
from tessel.hf_grid import hf_grid_refusal
from tessel.hf_ep_plan import hf_ep_refusal
from tessel.hf_head import hf_fused_loss_refusal
from tessel.hf_layout import pp_problem, tp_problem
from tessel.hf_shape import (OWN_RULES, HFConfigError, family, model_shape,
                             read_config)

# Command-line arguments are checked with the same error as recipe fields: `field` is then the flag.

def at_least(field: str, value: int | None, low: int) -> None:
    """A count flag below its minimum (None means not given: its default applies)."""
    if value is not None and value < low:
        raise ConfigError(field, f"must be at least {low} (got {value})")


def output_file(field: str, path: str | Path) -> None:
    """An output path is checked before the work that fills it: not a folder, and its nearest
    existing ancestor a folder we can write in. Writing is tried (a scratch file, removed at once)
    because os.access answers yes to root even where nothing can be created, such as /proc."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(field, f"{path} is a folder; give a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(field, f"cannot write {path}: permission denied")
    folder = next(p for p in path.absolute().parents if p.exists())
    if not folder.is_dir():
        raise ConfigError(field, f"cannot write {path}: {folder} is not a folder")
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as err:
        reason = f"nothing can be created in {folder} ({err.strerror})"
        raise ConfigError(field, f"cannot write {path}: {reason}") from None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)  # TOML has real types: "2" is not 2


class ModelConfig(Strict):
    """The model: the reference GPT's shape and MoE blocks, or a Hugging Face architecture (hf_config)."""

    vocab_size: int = Field(256, ge=2,
        description="token ids the embedding and the head hold (byte-level data needs 256)")
    n_layer: int = Field(2, ge=1, description="transformer blocks")
    n_head: int = Field(4, ge=1, description="attention heads (1D tp splits them: divisible by tp)")
    n_kv_head: int | None = Field(None, ge=1, description="grouped-query attention; default n_head")
    d_model: int = Field(64, ge=1,
        description="hidden size (divisible by n_head, with an even head size for rotary embeddings)")
    d_ff: int | None = Field(None, ge=1, description="SwiGLU hidden size; default ~8/3 d_model")
    max_seq_len: int = Field(128, ge=1,
        description="longest sequence the model takes (train.seq_len must not exceed it)")
    rope_theta: float = Field(10000.0, gt=0, description="rotary embeddings' base")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm's epsilon")
    tie_embeddings: bool = Field(False, description="the output head shares the embedding's weight")
    init_std: float = Field(0.02, gt=0, description="standard deviation of the initial weights")
    sliding_window: int | None = Field(None, ge=1, description="attention within a window: each token sees itself and "
                                       "the sliding_window - 1 before it (FlexAttention on a GPU); None: all before it")
    document_separator: int | None = Field(
        None, ge=0, description="packed documents: the token id that ends a document (the tokenizer's "
                                "<|endoftext|>); attention never crosses it (FlexAttention on a GPU). None: one "
                                "causal attention over the whole sequence")
    # mixture of experts (every moe_every-th block is an MoE block when n_experts > 0)
    n_experts: int = Field(0, ge=0, description="experts per MoE block; 0: a dense model")
    moe_every: int = Field(1, ge=1, description="every moe_every-th block is an MoE block (when n_experts > 0)")
    # the reference MoE routes to 1 or 2 experts (model._shapes); a Hugging Face MoE to what its config declares
    moe_top_k: int = Field(1, ge=1, description="experts a token is routed to: 1 (Switch) or 2 (GShard)")
    capacity_factor: float = Field(1.25, gt=0,
        description="each expert takes at most ceil(tokens/n_experts x capacity_factor) tokens; the rest ride the "
                    "residual")
    aux_loss_coef: float = Field(0.01, ge=0, description="weight of the load-balancing loss; 0 disables it")
    z_loss_coef: float = Field(0.0, ge=0, description="weight of the router z-loss; 0 disables it")
    router_jitter: float = Field(0.0, ge=0, lt=1, description="multiplicative noise on the router input")
    moe_random_routing: bool = Field(False, description="top-2: keep the 2nd expert with probability 2*g2")
    aux_loss_scope: Literal["global", "local"] = Field(
        "global", description="load-balancing statistics over the ranks that split the batch, as one process "
                              "computes them (global), or per rank (local); over one micro-batch (or "
                              "accumulation chunk), or, under a GPipe pipeline (global), the whole step")
    # a Hugging Face architecture instead of the reference GPT
    hf_config: str | None = Field(None, description="a transformers config.json (or its folder): train that "
                                                    "architecture; the shape fields above are read from it")
    init_from: str | None = Field(None, description="initial weights: a safetensors file, or a folder of them "
                                                    "(the model's own parameter names)")

    @model_validator(mode="before")
    @classmethod
    def _hf_shape(cls, data):
        """With model.hf_config the shape comes from that file; a field set to another value is an error."""
        if not isinstance(data, dict) or not data.get("hf_config"):
            return data
        try:
            shape = model_shape(data["hf_config"])
        except HFConfigError as err:
            raise ValueError(f"model.hf_config: {err}") from None
        for key, value in shape.items():
            if data.get(key) is not None and data[key] != value:
                raise ValueError(f"model.{key}: {data[key]} differs from {value} in model.hf_config; leave it out")
        return {**data, **shape}

    @model_validator(mode="after")
    def _shapes(self) -> "ModelConfig":
        if self.hf_config is not None:  # transformers' own rules: only what tessel's cuts need
            if self.sliding_window is not None:
                raise ValueError("model.sliding_window is the reference GPT's; a Hugging Face model's window is its "
                                 "config's sliding_window")
            if self.document_separator is not None:
                raise ValueError("model.document_separator: masks the reference GPT's attention; packing documents "
                                 "for a Hugging Face model is transformers' business (its attention_mask and "
                                 "position_ids), which tessel does not pass")
            if self.n_head % self.kv_heads:
                raise ValueError(f"model.n_head ({self.n_head}) must be divisible by model.n_kv_head ({self.kv_heads})")
            return self
        if self.d_model % self.n_head:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head})")
        if (self.d_model // self.n_head) % 2:
            raise ValueError("model.d_model / model.n_head must be even (rotary embeddings pair dimensions)")
        if self.n_head % self.kv_heads:
            raise ValueError(f"model.n_head ({self.n_head}) must be divisible by model.n_kv_head ({self.kv_heads})")
        if self.document_separator is not None and self.document_separator >= self.vocab_size:
            raise ValueError(f"model.document_separator: ({self.document_separator}) is no token id: model.vocab_size "
                             f"is {self.vocab_size}")
        if self.moe_top_k > 2:
            raise ValueError(f"model.moe_top_k: must be 1 or 2 for tessel's MoE (got {self.moe_top_k}); a Hugging Face "
                             "MoE routes to the num_experts_per_tok its config declares")
        if self.n_experts and self.moe_top_k > self.n_experts:
            raise ValueError("model.moe_top_k must not exceed model.n_experts")
        if self.moe_random_routing and self.moe_top_k != 2:
            raise ValueError("model.moe_random_routing needs model.moe_top_k = 2 (it drops second choices)")
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def ffn_dim(self) -> int:
        if self.d_ff:
            return self.d_ff
        return 16 * math.ceil(8 * self.d_model / 3 / 16)  # SwiGLU keeps ~the params of a 4x MLP


class ParallelConfig(Strict):
    """The layout: the mesh's degrees (world = pp*dp*ep*cp*tp, + ps_servers) and each strategy's knobs."""

    dp: int = Field(1, ge=1, description="data-parallel replicas (the batch splits over dp*ep)")
    tp: int = Field(1, ge=1,
        description="tensor-parallel group size (1d: Megatron; a grid's q*q, q*q*d or c*c*c under tp_mode)")
    tp_mode: Literal["1d", "2d", "2.5d", "3d"] = Field(
        "1d", description="tensor parallelism: 1d (Megatron), 2d (SUMMA, tp = q*q), 2.5d (Tesseract, tp = q*q*"
                          "tp_depth), 3d (tp = c*c*c); see tessel.parallel.tensor_nd")
    tp_depth: int = Field(1, ge=1, description="2.5d: the grid's depth d (tp = q*q*d)")
    pp: int = Field(1, ge=1, description="pipeline stages")
    ep: int = Field(1, ge=1, description="expert-parallel shards: each holds n_experts/ep experts (an MoE model)")
    cp: int = Field(1, ge=1, description="context parallelism: each sequence split in chunks over cp ranks")
    cp_mode: Literal["ring", "ulysses"] = Field(
        "ring", description="cp's attention: ring (keys and values passed around, Liu et al. 2023) or ulysses "
                            "(all-to-all to a head split, Jacobs et al. 2023); see tessel.parallel.context")
    zero_stage: int = Field(0, ge=0, le=3,
        description="ZeRO over dp: 1 shards AdamW's state, 2 also the gradients, 3 also the parameters; 0: plain data"
                    " parallelism")
    zero_param_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="ZeRO: dtype of the parameters the model computes with and all-gathers "
                            "(fp32 master weights and AdamW state stay in the optimizer)")
    zero_reduce_dtype: Literal["fp32", "bf16"] | None = Field(
        None, description="ZeRO: dtype gradients are reduced in; default zero_param_dtype")
    micro_batches: int = Field(1, ge=1, description="pipeline micro-batches per accumulation step")
    sequence_parallel: bool = Field(False,
        description="under tp: norms and residuals split along the sequence (Korthikanti et al. 2022); needs tp > 1")
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "pipedream", "2bw"] = Field(
        "1f1b", description="pipeline schedule; zb-h1 | zb-h2 | zbv split the backward (Qi et al. 2023), zbv "
                            "holds 2 virtual stages per rank in a V (tessel.parallel.pipeline.zero_bubble); "
                            "pipedream | 2bw never flush and update on stale weights (needs allow_async)")
    virtual_stages: int = Field(1, ge=1,
        description="pipeline chunks per rank: > 1 with schedule 'interleaved', 2 with 'zbv'")
    allow_async: bool = Field(False, description="let pipedream and 2bw update on stale weights "
                                                 "(tessel.parallel.pipeline.weight_versions says which)")
    vertical_sync: bool = Field(False, description="pipedream: every stage runs a micro-batch on the weight "
                                                   "version the first stage used for it")
    pp_layout: list[int] | None = Field(None, description="layers per stage; default balanced")
    pp_balance: Literal["layers", "params", "time", "speed"] = Field(
        "layers", description="without pp_layout: equal blocks, or balance parameters or measured time; speed: "
                              "blocks in proportion to each stage's device speed, within its memory "
                              "(heterogeneous devices: runtime.device_speeds, else measured at start)")
    dp_split: Literal["even", "speed"] = Field(
        "even", description="how the dp ranks share a step's micro-batches: evenly, or in proportion to their "
                            "devices' speed (runtime.device_speeds, else measured at start); the update is the "
                            "even split's (tessel.parallel.data.uneven)")
    dp_shares: list[int] | None = Field(None, description="micro-batches of each dp rank per step (an uneven "
                                                          "split; they sum to dp*grad_accum*micro_batches)")
    recompute: Literal["none", "full", "selective"] = Field(
        "none", description="activation recomputation: none; full (every block keeps only its input); "
                            "selective (the attention core, Korthikanti et al. 2022); true = full, false = none")
    bucket_mb: float = Field(25.0, gt=0, description="gradient bucket size for data parallelism")
    dp_algorithm: Literal["native", "ring", "hierarchical"] = Field("native",
        description="gradient all-reduce: the backend's own (native), or tessel's point-to-point ring or hierarchical"
                    " (within nodes, then across) (tessel.comm)")
    dp_arch: Literal["allreduce", "ps"] = Field(
        "allreduce", description="data-parallel architecture: gradient all-reduce, or a parameter server")
    ps_mode: Literal["bsp", "asp", "ssp"] = Field("bsp", description="parameter-server consistency")
    ps_staleness: int = Field(0, ge=0, description="ssp: steps a worker may run ahead of the slowest")
    ps_servers: int = Field(1, ge=1, description="server ranks added after the dp worker ranks")
    rank_order: list[Axis] = Field(default_factory=lambda: list(AXES),
        description="the mesh's axes from outermost to innermost (a permutation of pp, dp, ep, cp, tp); tp innermost "
                    "keeps a tp group on one node")

    @model_validator(mode="before")
    @classmethod
    def _recompute_booleans(cls, data: Any) -> Any:
        """recompute = true/false keep their meaning (full, none) next to the named modes."""
        if isinstance(data, dict) and isinstance(data.get("recompute"), bool):
            data = {**data, "recompute": "full" if data["recompute"] else "none"}
        if isinstance(data, dict) and isinstance(data.get("rank_order"), list):
            data = {**data, "rank_order": list(full_order(data["rank_order"]))}  # cp joins an older order
        return data

    @property
    def world_size(self) -> int:
        servers = self.ps_servers if self.dp_arch == "ps" else 0  # ranks dp .. dp+ps_servers-1
        return self.pp * self.dp * self.ep * self.cp * self.tp + servers

    @property
    def axis_sizes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "ep": self.ep, "cp": self.cp, "tp": self.tp}

    @property
    def batch_shards(self) -> int:
        """Ranks that see different data: dp and ep both split the batch."""
        return self.dp * self.ep


class TrainConfig(Strict):
    """The optimisation: steps, batch, AdamW and its schedule, precision, evaluation, sampling, speed."""

    steps: int = Field(100, ge=1, description="optimizer steps to train")
    global_batch: int = Field(8, ge=1, description="sequences per optimizer step, over all ranks")
    grad_accum: int = Field(1, ge=1,
        description="accumulation chunks per optimizer step (each micro-step a slice of the batch)")
    seq_len: int = Field(64, ge=2, description="tokens per training sequence")
    lr: float = Field(3e-3, gt=0, description="peak learning rate (AdamW), reached after warmup_steps")
    min_lr: float = Field(3e-4, ge=0, description="learning rate at the last step (cosine decay from lr)")
    warmup_steps: int = Field(10, ge=0, description="steps of linear warm-up to lr")
    weight_decay: float = Field(0.1, ge=0,
        description="AdamW's decoupled weight decay, on matrices only (not norms and biases)")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW's first-moment decay")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW's second-moment decay")
    grad_clip: float = Field(1.0, ge=0, description="0 disables clipping")
    precision: Literal["fp32", "bf16"] = Field("fp32",
        description="compute dtype: fp32, or bf16 autocast over fp32 weights")
    seed: int = Field(1234, ge=0, lt=2**63, description="numpy and torch seeds (0 <= seed < 2**63)")
    eval_every: int = Field(50, ge=0, description="0 disables periodic validation")
    eval_batches: int = Field(4, ge=1, description="validation batches per evaluation")
    sample_tokens: int = Field(200, ge=0, description="tokens sampled from sample_prompt at the end; 0: no sample")
    sample_prompt: str = Field("def ", description="the text sampling continues (not empty when sample_tokens > 0)")
    deterministic: bool = Field(False,
        description="deterministic algorithms only (and cuBLAS's reproducible workspace on CUDA): a run restarted "
                    "from a checkpoint repeats the uninterrupted one bit for bit")
    compile: Literal["off", "blocks", "model"] = Field(
        "off", description="torch.compile: 'blocks' compiles each transformer block (regional), 'model' the whole "
                           "model or pipeline stage; 'off' runs eagerly")
    compile_backend: Literal["inductor", "aot_eager", "eager"] = Field(
        "inductor", description="torch.compile's backend: inductor generates kernels; aot_eager and eager only "
                                "capture graphs (for debugging a layout's capture without code generation)")
    fused_loss: bool = Field(
        False, description="the output head and the cross-entropy fused, chunked over tokens (vocabulary-parallel "
                           "under tp): the full fp32 logits never exist")

    @model_validator(mode="after")
    def _sampling(self) -> "TrainConfig":
        if self.sample_tokens and not self.sample_prompt:
            raise ValueError("train.sample_prompt is empty: sampling needs at least one token to continue "
                             "(or set train.sample_tokens = 0)")
        return self


class DataConfig(Strict):
    """Where tokens come from."""

    source: Literal["stdlib", "bin", "synthetic"] = Field("stdlib",
        description="stdlib: the Python standard library's own .py files; bin: uint16 token files (data.path, "
                    "nanoGPT's format); synthetic: random tokens")
    path: str | None = Field(None, description="train .bin for source=bin (val: sibling val.bin)")
    val_fraction: float = Field(0.05, gt=0, lt=1, description="share of the stdlib corpus held out for validation")
    max_bytes: int = Field(32_000_000, ge=1_000, description="cap on the stdlib corpus")
    tokenizer: str | None = Field(None, description="a tokenizers tokenizer.json, or 'stdlib-bpe-N' (a byte-level "
                                                    "BPE of N ids trained on the stdlib corpus, built on demand); "
                                                    "default: bytes")


class LoggingConfig(Strict):
    """The run's folder, metrics and experiment trackers."""

    out_dir: str = Field("runs/tessel",
        description="the run's folder: metrics, TensorBoard events, plots, checkpoints (one run per folder)")
    log_every: int = Field(1, ge=1, description="write a metrics row every N steps (and the last)")
    tensorboard: bool = Field(True, description="write TensorBoard events (when logging.trackers is not set)")
    progress: bool = Field(True,
        description="rank 0 draws a progress bar (a plain line every 10 steps when not a terminal)")
    peak_flops: float | None = Field(None, gt=0, description="per device; default measured")
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] | None = Field(
        None, description="experiment trackers fed the metrics rows, the config and the summary; default: "
                          "['tensorboard'] when logging.tensorboard, else none")
    project: str = Field("tessel", min_length=1, description="the W&B project and the MLflow experiment")
    wandb_mode: Literal["offline", "online"] = Field("offline", description="offline: files under out_dir/wandb, "
                                                                             "`wandb sync` uploads them")
    mlflow_uri: str | None = Field(None, description="MLflow tracking URI; default a file store, out_dir/mlruns")

    @model_validator(mode="after")
    def _trackers(self) -> "LoggingConfig":
        if self.trackers is not None:
            if len(set(self.trackers)) != len(self.trackers):
                raise ValueError("logging.trackers: names a tracker twice")
            if "tensorboard" in self.trackers and "tensorboard" in self.model_fields_set and not self.tensorboard:
                raise ValueError("logging.tensorboard: is false, but logging.trackers names tensorboard")
        return self

    @property
    def active_trackers(self) -> list[str]:
        """logging.trackers, or what logging.tensorboard alone asked for (recipes from before trackers)."""
        if self.trackers is not None:
            return list(self.trackers)
        return ["tensorboard"] if self.tensorboard else []


class RuntimeConfig(Strict):
    """Processes, devices and the backend; heterogeneous devices."""

    backend: Literal["auto", "gloo", "nccl"] = Field("auto",
        description="process-group backend: auto picks nccl for CUDA ranks, gloo for CPU ones")
    device: Literal["auto", "cpu", "cuda"] = Field("auto",
        description="auto: a GPU per rank when the node has one for each of its ranks, else the CPU")
    threads_per_rank: int = Field(1, ge=1, description="torch threads (and OMP_NUM_THREADS) per rank")
    nnodes: int = Field(1, ge=1,
        description="nodes the ranks span; with nproc_per_node it says which ranks share a node")
    nproc_per_node: int | None = Field(None, ge=1,
        description="ranks per node (nnodes*nproc_per_node must equal the world size); default: torchrun's")
    topology: str | None = Field(None, description="topology file from `tessel probe` (node grouping)")
    timeout_s: float = Field(300.0, gt=0, description="collective timeout")
    elastic: bool = Field(False, description="re-plan dp (and grad_accum) when the world size differs")
    device_speeds: list[float] | None = Field(None, description="heterogeneous devices: each rank's relative "
                                              "speed, in rank order (dp_split and pp_balance 'speed' read it; "
                                              "with emulate_flops a rank's device runs at emulate_flops x speed)")
    device_memory_gib: list[float] | None = Field(None, description="heterogeneous devices: the memory each "
                                                  "rank may hold, in rank order (pp_balance 'speed' keeps a "
                                                  "stage's blocks within it); default: what the device has")
    emulate_flops: float | None = Field(None, gt=0, description="drills and tests: run every block of the reference "
                                        "GPT on an emulated accelerator of this many FLOP/s (it waits its matmul "
                                        "FLOPs / this in time.sleep; tessel.models.emulated)")


class CheckpointConfig(Strict):
    """Checkpoints: where, how often, how many, and which to resume from."""

    dir: str | None = Field(None, description="default: <logging.out_dir>/checkpoints")
    every: int = Field(0, ge=0, description="save every N steps; 0 disables periodic checkpoints")
    keep: int = Field(3, ge=1, description="how many of the newest checkpoints to keep")
    async_save: bool = Field(False, description="write in a background thread (dcp.async_save)")
    resume: str | None = Field(None, description="'auto' (newest valid checkpoint) or a checkpoint path")


class FaultConfig(Strict):
    """Heartbeat and hangs, non-finite steps and rollbacks, stragglers and slow ranks, re-planning."""

    heartbeat_s: float = Field(2.0, ge=0, description="heartbeat period; 0 disables the heartbeat")
    hang_timeout_s: float = Field(60.0, gt=0, description="a rank whose heartbeat stops this long is stalled")
    kill_stalled: bool = Field(True, description="SIGKILL a stalled rank on the same host so the group restarts")
    nan_tolerance: int = Field(3, ge=1, description="roll back after this many non-finite steps in a row")
    max_rollbacks: int = Field(3, ge=0,
        description="rollbacks to the last checkpoint before a run of non-finite steps ends the run")
    straggler_every: int = Field(10, ge=0, description="compare per-rank forward times every N steps; 0: off")
    straggler_factor: float = Field(2.0, gt=1, description="slower than this x the median is a straggler")
    straggler_min_s: float = Field(0.05, ge=0, description="... and slower by at least this many seconds")
    slow_policy: Literal["warn", "rebalance", "evict"] = Field(
        "warn", description="a rank persistently slower than slow_factor x the others over slow_window steps: "
                            "name it (warn), shift work away from it, its dp share or pipeline blocks (rebalance), "
                            "or checkpoint and continue without it, re-planned (evict; tessel.train.fault.slow)")
    slow_window: int = Field(5, ge=2, description="steps of per-rank compute and idle times a slow-rank "
                                                  "decision rests on")
    slow_factor: float = Field(1.5, gt=1, description="a rank whose forward time over the window is more than "
                                                      "this x the median of the others' is slow")
    replan: Literal["dp-only", "full"] = Field(
        "dp-only", description="a run that resumes on another world size (runtime.elastic): keep tp, pp and ep and "
                               "re-divide dp (dp-only), or probe the links, profile the model and let the planner "
                               "choose the whole layout for the new world (full; tessel.replan)")


class Config(Strict):
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    fault: FaultConfig = Field(default_factory=FaultConfig)


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(field, message)


def check_layout(cfg: Config, world_size: int | None = None) -> None:
    """The rules that tie sections together. Raises ConfigError naming the field."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if world_size is not None:
        _require(p.world_size == world_size, "parallel",
                 f"pp*dp*ep*cp*tp (+ ps_servers) = {p.world_size} but the world size is {world_size}")
    _check_ps(cfg)
    _require(sorted(p.rank_order) == sorted(AXES), "parallel.rank_order",
             f"must be a permutation of {list(AXES)}")
    if p.tp_mode == "1d":  # a grid mode splits heads and widths over its grid's sides (_check_tp_grid)
        _require(m.n_head % p.tp == 0, "parallel.tp", f"model.n_head ({m.n_head}) is not divisible by tp ({p.tp})")
        _require(m.kv_heads % p.tp == 0, "parallel.tp",
                 f"model.n_kv_head ({m.kv_heads}) is not divisible by tp ({p.tp})")
        _require(m.ffn_dim % p.tp == 0, "parallel.tp", f"model.d_ff ({m.ffn_dim}) is not divisible by tp ({p.tp})")
    _check_tp_grid(cfg)
    _check_context_parallel(cfg)
    _check_documents(cfg)
    _check_fused_loss(cfg)
    stages = p.pp * p.virtual_stages
    _require(m.n_layer >= stages, "parallel.pp",
             f"model.n_layer ({m.n_layer}) is fewer than the pipeline stages (pp*virtual_stages = {stages})")
    if p.pp_layout is not None:
        _require(len(p.pp_layout) == stages, "parallel.pp_layout", f"needs {stages} entries (one per stage)")
        _require(sum(p.pp_layout) == m.n_layer and min(p.pp_layout) >= 1, "parallel.pp_layout",
                 f"entries must be >= 1 and sum to model.n_layer ({m.n_layer})")
    _require(p.virtual_stages == 1 or p.schedule in ("interleaved", "zbv"), "parallel.virtual_stages",
             "virtual_stages > 1 needs parallel.schedule = 'interleaved' or 'zbv'")
    _check_zbv(cfg)
    _check_split_backward(cfg)
    _check_async(cfg)
    _check_compile(cfg)
    if p.schedule == "interleaved" and p.pp > 1:
        _require(p.micro_batches % p.pp == 0, "parallel.micro_batches",
                 f"the interleaved schedule needs micro_batches divisible by pp ({p.pp})")
    mixed = p.zero_param_dtype != "fp32" or p.zero_reduce_dtype not in (None, "fp32")
    _require(not mixed or (p.zero_stage > 0 and p.pp == 1), "parallel.zero_param_dtype",
             "bf16 parameter storage or reduction needs parallel.zero_stage 1-3 and pp = 1")
    # a Hugging Face model's own check names its model type (_check_hf_expert_parallel)
    _require(p.ep == 1 or m.n_experts > 0 or m.hf_config is not None, "parallel.ep",
             "ep > 1 needs an MoE model (model.n_experts > 0)")
    if m.n_experts:
        _require(m.n_experts % p.ep == 0, "parallel.ep",
                 f"model.n_experts ({m.n_experts}) is not divisible by ep ({p.ep})")
    _require(not p.sequence_parallel or p.tp > 1, "parallel.sequence_parallel", "needs tp > 1")
    if p.sequence_parallel:
        _require(t.seq_len % p.tp == 0, "train.seq_len", f"({t.seq_len}) must be divisible by tp ({p.tp}) "
                 "under sequence parallelism")
    split = p.batch_shards * t.grad_accum * p.micro_batches
    _require(t.global_batch % split == 0, "train.global_batch",
             f"({t.global_batch}) must be divisible by dp*ep*grad_accum*micro_batches = {split}")
    _require(t.seq_len <= m.max_seq_len, "train.seq_len",
             f"({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})")
    _require(t.min_lr <= t.lr, "train.min_lr", "must not exceed train.lr")
    _require(t.warmup_steps <= t.steps, "train.warmup_steps", f"must not exceed train.steps ({t.steps})")
    if m.hf_config is not None:
        problem = hf_config_problem(m.hf_config)  # transformers' own verdict (loads it): after the rules above
        _require(problem is None, "model.hf_config", str(problem))
        _require(p.recompute != "selective", "parallel.recompute", "selective recomputes the reference GPT's "
                 "attention core; a Hugging Face model takes 'full' or 'none'")
        _check_hf_tensor_parallel(cfg)
        _check_hf_pipeline(cfg)
        _check_hf_expert_parallel(cfg)
        _check_hf_context_parallel(cfg)
    if m.init_from is not None:
        _require(Path(m.init_from).exists(), "model.init_from", f"no such file or folder: {m.init_from}")
    if cfg.data.source == "bin":
        _require(cfg.data.path is not None, "data.path", "is required when data.source = 'bin'")
        _require(Path(cfg.data.path).is_file(), "data.path", f"no such file: {cfg.data.path}")
    if cfg.data.source in ("stdlib", "bin"):
        _require(m.vocab_size >= 256 or cfg.data.source == "bin" or cfg.data.tokenizer is not None,
                 "model.vocab_size", "byte-level data needs vocab_size >= 256")
    check_tokenizer(cfg.data)
    r = cfg.runtime
    _require(not (r.backend == "nccl" and r.device == "cpu"), "runtime.backend", "nccl needs runtime.device = 'cuda'")
    if r.topology is not None:
        _require(Path(r.topology).is_file(), "runtime.topology", f"no such file: {r.topology}")
    _require(r.emulate_flops is None or m.hf_config is None, "runtime.emulate_flops",
             "emulates the reference GPT's blocks; not a Hugging Face model")
    _check_uneven(cfg)
    f = cfg.fault
    _require(f.replan == "dp-only" or p.dp_arch == "allreduce", "fault.replan",
             "'full' re-plans a device mesh; the parameter server (dp_arch = 'ps') keeps its layout")
    _require(f.slow_policy == "warn" or p.dp_arch == "allreduce", "fault.slow_policy",
             "rebalance and evict act on a device mesh; the parameter server has its own straggler rules")
    _require(f.slow_policy == "warn" or p.zero_stage == 0 or (p.ep == 1 and p.pp == 1), "fault.slow_policy",
             "rebalance and evict continue from a checkpoint, which ZeRO with ep or pp cannot write yet")
    _require(f.heartbeat_s == 0 or f.hang_timeout_s >= 2 * f.heartbeat_s, "fault.hang_timeout_s",
             f"must be at least twice fault.heartbeat_s ({f.heartbeat_s})")
    if r.nproc_per_node is not None:
        _require(r.nnodes * r.nproc_per_node == p.world_size, "runtime.nproc_per_node",
                 f"nnodes*nproc_per_node = {r.nnodes * r.nproc_per_node} but pp*dp*ep*cp*tp (+ ps_servers) "
                 f"= {p.world_size}")


BUILTIN_TOKENIZER = re.compile(r"stdlib-bpe-(\d+)")
BPE_VOCAB = (512, 65536)  # a byte-level BPE needs its 256 bytes and room to merge; ids must fit uint16


def builtin_bpe_vocab(tokenizer: str | None) -> int | None:
    """N for data.tokenizer = 'stdlib-bpe-N' (tessel's BPE trained on the stdlib corpus), None otherwise."""
    found = BUILTIN_TOKENIZER.fullmatch(tokenizer or "")
    return int(found.group(1)) if found else None


def check_tokenizer(d: DataConfig) -> None:
    """data.tokenizer names tessel's stdlib BPE with a vocabulary it can build, or an existing file (its
    contents and its size against the model are checked with the data, tessel.train.data.validate_data)."""
    if d.tokenizer is None:
        return
    vocab = builtin_bpe_vocab(d.tokenizer)
    if vocab is not None:
        low, high = BPE_VOCAB
        _require(low <= vocab <= high, "data.tokenizer", f"'{d.tokenizer}': the stdlib BPE's vocabulary must be "
                 f"{low}..{high} ids")
        return
    _require(Path(d.tokenizer).is_file(), "data.tokenizer", f"no such file: {d.tokenizer} (a tokenizer.json of "
             "the tokenizers library, or 'stdlib-bpe-N')")


def _check_split_backward(cfg: Config) -> None:
    """A split backward (zero-bubble schedules, tessel.parallel.pipeline.split_backward) runs W as one autograd
    call per weight group; each would rebuild a fully recomputed block again."""
    p = cfg.parallel
    if p.schedule not in ("zb-h1", "zb-h2", "zbv"):
        return
    _require(p.recompute != "full", "parallel.recompute",
             f"the '{p.schedule}' schedule's W would recompute each block once per weight; use 'selective' or 'none'")
    _require(p.cp == 1, "parallel.cp", f"the '{p.schedule}' schedule's split backward is not built for context "
             "parallelism's attention yet")


def _check_compile(cfg: Config) -> None:
    """train.compile = "model" traces what runs inside the model into its graph (tessel.parallel.compile). ZeRO-3
    without a pipeline gathers and frees each block's parameters in hooks on the block (storage resizes,
    parameter class switches), which dynamo cannot trace; 'blocks' compiles each block inside those hooks."""
    p = cfg.parallel
    _require(cfg.train.compile != "model" or p.zero_stage != 3 or p.pp > 1, "train.compile",
             "'model' would trace ZeRO-3's per-block gathers and frees into the graph; use 'blocks' (each block "
             "compiled, the gathers around it)")


def _check_zbv(cfg: Config) -> None:
    """ZBV (tessel.parallel.pipeline.zero_bubble) holds two stages per rank in a V: rank r runs stages r and
    2p-1-r, so the embedding and the head share rank 0."""
    p = cfg.parallel
    if p.schedule != "zbv":
        return
    _require(p.virtual_stages == 2, "parallel.virtual_stages", "the zbv schedule holds 2 virtual stages per rank "
             "in a V; set virtual_stages = 2")
    _require(p.micro_batches >= p.pp, "parallel.micro_batches",
             f"the zbv schedule needs at least pp ({p.pp}) micro-batches")
    _require(not cfg.model.tie_embeddings or p.pp == 1, "model.tie_embeddings", "the zbv schedule puts the "
             "embedding and the head on one rank, where a tied weight is not supported yet; untie them")


def _check_async(cfg: Config) -> None:
    """pipedream and 2bw (tessel.parallel.pipeline.async_schedules) never flush: a step's update uses weights
    older than the ones it changes, so the recipe must allow it; what they compose with is listed here."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    _require(not p.vertical_sync or p.schedule == "pipedream", "parallel.vertical_sync",
             "is PipeDream's option; set parallel.schedule = 'pipedream'")
    if p.schedule not in ("pipedream", "2bw"):
        return
    _require(p.allow_async, "parallel.allow_async", f"the '{p.schedule}' schedule updates on stale weights; set "
             "parallel.allow_async = true to accept that")
    _require(p.pp > 1, "parallel.pp", f"the '{p.schedule}' schedule needs pp > 1")
    _require(p.virtual_stages == 1, "parallel.virtual_stages", f"the '{p.schedule}' schedule runs one stage a rank")
    _require(p.micro_batches * t.grad_accum >= p.pp, "parallel.micro_batches",
             f"the '{p.schedule}' schedule needs at least pp ({p.pp}) micro-batches a step")
    _require(p.tp == 1 and p.ep == 1 and p.cp == 1 and p.zero_stage == 0 and p.dp_arch == "allreduce",
             "parallel.schedule", f"'{p.schedule}' composes with pp and dp (no tp, cp, ep, ZeRO or parameter "
             "server) so far")
    _require(m.hf_config is None and m.n_experts == 0, "parallel.schedule",
             f"'{p.schedule}' runs the reference dense GPT so far")
    _require(not m.tie_embeddings, "model.tie_embeddings", f"the '{p.schedule}' schedule keeps per-stage weight "
             "versions, which a weight shared by the first and the last stage does not have; untie them")
    _require(p.recompute == "none", "parallel.recompute", f"the '{p.schedule}' schedule does not recompute yet")
    _require(cfg.checkpoint.every == 0 and cfg.checkpoint.resume is None, "checkpoint.every",
             f"the '{p.schedule}' schedule's micro-batches in flight and stashed weights are not checkpointed yet; "
             "set checkpoint.every = 0")
    _require(p.schedule != "pipedream" or t.grad_clip == 0, "train.grad_clip", "pipedream updates each stage after "
             "every micro-batch, with no global gradient norm to clip by; set train.grad_clip = 0")


def _check_fused_loss(cfg: Config) -> None:
    """train.fused_loss moves the head's matmul into the loss (tessel.parallel.fused_loss): vocabulary-parallel
    under 1D tp; a grid mode (2d / 2.5d / 3d) splits the head's hidden dimension over its grid too, where the
    chunked loss would need the grid's own matmuls. A Hugging Face model must be of a type whose forward does
    nothing to the head's output that the loss would miss (tessel.hf_head reads its forward)."""
    p, m = cfg.parallel, cfg.model
    if not cfg.train.fused_loss:
        return
    _require(p.tp == 1 or p.tp_mode == "1d", "train.fused_loss",
             f"fuses the vocabulary-parallel head of 1D tensor parallelism; tp_mode {p.tp_mode!r} also splits the "
             "head's hidden dimension over its grid (set train.fused_loss = false, or parallel.tp_mode = '1d')")
    if m.hf_config is not None:
        why = hf_fused_loss_refusal(read_config(m.hf_config))
        _require(why is None, "train.fused_loss", str(why))


def hf_tp_refusal(doc: dict) -> str | None:
    """Why tensor parallelism (1D, with or without sequence parallelism) cannot split the Hugging Face model
    whose config.json reads `doc`, or None. A family with rules of tessel's own (tessel.hf_shape.OWN_RULES, no
    plans in its config) is split by them; any other is placed from its own plans by the derivation the ranks
    run (tessel.hf_layout, on the model built on the meta device), which names what it cannot place (Cohere's
    optional q/k norms, a weight per head its plan does not split; a latent attention no plan names). The
    shapes (heads, kv heads, feed-forward over tp) are check_layout's."""
    kind = doc["model_type"]
    why = None if kind in OWN_RULES else tp_problem(doc)
    return None if why is None else f"model_type {kind!r}: {why}; " \
        "this architecture trains under dp, ZeRO and recompute"


def hf_pp_refusal(doc: dict) -> str | None:
    """Why a pipeline cannot cut the Hugging Face model whose config.json reads `doc`, or None: a family with
    parts of tessel's own (OWN_RULES), or one whose base_model_pp_plan describes an embedding, one list of decoder
    layers and a head holding every weight (tessel.hf_layout.pipeline_cut, on the model built on the meta
    device)."""
    kind = doc["model_type"]
    why = None if kind in OWN_RULES else pp_problem(doc)
    return None if why is None else f"model_type {kind!r}: {why}; this " \
        "architecture trains under dp, ZeRO and recompute"


def _check_hf_tensor_parallel(cfg: Config) -> None:
    """tp > 1 splits the Hugging Face families tessel has rules for (hf_tp_refusal); their heads, kv heads and
    feed-forward must split over tp like the reference GPT's (checked above, from the shape the config filled
    in); the vocabulary is padded to a multiple of tp."""
    if cfg.parallel.tp == 1:
        return
    why = hf_tp_refusal(read_config(cfg.model.hf_config))
    _require(why is None, "parallel.tp", str(why))


def _check_hf_pipeline(cfg: Config) -> None:
    """pp > 1 cuts the Hugging Face families tessel knows (hf_pp_refusal); the rules every pipeline obeys
    (n_layer against the stages, pp_layout, micro-batches) are checked in check_layout."""
    p = cfg.parallel
    if p.pp == 1:
        return
    why = hf_pp_refusal(read_config(cfg.model.hf_config))
    _require(why is None, "parallel.pp", str(why))
    _require(p.pp_balance != "time", "parallel.pp_balance", "'time' times the reference GPT's blocks; a Hugging "
             "Face model under pp > 1 is balanced by 'layers' or 'params'")


def _check_hf_expert_parallel(cfg: Config) -> None:
    """ep > 1 shards the experts modules that the model's base_model_ep_plan names, E/ep experts a rank
    (tessel.parallel.expert.hf_experts); a model whose plan or experts tessel cannot place is refused, naming
    the module or key (tessel.hf_ep_plan.hf_ep_refusal)."""
    p, doc = cfg.parallel, read_config(cfg.model.hf_config)
    # its aux loss mixes the statistics of every layer: each stage's share (tessel.parallel.expert.cross_stage)
    # follows the micro-batches of its chunk in order, one chunk per rank
    _require(p.pp == 1 or p.virtual_stages == 1 or not doc.get("output_router_logits"), "parallel.virtual_stages",
             "the router aux loss (output_router_logits) spans every layer; under pp > 1 it is computed "
             "with one chunk per pipeline rank (virtual_stages = 1)")
    if p.ep == 1:
        return
    why = hf_ep_refusal(doc, p.ep)
    _require(why is None, "parallel.ep", str(why))


def _check_hf_context_parallel(cfg: Config) -> None:
    """cp > 1 on a Hugging Face model: every token mixer of every layer must be attention through transformers'
    attention interface, handing it nothing ring and Ulysses attention do not apply (tessel.hf_context, which
    reads the model built on the meta device); sliding windows and soft-capping are applied across the ranks."""
    if cfg.parallel.cp == 1:
        return
    why = hf_cp_refusal(read_config(cfg.model.hf_config))
    _require(why is None, "parallel.cp", str(why))


def _tp_grid_side(mode: str, tp: int, depth: int) -> int | None:
    """q of a q x q (2d) or q x q x depth (2.5d) grid, c of a c x c x c cube (3d); None if tp is no such grid."""
    root = {"2d": 2, "2.5d": 2, "3d": 3}[mode]
    cells = tp // depth if mode == "2.5d" else tp
    side = round(cells ** (1 / root))
    return side if side >= 2 and side ** root * (depth if mode == "2.5d" else 1) == tp else None


def tp_grid_refusal(m: ModelConfig, mode: str, tp: int, depth: int, micro_batch: int,
                    pp: int = 1) -> tuple[str, str] | None:
    """(field, message) of the first rule a model breaks on a tp grid (tessel.parallel.tensor_nd), None if it
    keeps them all: the tp group must be a q x q grid (2d), a q x q x depth grid (2.5d) or a c x c x c cube (3d);
    the hidden size splits in q*q (c*c*c) pieces (embedding and norms), heads, kv heads, feed-forward and
    vocabulary over the side, and each rank's micro-batch over the grid's batch chunks (q, q*depth, c*c).
    The planner's search (tessel.planner.search) enumerates grids through this same function."""
    if mode == "1d" or tp == 1:
        return None
    side = _tp_grid_side(mode, tp, depth)
    shape = {"2d": "q*q", "2.5d": f"q*q*tp_depth (q*q*{depth})", "3d": "c*c*c"}[mode]
    if side is None:
        return "parallel.tp", f"({tp}) must be {shape} with a side >= 2 for tp_mode '{mode}'"
    pieces = side ** 3 if mode == "3d" else side ** 2
    chunks = {"2d": side, "2.5d": side * depth, "3d": side * side}[mode]
    if m.d_model % pieces:
        return "model.d_model", (f"({m.d_model}) must be divisible by {pieces} "
                                 f"(tp_mode '{mode}' splits the embedding and norms in {pieces} pieces)")
    for name, value in (("n_head", m.n_head), ("n_kv_head", m.kv_heads), ("d_ff", m.ffn_dim),
                        ("vocab_size", m.vocab_size)):
        if value % side:
            return f"model.{name}", f"({value}) must be divisible by the grid's side {side}"
    if micro_batch % chunks:
        return "train.global_batch", (f"each rank's micro-batch ({micro_batch}) must be divisible by "
                                      f"the {chunks} batch chunks of tp_mode '{mode}'")
    if m.n_experts and m.hf_config is None:
        return "parallel.tp_mode", f"'{mode}' splits dense models only (no MoE) so far"
    if m.hf_config is not None:
        why = hf_grid_refusal(read_config(m.hf_config), mode, side)
        if why is not None:
            return "model.hf_config", f"tp_mode '{mode}': model_type {read_config(m.hf_config)['model_type']!r}: {why}"
    if m.hf_config is not None and pp > 1:
        return "parallel.pp", (f"a Hugging Face model under tp_mode '{mode}' and a pipeline is not tested yet; "
                               "set pp = 1")
    if m.tie_embeddings and pp > 1:
        return "model.tie_embeddings", (f"a head tied to the embedding under tp_mode '{mode}' and a pipeline is not "
                                        "built yet (the last stage's copy of the table); untie them or set pp = 1")
    return None


def _check_tp_grid(cfg: Config) -> None:
    """parallel.tp_mode 2d / 2.5d / 3d (tessel.parallel.tensor_nd): the model's rules (tp_grid_refusal), then
    how the grid composes with the other strategies. What is not built or tested yet is refused by name."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    _require(p.tp_depth == 1 or p.tp_mode == "2.5d", "parallel.tp_depth", "is the depth of a 2.5d grid only")
    _require(p.tp_mode != "2.5d" or p.tp == 1 or p.tp_depth >= 2, "parallel.tp_depth",
             "a 2.5d grid needs a depth >= 2 (depth 1 is tp_mode '2d')")
    if p.tp_mode == "1d" or p.tp == 1:
        return
    micro = t.global_batch // (p.batch_shards * t.grad_accum * p.micro_batches)
    refusal = tp_grid_refusal(m, p.tp_mode, p.tp, p.tp_depth, micro, p.pp)
    if refusal is not None:
        raise ConfigError(*refusal)
    _require(p.ep == 1, "parallel.ep", f"experts split over ep under tp_mode '{p.tp_mode}' are not built yet: "
             "the grid computes an MoE block whole on every rank (set ep = 1, or tp_mode = '1d')")
    _require(not p.sequence_parallel, "parallel.sequence_parallel",
             f"means nothing under tp_mode '{p.tp_mode}': each rank already holds a batch chunk and a hidden chunk of "
             "every activation, norms included, so nothing is replicated for it to split; set it to false")
    _require(p.dp_arch == "allreduce" and (p.zero_stage <= 2 or p.pp == 1), "parallel.tp_mode",
             f"'{p.tp_mode}' composes with dp, ZeRO-1/2/3 and pp so far (ZeRO-3 with a pipeline and the parameter "
             "server are not tested yet)")


def _check_uneven(cfg: Config) -> None:
    """Heterogeneous devices (tessel.parallel.data.uneven, tessel.planner.hetero): per-rank declarations cover
    every rank; an uneven dp split runs where each dp rank's micro-batches reduce once per step (plain DP or
    ZeRO-1, no pipeline, no experts: their collectives run per micro-batch and would wait on a rank with fewer)."""
    p, r = cfg.parallel, cfg.runtime
    for name, values in (("device_speeds", r.device_speeds), ("device_memory_gib", r.device_memory_gib)):
        if values is None:
            continue
        _require(len(values) == p.world_size or r.elastic, f"runtime.{name}",
                 f"has {len(values)} entries; the layout has {p.world_size} ranks (one per rank)")
        _require(all(v > 0 for v in values), f"runtime.{name}", "entries must be positive")
    if p.dp_shares is not None:
        _require(p.dp_split == "speed" or len(p.dp_shares) == p.dp, "parallel.dp_shares",
                 f"has {len(p.dp_shares)} entries; dp is {p.dp} (one per dp rank)")
        want = p.dp * cfg.train.grad_accum * p.micro_batches
        _require(min(p.dp_shares) >= 1 and sum(p.dp_shares) == want, "parallel.dp_shares",
                 f"entries must be >= 1 and sum to dp*grad_accum*micro_batches = {want}")
    if p.dp_shares is not None or p.dp_split == "speed":
        field = "parallel.dp_shares" if p.dp_shares is not None else "parallel.dp_split"
        _require(p.pp == 1 and p.ep == 1 and cfg.model.n_experts == 0, field,
                 "an uneven dp split needs pp = 1 and no experts (their collectives run per micro-batch)")
        _require(p.cp == 1, field, "an uneven dp split is not built with context parallelism (cp = 1)")
        _require(p.zero_stage <= 1 and p.dp_arch == "allreduce", field,
                 "an uneven dp split needs plain dp or ZeRO-1 (stages 2-3 reduce per micro-batch)")


def _check_context_parallel(cfg: Config) -> None:
    """parallel.cp (tessel.parallel.context): every cp rank holds chunks r and 2cp-1-r of the same sequences (the
    causal triangle balanced), so the sequence splits in 2*cp chunks, and under sequence parallelism each rank's
    chunks split again over tp; Ulysses trades the sequence split for a head split, so each tp rank's heads and
    kv heads split over cp. MoE models route each rank's chunks with the capacity and balance statistics of the
    whole sequences (tessel.parallel.context.moe). What is not built or tested yet is refused by name; a
    Hugging Face model's own attention is judged by _check_hf_context_parallel."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.cp == 1:
        return
    _require(t.seq_len % (2 * p.cp) == 0, "train.seq_len", f"({t.seq_len}) must be divisible by 2*cp = {2 * p.cp} "
             "(each cp rank holds a head and a tail chunk of every sequence)")
    if p.sequence_parallel:
        _require(t.seq_len % (p.cp * p.tp) == 0, "train.seq_len", f"({t.seq_len}) must be divisible by cp*tp = "
                 f"{p.cp * p.tp} under sequence parallelism (each cp rank's chunks split over tp)")
    if p.cp_mode == "ulysses":
        heads, kv = m.n_head // p.tp, m.kv_heads // p.tp  # each tp rank's (1d, checked above)
        _require(heads % p.cp == 0, "parallel.cp", f"ulysses splits each tp rank's {heads} heads over cp ({p.cp}): "
                 "not divisible")
        _require(kv % p.cp == 0, "parallel.cp", f"ulysses splits each tp rank's {kv} kv heads over cp ({p.cp}): "
                 "not divisible")
    _require(p.tp_mode == "1d", "parallel.cp", f"context parallelism composes with 1d tensor parallelism so far "
             f"(not tp_mode '{p.tp_mode}')")
    _require(p.dp_arch == "allreduce", "parallel.cp", "context parallelism is not supported with a parameter server")
    window = m.sliding_window
    _require(window is None or window >= t.seq_len, "parallel.cp", f"context parallelism computes whole causal "
             f"attention; model.sliding_window ({window}) is shorter than train.seq_len ({t.seq_len})")
    # 'time' runs whole sequences through the blocks before the split, where attention expects chunks
    _require(p.pp_balance != "time", "parallel.pp_balance", "'time' is not supported with cp > 1 yet; balance "
             "stages by 'layers' or 'params'")


def _check_documents(cfg: Config) -> None:
    """model.document_separator (tessel.models.documents): the reference GPT's forward finds the documents in its
    token ids and hands every block the mask. The layouts whose attention does not see those ids whole are
    refused by name; the separator against data.tokenizer's is checked with the data
    (tessel.train.data.validate_data)."""
    m, p = cfg.model, cfg.parallel
    if m.document_separator is None:
        return
    _require(p.pp == 1, "model.document_separator", "packed documents under a pipeline (pp > 1) are not built: "
             "the stages after the first receive hidden states, not the token ids the documents are read from; "
             "set pp = 1")
    _require(p.cp == 1, "model.document_separator", "packed documents under context parallelism (cp > 1) are not "
             "built: ring and Ulysses attention would need each chunk's document ids; set cp = 1")
    _require(p.tp == 1 or p.tp_mode == "1d", "model.document_separator", f"packed documents under tp_mode "
             f"{p.tp_mode!r} are not built: the grid splits each batch into chunks, the mask is made for the whole "
             "batch; use tp_mode '1d'")


def _check_ps(cfg: Config) -> None:
    """A parameter server (tessel.train.ps_trainer) serves a whole replicated model to dp workers."""
    p = cfg.parallel
    if p.dp_arch != "ps":
        _require(p.ps_mode == "bsp" and p.ps_staleness == 0, "parallel.ps_mode",
                 "ps_mode and ps_staleness apply only with parallel.dp_arch = 'ps'")
        return
    for axis in ("tp", "pp", "ep"):
        _require(getattr(p, axis) == 1, f"parallel.{axis}", "must be 1 with parallel.dp_arch = 'ps' "
                 "(workers hold the whole model)")
    _require(p.zero_stage == 0, "parallel.zero_stage", "must be 0 with parallel.dp_arch = 'ps' "
             "(the servers shard the optimizer state)")
    _require(p.ps_mode == "ssp" or p.ps_staleness == 0, "parallel.ps_staleness", "applies only to ps_mode = 'ssp'")
    _require(not cfg.runtime.elastic, "runtime.elastic", "is not supported with parallel.dp_arch = 'ps'")


def parse_override(text: str) -> tuple[list[str], Any]:
    """'parallel.dp=2' -> (['parallel', 'dp'], 2); values are parsed as TOML."""
    if "=" not in text:
        raise ConfigError(text, "an override must look like section.field=value")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is a string: --set data.source=synthetic
    return key.strip().split("."), value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(".".join(path), f"'{part}' is not a section")
        node[path[-1]] = value
    return raw


def _first_error(err: ValidationError) -> ConfigError:
    e = err.errors()[0]
    field = ".".join(str(x) for x in e["loc"]) or "config"
    msg = e["msg"]
    if e["type"] == "extra_forbidden":
        msg = "unknown key"
    if e["type"] == "value_error" and msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
        head, _, rest = msg.partition(" ")
        if head.endswith(":") and "." in head:  # "model.hf_config: why": the field, then the message
            field, msg = head[:-1], rest
        elif "." in head:
            field = head  # the validator named a deeper field itself
    return ConfigError(field, msg)


def build_config(raw: dict, overrides: list[str] = ()) -> Config:
    raw = apply_overrides(dict(raw), list(overrides))
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as err:
        raise _first_error(err) from None
    check_layout(cfg)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("recipe", f"no such file: {path}")
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as err:
            raise ConfigError("recipe", f"{path} is not valid TOML: {err}") from None
        except UnicodeDecodeError as err:
            raise ConfigError("recipe", f"{path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
        except OSError as err:
            raise ConfigError("recipe", f"cannot read {path}: {err.strerror or err}") from None
    return build_config(raw, overrides)


def to_toml(cfg: Config, exclude_defaults: bool = False) -> str:
    """Write a config back as a recipe (used by `tessel plan --out`); exclude_defaults: only the fields that
    differ from their defaults (`tessel launch`'s frozen recipes)."""
    lines = []
    for section, body in cfg.model_dump(exclude_none=True, exclude_defaults=exclude_defaults).items():
        lines.append(f"[{section}]")
        for key, value in body.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)
