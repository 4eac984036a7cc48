"""Context parallelism in the cost model (tessel.parallel.context), pure arithmetic.

What cp changes on one rank, per micro-batch of `tokens` whole-sequence tokens
(mb * seq): the rank holds tokens / cp of them (`local_tokens`), so every
per-token cost (the linear layers' FLOPs, activations, tp traffic, pipeline
messages) falls by cp; attention's FLOPs fall by cp too, each local query
still seeing the whole sequence, with the causal work balanced (the layout of
tessel.parallel.context.layout). Beyond that, per block:

- traffic (`cp_block_calls`). Ring: forward passes the key/value block cp - 1
  hops (k and v at their kv width, 2 x local tokens x kv width x act bytes);
  backward passes it cp - 1 hops again and its fp32 gradient cp hops (the
  last one home). Ulysses: forward all-to-alls q, k and v to the head split
  and the output back; backward the same four, each (n-1)/n of its bytes sent.
- the ring's hops overlap the blocks' attention (`ring_exposed`): each step's
  transfer hides behind the block computed meanwhile, a 1/cp share of the core.
- activations (`ring_kv_saving`): the ring's function saves k and v at kv
  width (grouped-query heads are repeated per block, not kept), where the
  single-device kernel saves them repeated to the query width;
  `ring_backward_bytes`: what its backward holds besides (its own kv block,
  the one arriving, the fp32 gradients of q, of the block, the one carried and
  the one arriving, and the kernel's repeated k, v and their gradients). They
  live while the block's attention runs backward, after its MLP half has run
  backward and freed what it saved (`mlp_half_bytes`): only what they exceed
  that by adds to the peak (measured, tests/parallel/context/test_memory.py).
"""

from __future__ import annotations

from tessel.config import compute_bytes, compute_dtype
from tessel.planner.traffic import Call


def local_tokens(tokens: int, cp: int) -> int:
    """Tokens of a micro-batch one cp rank holds."""
    return tokens // cp


def cp_block_calls(mode: str, cp: int, local: int, q_width: int, kv_width: int,
                   act_bytes: int) -> tuple[list[Call], list[Call]]:
    """(forward, backward) cp calls of one block on a rank holding `local` tokens; widths per tp rank
    (heads x head_dim)."""
    if cp <= 1:
        return [], []
    kv = 2 * local * kv_width * act_bytes
    if mode == "ring":
        return [Call("p2p", kv, cp - 1)], [Call("p2p", kv, cp - 1), Call("p2p", kv * 4 / act_bytes, cp)]
    q = local * q_width * act_bytes
    calls = [Call("all_to_all", q, 2), Call("all_to_all", kv / 2, 2)]  # q and the output, k and v
    return calls, calls


def ring_exposed(transfers_s: float, steps: int, core_s: float, cp: int) -> float:
    """Seconds of a block's ring transfers (transfers_s in all) that `steps` steps of the attention core do not
    hide (core_s: the rank's queries over the whole sequence; each step computes one block, 1/cp of it)."""
    return max(0.0, transfers_s - steps * core_s / cp)


def ring_kv_saving(local: int, q_width: int, kv_width: int, act_bytes: int) -> float:
    """Bytes a block saves less than the single-device attention: k and v kept at kv width, not repeated."""
    return 2 * local * (q_width - kv_width) * act_bytes


def mlp_half_bytes(tokens: int, d_model: int, ffn: int, tp: int, sp: bool, precision: str) -> float:
    """What a dense block's MLP half saves for backward (tessel.planner.memory.layer_activation_bytes' terms
    of the second norm and the SwiGLU): the norm's input, normalised input and rms, the matmuls' input (a
    bf16 copy for each of gate and up under autocast), gate, silu(gate), up and their product."""
    a = compute_bytes(precision)
    norm = (2 * d_model * 4 + 4) / (tp if sp else 1)
    matmul_input = 2 * d_model * 2 if compute_dtype(precision) == "bf16" else d_model * 4
    return tokens * (norm + matmul_input + 4 * ffn * a / tp)


def ring_backward_bytes(local: int, q_width: int, kv_width: int, act_bytes: int) -> float:
    """What a ring block's backward holds beyond the saved tensors (see the module's docstring)."""
    blocks = 2 * (2 * kv_width * act_bytes) + 3 * (2 * kv_width * 4)  # kv, the next; dkv, carried, arriving
    repeated = 2 * q_width * act_bytes if kv_width < q_width else 0  # k and v repeated for the kernel
    kernel = 3 * q_width * act_bytes  # the block's dq, dk, dv
    return local * (blocks + 4 * q_width + repeated + kernel)  # + dq accumulated in fp32
