"""The recipe's schema: its sections, every field with its type, default, bounds and description (the one
place a knob is named and described: tessel.commands.config_doc writes docs/config.md from it, the planner's Layout
takes its names, help and choices from it), and the rules a single section checks itself.

A recipe is a TOML file with the sections below (tessel.config.io reads it); the rules that tie sections
together are tessel.config.rules, checked in tessel.config.check.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tessel.axes import AXES, Axis, full_order
from tessel.hf.shape import HFConfigError, model_shape


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
    # the reference MoE routes to any k up to n_experts (model._shapes); a Hugging Face MoE to what its config declares
    moe_top_k: int = Field(1, ge=1, description="experts a token is routed to: 1 (Switch), 2 (GShard), more for "
                                                "fine-grained experts (DeepSeekMoE: 8 of 256)")
    capacity_factor: float = Field(1.25, ge=0,
        description="each expert takes at most ceil(tokens/n_experts x capacity_factor) tokens; the rest ride the "
                    "residual. 0: dropless (every expert takes all its tokens)")
    aux_loss_coef: float = Field(0.01, ge=0, description="weight of the load-balancing loss; 0 disables it")
    z_loss_coef: float = Field(0.0, ge=0, description="weight of the router z-loss; 0 disables it")
    router_jitter: float = Field(0.0, ge=0, lt=1, description="multiplicative noise on the router input")
    moe_random_routing: bool = Field(False, description="top-2: keep the 2nd expert with probability 2*g2")
    aux_loss_scope: Literal["global", "local"] = Field(
        "global", description="load-balancing statistics over the ranks that split the batch, as one process "
                              "computes them (global), or per rank (local); over one micro-batch (or "
                              "accumulation chunk), or, under a GPipe pipeline (global), the whole step")
    n_shared_experts: int = Field(0, ge=0,
        description="always-on experts (DeepSeekMoE), each as wide as a routed expert (ffn width), that every token "
                    "visits: one SwiGLU of n_shared_experts x that width, added to the routed output")
    moe_score: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="the router's affinity of a token for each expert: softmax over the experts (Switch, "
                               "GShard) or a sigmoid of each (DeepSeek-V3)")
    moe_norm_topk: bool | None = Field(
        None, description="the k chosen scores divided by their sum to make the gates; None: when moe_top_k > 1 "
                          "(GShard's top-2; Switch's top-1 keeps its probability, whose gradient trains the router)")
    moe_route_groups: int = Field(1, ge=1,
        description="group-limited routing (DeepSeek-V3): the experts in this many groups of consecutive ids; a "
                    "token's top-k only from its best moe_route_group_limit groups. Under ep the groups are ep "
                    "ranks or whole sets of them (a node's)")
    moe_route_group_limit: int | None = Field(
        None, ge=1, description="groups a token's experts may come from (a group scores the sum of its top-2 "
                                "scores); None: every group")
    balance: Literal["aux_loss", "bias", "none"] = Field(
        "aux_loss", description="load balancing: Switch's auxiliary loss (aux_loss_coef), DeepSeek-V3's bias "
                                "added to the scores for the choice only and nudged after each step by the sign "
                                "of the load error (balance_bias_rate; aux_loss_coef > 0 adds the loss as its "
                                "complement), or none")
    balance_bias_rate: float = Field(0.001, gt=0,
        description="balance = 'bias': after each optimizer step each expert's bias moves by this much, up for an "
                    "expert below the mean load of the step's global batch, down above it")
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


# parallel.recompute's boolean spellings, which keep their meaning beside its named modes: a recipe's true/false,
# and the text `--layout` also takes (1/0, yes/no, on/off)
RECOMPUTE_BOOLEANS = {True: "full", False: "none", "true": "full", "false": "none", "1": "full", "0": "none",
                      "yes": "full", "no": "none", "on": "full", "off": "none"}


def recompute_named(value: Any) -> Any:
    """The named mode (full, none) a boolean spelling of parallel.recompute means; any other value as it is."""
    return RECOMPUTE_BOOLEANS.get(value.lower() if isinstance(value, str) else value, value)


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
    tp_overlap: bool = Field(False,
        description="tp's communication decomposed into ring steps that overlap the matmuls using them (Wang et al."
                    " 2023): 1d with sequence_parallel, or 2d; see tessel.parallel.tensor.overlap")
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
            data = {**data, "recompute": recompute_named(data["recompute"])}
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


def compute_dtype(precision: str) -> str:
    """What train.precision computes in outside the blocks' float8 matmuls: "bf16" (autocast) for "bf16" and
    "fp8", "fp32" otherwise. The one place that says fp8 is bf16 everywhere else."""
    return "bf16" if precision in ("bf16", "fp8") else "fp32"


def compute_bytes(precision: str) -> int:
    """Bytes of an activation element under train.precision (compute_dtype's)."""
    return 2 if compute_dtype(precision) == "bf16" else 4


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
    precision: Literal["fp32", "bf16", "fp8"] = Field("fp32",
        description="compute dtype: fp32; bf16 autocast over fp32 weights; or fp8: bf16 with the transformer "
                    "blocks' linear layers multiplying in float8 (torchao; emulated on the CPU)")
    fp8_recipe: Literal["tensorwise", "rowwise"] = Field("tensorwise",
        description="train.precision = 'fp8': one scale per tensor (fastest) or per row (robust to outliers)")
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
    plots: bool = Field(True, description="at the run's end rank 0 draws curves.png and, under a pipeline, the "
                                          "last step's pipeline_trace.json and pipeline_gantt.png (matplotlib: "
                                          "about 2 s of CPU a run)")
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
                               "choose the whole layout for the new world (full; tessel.elastic.replan)")


class Config(Strict):
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    fault: FaultConfig = Field(default_factory=FaultConfig)
