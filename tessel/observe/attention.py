"""Which kernel runs a model's attention on a GPU, checked once at the start, and a warning when it is the slow one.

torch's scaled_dot_product_attention picks, for each call, the first of its
fused kernels that accepts the inputs: FlashAttention-2 (Dao 2023), cuDNN's, or
the memory-efficient one (Rabe and Staats 2021, xFormers'); when none does, the
"math" kernel, which writes the T x T scores to memory and runs several times
slower. Which one accepts depends on the head size, the dtype (flash wants
fp16/bf16), the sequence, the GPU and torch's build, so a run can fall back
without a word. `check_attention` asks torch (torch._fused_sdp_choice, what
scaled_dot_product_attention itself calls to choose) for the shape one rank's
attention has, and names in one line why each fused kernel said no (torch's
own reasons, the warnings it gives when a kernel is forced with
torch.nn.attention.sdpa_kernel). Context parallelism's ring runs its blocks
through tessel.parallel.context.kernel, whose CUDA path is written-out math: that
is said too. A reference GPT with a sliding window or packed documents trains its attention through
FlexAttention (tessel.models.window, tessel.models.documents), a fused kernel compiled from its mask: "flex",
nothing to warn about. On the CPU nothing is checked or printed.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tessel.config import Config, compute_dtype
from tessel.heartbeat import log

NAMES = {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.CUDNN_ATTENTION: "cudnn",
         SDPBackend.EFFICIENT_ATTENTION: "memory-efficient", SDPBackend.MATH: "math"}
FUSED = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)

_said: set[tuple] = set()  # what was checked already in this process (a re-layout builds its trainer again)


def probe(heads: int, seq_len: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A query (and key and value) of one sequence shaped as the model's: (1, heads, T, head_dim)."""
    return torch.empty(1, heads, seq_len, head_dim, dtype=dtype, device=device)


def kernel_for(q: torch.Tensor) -> str:
    """The kernel scaled_dot_product_attention picks for causal self-attention of q's shape and dtype."""
    choice = SDPBackend(torch._fused_sdp_choice(q, q, q, None, 0.0, True))
    return NAMES.get(choice, choice.name.lower())


def why_not_fused(q: torch.Tensor) -> str:
    """torch's reasons, per fused kernel, for refusing q: each kernel forced in turn, its warnings kept."""
    reasons: list[str] = []
    for backend in FUSED:
        with warnings.catch_warnings(record=True) as caught, sdpa_kernel(backend):
            warnings.simplefilter("always")
            try:
                F.scaled_dot_product_attention(q, q, q, is_causal=True)
            except RuntimeError:  # "No available kernel": the warnings said why
                pass
        reasons += [line for w in caught for line in str(w.message).splitlines()
                    if line.strip() and "not used because" not in line and line not in reasons]
    return "; ".join(reasons) or "torch gave no reason"


def attention_shape(cfg: Config) -> tuple[int, int, int]:
    """(heads, sequence, head size) of one rank's attention call: tp splits the heads, Ulysses' all-to-all the
    heads over cp (each rank then attends whole sequences)."""
    m, p = cfg.model, cfg.parallel
    heads = max(1, m.n_head // p.tp)
    if p.cp > 1 and p.cp_mode == "ulysses":
        heads = max(1, heads // p.cp)
    return heads, cfg.train.seq_len, m.d_model // m.n_head


def check_attention(cfg: Config, device: torch.device, say: Callable[[str], None] = log) -> str | None:
    """On a GPU: the kernel this run's attention takes (None on the CPU); one warning line, once per process,
    when that is the math kernel, naming torch's reasons."""
    if device.type != "cuda":
        return None
    p, m = cfg.parallel, cfg.model
    if m.document_separator is not None or (m.sliding_window or cfg.train.seq_len) < cfg.train.seq_len:
        return "flex"  # a masked attention trains through FlexAttention's compiled kernel (tessel.models.documents)
    dtype = torch.bfloat16 if compute_dtype(cfg.train.precision) == "bf16" else torch.float32
    heads, seq_len, head_dim = attention_shape(cfg)
    key = (heads, seq_len, head_dim, dtype, str(device), p.cp > 1 and p.cp_mode == "ring")
    if p.cp > 1 and p.cp_mode == "ring":
        if key not in _said:
            say("[tessel attention] warning: context parallelism's ring attention runs its blocks as written-out "
                "math on CUDA (tessel.parallel.context.kernel), not a fused kernel: parallel.cp_mode = 'ulysses' "
                "runs scaled_dot_product_attention on whole sequences")
        _said.add(key)
        return "math"
    q = probe(heads, seq_len, head_dim, dtype, device)
    name = kernel_for(q)
    if name == "math" and key not in _said:
        say(f"[tessel attention] warning: scaled_dot_product_attention falls back to the math kernel for {heads} "
            f"heads of size {head_dim}, sequence {seq_len}, {str(dtype).removeprefix('torch.')} on "
            f"{torch.cuda.get_device_name(device)} (the T x T scores in memory, several times slower): "
            f"{why_not_fused(q)}")
    _said.add(key)
    return name
