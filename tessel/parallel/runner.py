"""The Runner the trainer calls, and the LocalRunner of layouts without a pipeline.

A runner hides the layout from the trainer: it runs one optimizer step's
forward and backward on the rank's batch, evaluates, samples text, names the
tensors a checkpoint holds, and reports what only it knows (MoE load, the
pipeline's bubble and timeline). tessel.apply builds one for every
layout: LocalRunner (plain, DP, TP, EP, ZeRO), the pipeline's runner; the parameter
server's worker (tessel.parallel.ps.worker) wraps a LocalRunner.

A strategy whose optimizer state does not follow its parameters (ZeRO keeps
it in flat shards) brings its own optimizer, a CheckpointableOptimizer: it
saves and loads its state as logical tensors itself. Otherwise the trainer
builds AdamW over `parameters()`, whose state a checkpoint keeps per parameter
(tessel.train.checkpoint.optimizer_state).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Protocol, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from tessel.config import compute_dtype
from tessel.parallel.data.data_parallel import GradientSyncWrapper

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class CheckpointableOptimizer(Protocol):
    """An optimizer that checkpoints its own state (tessel.parallel.zero.optim.ZeroAdamW): a torch
    optimizer whose state lives in shards no parameter carries a mark for, so it hands the checkpoint
    logical whole tensors and reads them back itself (tessel.train.checkpoint.optimizer_state)."""

    param_groups: list[dict]

    def step(self, closure=None): ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """`optim/<name>/<key>` (and `model/<name>` where it owns the parameter's storage), logical."""

    def checkpoint_model_names(self) -> set[str]:
        """The `model/` names load_checkpoint_tensors restores (the checkpoint leaves them alone)."""

    def load_checkpoint_tensors(self, reader, metadata, localize=None) -> None:
        """Read its tensors from a DCP reader; localize(whole, param) cuts a tp/ep shard's piece."""


class Runner(Protocol):
    """What the trainer (tessel.train.trainer), its guard and its checkpoints call."""

    optimizer: CheckpointableOptimizer | None  # a strategy that shards the optimizer (ZeRO) brings its own
    # what the trainer runs after each optimizer step (MoE bias balancing: tessel.parallel.plan.Plan.after_update)
    after_update: Sequence[Callable[[], None]]

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once."""

    def named_checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and persistent buffers (live tensors) under the full model's names."""

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Gradients of the step's mean loss over the rank's batch (B, T); the loss, detached."""

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean loss of a batch without gradients."""

    def generate(self, prompt: torch.Tensor, new_tokens: int, seed: int) -> torch.Tensor:
        """prompt (B, T0) -> (B, T0 + new_tokens) sampled ids; collective, same result on every rank."""

    def extra_metrics(self) -> dict[str, float]:
        """Layout-specific numbers for this step's metrics row; collective."""

    def write_timeline(self, out_dir: str) -> dict[str, str]:
        """Files describing the run's schedule (name -> path); collective; {} when there is none."""

    def timed_modules(self) -> list[nn.Module]:
        """The modules whose forward passes are this rank's compute (timed for stragglers)."""


def autocast_for(device: torch.device, precision: str):
    if compute_dtype(precision) == "bf16":  # fp8: what is not a block's float8 matmul runs in bf16
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None,
                generator: torch.Generator | None) -> torch.Tensor:
    """logits (B, V) -> next token ids (B, 1), top-k sampling at a temperature."""
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)


def strip_wrappers(name: str) -> str:
    """'module.layers.0.attn.wq.weight' (a DataParallel wrapper) -> 'layers.0.attn.wq.weight'."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


class LocalRunner:
    """Forward/backward for a model that is whole on this rank (plain, DP, TP, EP)."""

    after_update: Sequence[Callable[[], None]] = ()  # tessel.apply sets the plan's

    def __init__(self, model: nn.Module, loss_fn: LossFn, chunks: int, device: torch.device,
                 precision: str = "fp32", full_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 vocab_size: int | None = None, max_seq_len: int | None = None,
                 extra_metrics: Callable[[], dict] | None = None,
                 optimizer: CheckpointableOptimizer | None = None, loss_weight: float = 1.0):
        self.model = model
        self.loss_fn = loss_fn
        self.chunks = chunks
        # an uneven dp split's factor on this rank's mean loss (tessel.parallel.data.uneven); 1 when even
        self.loss_weight = loss_weight
        self.device = device
        self.precision = precision
        self.full_logits = full_logits or model
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self._extra_metrics = extra_metrics
        self.optimizer = optimizer  # None: the trainer builds AdamW over parameters()

    def extra_metrics(self) -> dict:
        """Layout-specific numbers for this step's metrics row (MoE load, ...); collective."""
        return self._extra_metrics() if self._extra_metrics is not None else {}

    def parameters(self) -> list[nn.Parameter]:
        return list(dict.fromkeys(self.model.parameters()))

    def named_checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return {strip_wrappers(k): v for k, v in self.model.state_dict(keep_vars=True).items()}

    def write_timeline(self, out_dir: str) -> dict[str, str]:
        return {}  # one step is one forward and backward here: nothing to draw

    def timed_modules(self) -> list[nn.Module]:
        return [self.model]

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Accumulate gradients of mean loss over the local batch; returns that loss (detached)."""
        total = torch.zeros((), device=self.device)
        pairs = list(zip(x.chunk(self.chunks), y.chunk(self.chunks)))
        # a data-parallel wrapper reduces gradients after each backward: only the last chunk's
        # should, unless the reduction is what keeps them small (ZeRO-2/3: see defer_reduction)
        accumulates = isinstance(self.model, GradientSyncWrapper) and self.model.defer_reduction
        for i, (xc, yc) in enumerate(pairs):
            last = i == len(pairs) - 1
            with self.model.no_sync() if accumulates and not last else contextlib.nullcontext():
                with autocast_for(self.device, self.precision):
                    loss = self.loss_fn(self.model(xc.to(self.device)), yc.to(self.device)) / len(pairs)
                    if self.loss_weight != 1.0:
                        loss = loss * self.loss_weight
                loss.backward()
            total += loss.detach()
        return total

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast_for(self.device, self.precision):
            return self.loss_fn(self.model(x.to(self.device)), y.to(self.device)).detach().float()

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new_tokens: int, seed: int, temperature: float = 0.8,
                 top_k: int | None = 40) -> torch.Tensor:
        """Every rank runs this with the same seed, so collective forwards (TP) stay in step."""
        def last_logits(window: torch.Tensor) -> torch.Tensor:
            with autocast_for(self.device, self.precision):
                return self.full_logits(window)[:, -1, : self.vocab_size]
        return generate_tokens(prompt.to(self.device), new_tokens, seed, self.max_seq_len, last_logits,
                               temperature=temperature, top_k=top_k)


def generate_tokens(prompt: torch.Tensor, new_tokens: int, seed: int, max_seq_len: int | None,
                    last_logits: Callable[[torch.Tensor], torch.Tensor | None],
                    share: Callable[[torch.Tensor], torch.Tensor] = lambda ids: ids,
                    temperature: float = 0.8, top_k: int | None = 40) -> torch.Tensor:
    """The sampling loop of every runner.

    last_logits(window) gives the (B, V) logits of the last position, or None on
    a rank that holds no output head (a pipeline stage before the last);
    share(ids) makes every rank agree on the sampled ids (the pipeline
    broadcasts the last stage's). Sampling runs on the CPU generator, so the
    same seed gives the same text on every device.
    """
    gen = torch.Generator().manual_seed(seed)
    idx = prompt
    for _ in range(new_tokens):
        window = idx[:, -max_seq_len:] if max_seq_len else idx
        logits = last_logits(window)
        nxt = torch.zeros((idx.size(0), 1), dtype=torch.long, device=idx.device)
        if logits is not None:
            nxt = sample_next(logits.cpu(), temperature, top_k, gen).to(idx.device)
        idx = torch.cat([idx, share(nxt)], dim=1)
    return idx
