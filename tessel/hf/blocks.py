"""The blocks transformers builds from a Hugging Face config.json, counted without transformers or torch.

The planner (tessel.planner.model_spec) prices parameters, their state and FLOPs, and the runtime's MFU
numerator (tessel.models.flops) counts the experts a token visits; both need what a family builds from its
config, and the planner may not import torch (importing transformers loads it). So the families' modules are
read here off their config keys, as transformers' modeling_<type>.py builds them (5.x):

- attention: grouped-query heads (num_key_value_heads, head_dim), q|k|v fused or not (the same weights),
  biases (attention_bias, Qwen2's q/k/v biases, GPT-NeoX's, Phi's), q/k norms per head (Qwen3, Gemma 3) or
  over all heads (OLMo 2), and multi-head latent attention (DeepSeek-V2/V3: q_lora_rank, kv_lora_rank, the
  nope and rope parts of a query/key head, v_head_dim);
- the feed-forward: gated (gate, up, down; Phi-3's gate|up fused) or plain (GPT-NeoX, Phi, StarCoder2);
- experts: routed experts and their top-k, shared experts (DeepSeek's n_shared_experts x moe_intermediate_size,
  Qwen2-MoE's shared_expert_intermediate_size and its gate), the dense layers among them (DeepSeek's
  first_k_dense_replace, Qwen-MoE's decoder_sparse_step and mlp_only_layers);
- norms per block (Gemma 2's four, OLMo 2's two after, Phi's and Cohere's one), RMSNorm or LayerNorm, a tied
  or untied head (with Phi's bias) and learned positions (GPT-2).

KNOWN names the model types whose counts tests/hf/test_hf_blocks.py checks against transformers' own model
built on the meta device; another type is read as a Llama-like decoder with whatever of the keys above its
config has, an estimate (`ModelBlocks.exact` says which).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessel.hf.shape import HFConfigError


@dataclass(frozen=True)
class Traits:
    """How a family departs from a Llama-like decoder (the defaults)."""
    gated: bool = True  # gate, up, down; False: two matrices (fc in, fc out)
    norm: int = 1  # parameters per feature of a norm: RMSNorm 1, LayerNorm 2, OLMo's parameter-free LayerNorm 0
    block_norms: int = 2  # norms per decoder block
    qk_norm: str = ""  # "head": q_norm and k_norm over head_dim; "width": over all heads; "": none
    qkv_bias: str | bool = "attention_bias"  # the config key that turns q/k/v biases on, or a constant
    out_bias: str | bool = "attention_bias"  # the attention output projection's bias
    mlp_bias: str | bool = "mlp_bias"
    head_bias: bool = False  # the output head's bias (Phi)
    positions: str = ""  # the config key of a learned position table's length (GPT-2)


LLAMA = Traits()
QK_HEAD, QK_WIDTH = Traits(qk_norm="head"), Traits(qk_norm="width")
KNOWN: dict[str, Traits] = {
    # Llama-like: what the defaults say (Phi-3's and GLM's fused q|k|v or gate|up hold the same weights)
    **{kind: LLAMA for kind in ("llama", "mistral", "mixtral", "granite", "granitemoe", "granitemoeshared",
                                "gemma", "helium", "internlm3", "ministral3", "smollm3", "vaultgemma", "phi3",
                                "ernie4_5", "iquestcoder", "youtu", "glm4_moe",
                                "deepseek_v2", "deepseek_v3", "minicpm3",  # these three: latent attention
                                # experts under other names (tessel.hf.blocks.EXPERTS, SHARED_EXPERTS, TOP_K)
                                "aria_text", "glm4_moe_lite")},
    **{kind: QK_HEAD for kind in ("qwen3", "qwen3_moe", "exaone4")},
    **{kind: QK_WIDTH for kind in ("olmo2", "olmo3", "olmoe", "flex_olmo", "minimax_m2")},
    "qwen2": Traits(qkv_bias=True, out_bias=False),
    "qwen2_moe": Traits(qkv_bias="qkv_bias", out_bias=False),
    "glm": Traits(out_bias=False),
    "glm4": Traits(out_bias=False, block_norms=4),
    "seed_oss": Traits(out_bias="attention_out_bias"),
    "gemma2": Traits(block_norms=4), "gemma3_text": Traits(block_norms=4, qk_norm="head"),
    "olmo": Traits(norm=0),
    "cohere": Traits(block_norms=1), "cohere2": Traits(block_norms=1),  # attention and MLP in parallel
    "phimoe": Traits(norm=2),
    "gpt_neox": Traits(gated=False, norm=2, mlp_bias=True),
    "starcoder2": Traits(gated=False, norm=2, qkv_bias="use_bias", out_bias="use_bias", mlp_bias="use_bias"),
    "phi": Traits(gated=False, norm=2, block_norms=1, qkv_bias=True, out_bias=True, mlp_bias=True,
                  head_bias=True),
    "gpt2": Traits(gated=False, norm=2, qkv_bias=True, out_bias=True, mlp_bias=True, positions="n_positions"),
}
# What a key means when a config.json leaves it out: the family's config class's default
# (transformers/models/<type>/configuration_<type>.py) where it differs from GENERIC's; tests/hf/test_hf_blocks.py
# checks both against the classes. head_dim: where the class fixes it (else heads divide hidden_size).
GENERIC = {"tie_word_embeddings": False, "attention_bias": False, "qkv_bias": False, "use_bias": False,
           "attention_out_bias": False, "mlp_bias": False, "decoder_sparse_step": 1, "first_k_dense_replace": 0,
           "num_experts_per_tok": 2, "n_shared_experts": 0, "shared_expert_intermediate_size": 0,
           "mlp_only_layers": [], "q_lora_rank": None, "head_dim": None}
TIED = {"tie_word_embeddings": True}
DEFAULTS: dict[str, dict] = {
    **{kind: TIED for kind in ("cohere", "cohere2", "gpt2", "smollm3")},
    **{kind: {**TIED, "head_dim": 256} for kind in ("gemma", "gemma2", "gemma3_text", "vaultgemma")},
    **{kind: {"head_dim": 128} for kind in ("helium", "internlm3", "iquestcoder", "ministral3", "qwen3")},
    "ernie4_5": {**TIED, "head_dim": 128},
    "glm": {"attention_bias": True, "head_dim": 128}, "glm4": {"attention_bias": True, "head_dim": 128},
    "seed_oss": {"attention_bias": True, "head_dim": 128},
    "gpt_neox": {"attention_bias": True},
    "starcoder2": {**TIED, "use_bias": True},
    "deepseek_v2": {"n_shared_experts": 2, "q_lora_rank": 1536},
    "deepseek_v3": {"first_k_dense_replace": 3, "num_experts_per_tok": 8, "n_shared_experts": 1,
                    "q_lora_rank": 1536},
    "glm4_moe": {"first_k_dense_replace": 1, "num_experts_per_tok": 8, "n_shared_experts": 1},
    "minicpm3": {**TIED, "q_lora_rank": 768}, "youtu": {**TIED, "q_lora_rank": 1536},
    "minimax_m2": {"num_experts_per_tok": 8, "head_dim": 128},
    "flex_olmo": {"num_experts_per_tok": 5}, "olmoe": {"num_experts_per_tok": 8},
    "qwen3_moe": {"num_experts_per_tok": 8},
    "qwen2_moe": {"qkv_bias": True, "num_experts_per_tok": 4, "shared_expert_intermediate_size": 5632},
}
# the keys a family names its sizes by, first found wins (GPT-2's own names last)
HIDDEN = ("hidden_size", "n_embd")
LAYERS = ("num_hidden_layers", "n_layer")
HEADS = ("num_attention_heads", "n_head")
EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K = ("moe_k", "moe_topk", "num_experts_per_tok")  # the generic name last: GENERIC gives it a default
SHARED_EXPERTS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")  # each of the experts' width
SHARED_WIDTH = ("shared_expert_intermediate_size", "shared_intermediate_size")  # one shared MLP of this width
DENSE_LAYERS = ("first_k_dense_replace", "num_dense_layers")  # the first layers' MLPs are dense


@dataclass(frozen=True)
class FeedForward:
    d_model: int
    width: int  # hidden width of one MLP (of one expert)
    matrices: int  # 3 gated, 2 plain
    biases: int

    @property
    def matrix_params(self) -> int:
        return self.matrices * self.d_model * self.width

    @property
    def params(self) -> int:
        return self.matrix_params + self.biases


@dataclass(frozen=True)
class Experts:
    count: int
    top_k: int
    expert: FeedForward  # one routed expert
    router: int  # the router's weights (d_model x count)
    shared: FeedForward | None = None  # computed for every token beside the routed ones
    shared_gate: int = 0  # Qwen2-MoE's sigmoid gate on the shared expert (d_model x 1)

    @property
    def dense_params(self) -> int:
        """What every rank of an ep group holds: the router and the shared experts."""
        return self.router + (self.shared.params if self.shared else 0) + self.shared_gate

    @property
    def matmul_params_per_token(self) -> int:
        """Weights one token multiplies: the router, its top_k experts, the shared experts."""
        shared = self.shared.matrix_params if self.shared else 0
        return self.router + self.top_k * self.expert.matrix_params + shared + self.shared_gate


@dataclass(frozen=True)
class Attention:
    # (in, out, which side the heads are on) of every weight a token multiplies, in order: "out" for the
    # projections into heads (q, k, v), "in" for the one out of them (o), "" for a latent's (split by no head)
    projections: tuple[tuple[int, int, str], ...]
    vectors: int  # biases and norms inside the attention
    heads: int
    kv_heads: int  # key/value heads (multi-head latent attention: as many as heads once expanded)
    qk_dim: int  # a query/key head's width: the scores' contraction
    v_dim: int  # a value head's width
    latent: bool = False  # multi-head latent attention (its projections are not q, k, v, o)

    @property
    def matrix_params(self) -> int:
        return sum(i * o for i, o, _ in self.projections)

    @property
    def params(self) -> int:
        return self.matrix_params + self.vectors

    @property
    def tp_whole_params(self) -> int:
        """What every tp rank holds whole: a latent attention's low-rank down projections (side "") and its norms
        and biases (tessel.hf.layout runs them before the split by heads, on every rank)."""
        return sum(i * o for i, o, side in self.projections if not side) + (self.vectors if self.latent else 0)

    def gemms(self, tp: int) -> tuple[tuple[int, int], ...]:
        """(out, in) of each projection on one of tp ranks that split the heads."""
        return tuple((o // tp if side == "out" else o, i // tp if side == "in" else i)
                     for i, o, side in self.projections)


@dataclass(frozen=True)
class Block:
    attention: Attention
    norms: int  # the block's norm parameters
    mlp: FeedForward | None = None  # a dense block's feed-forward
    experts: Experts | None = None  # an MoE block's

    @property
    def params(self) -> tuple[int, int]:
        """(dense, expert) parameters: experts are what ep shards; the router and shared experts are dense."""
        dense = self.attention.params + self.norms
        if self.experts is None:
            return dense + self.mlp.params, 0
        return dense + self.experts.dense_params, self.experts.count * self.experts.expert.params

    @property
    def matmul_params_per_token(self) -> int:
        ffn = self.experts.matmul_params_per_token if self.experts else self.mlp.matrix_params
        return self.attention.matrix_params + ffn


@dataclass(frozen=True)
class ModelBlocks:
    model_type: str
    d_model: int
    vocab_size: int
    blocks: tuple[Block, ...]
    embedding: int  # token (and learned position) tables
    final_norm: int
    head: int  # the output head's own parameters: 0 when tied to the embedding
    exact: bool  # a KNOWN family (counts checked against transformers); else a Llama-like estimate
    notes: tuple[str, ...] = field(default=())

    @property
    def total_params(self) -> int:
        return sum(sum(b.params) for b in self.blocks) + self.embedding + self.final_norm + self.head


def _first(doc: dict, keys: tuple[str, ...], default=None):
    return next((doc[k] for k in keys if doc.get(k) is not None), default)


def _any(doc: dict, keys: tuple[str, ...]) -> int:
    """The first of `keys` set to a count other than 0 (GENERIC sets the first name to 0), else 0."""
    return next((doc[k] for k in keys if doc.get(k)), 0)


def _flag(doc: dict, switch: str | bool) -> bool:
    return switch if isinstance(switch, bool) else bool(doc.get(switch, False))


def read_model(doc: dict) -> ModelBlocks:
    """The blocks transformers builds for the config `doc` (a config.json's contents); HFConfigError names
    what cannot be read (a size missing, or not a number)."""
    try:
        return _read(doc)
    except (KeyError, TypeError, ValueError) as err:
        raise HFConfigError(f"cannot read the blocks of a '{doc.get('model_type')}' config: "
                            f"{type(err).__name__}: {err}") from None


def _read(doc: dict) -> ModelBlocks:
    kind = doc["model_type"]
    doc = {**GENERIC, **DEFAULTS.get(kind, {}), **doc}  # what the config class means by a key left out
    traits = KNOWN.get(kind, LLAMA)
    d = int(_first(doc, HIDDEN))
    norm = d * traits.norm
    attention = _attention(doc, traits, d)
    blocks = tuple(Block(attention, traits.block_norms * norm, *_feed_forward(doc, traits, d, i))
                   for i in range(int(_first(doc, LAYERS))))
    vocab = int(doc["vocab_size"])
    positions = int(doc.get(traits.positions) or 0) if traits.positions else 0
    tied = bool(doc["tie_word_embeddings"])
    head = 0 if tied else vocab * d + (vocab if traits.head_bias else 0)
    return ModelBlocks(kind, d, vocab, blocks, (vocab + positions) * d, norm, head, kind in KNOWN)


def _attention(doc: dict, t: Traits, d: int) -> Attention:
    heads = int(_first(doc, HEADS))
    if doc.get("kv_lora_rank"):
        return _latent_attention(doc, d, heads)
    kv = int(doc.get("num_key_value_heads") or heads)
    hd = doc.get("head_dim") if isinstance(doc.get("head_dim"), int) else d // heads
    q, k = heads * hd, kv * hd
    biases = (q + 2 * k if _flag(doc, t.qkv_bias) else 0) + (d if _flag(doc, t.out_bias) else 0)
    norms = {"head": 2 * hd, "width": q + k}.get(t.qk_norm, 0)
    return Attention(((d, q, "out"), (d, k, "out"), (d, k, "out"), (q, d, "in")), biases + norms, heads, kv, hd, hd)


def _latent_attention(doc: dict, d: int, heads: int) -> Attention:
    """DeepSeek-V2/V3's multi-head latent attention: queries through a low-rank pair (or one projection),
    keys and values from one compressed latent (plus a shared rotary key), each latent normed."""
    q_rank, kv_rank = doc.get("q_lora_rank"), int(doc["kv_lora_rank"])
    nope, rope, v = int(doc["qk_nope_head_dim"]), int(doc["qk_rope_head_dim"]), int(doc["v_head_dim"])
    bias = bool(doc.get("attention_bias", False))
    qk = nope + rope
    if q_rank:
        queries = ((d, q_rank, ""), (q_rank, heads * qk, "out"))
        vectors = q_rank + (q_rank if bias else 0)  # q_a_layernorm; q_a_proj's bias
    else:
        queries, vectors = ((d, heads * qk, "out"),), 0
    projections = queries + ((d, kv_rank + rope, ""), (kv_rank, heads * (nope + v), "out"), (heads * v, d, "in"))
    vectors += kv_rank + ((kv_rank + rope) + d if bias else 0)  # kv_a_layernorm; kv_a and o biases
    return Attention(projections, vectors, heads, heads, qk, v, latent=True)


def _feed_forward(doc: dict, t: Traits, d: int, layer: int) -> tuple[FeedForward | None, Experts | None]:
    """(a dense feed-forward, None) or (None, the experts) of decoder block `layer`."""
    matrices = 3 if t.gated else 2
    bias = _flag(doc, t.mlp_bias)

    def mlp(width: int) -> FeedForward:
        return FeedForward(d, width, matrices, ((matrices - 1) * width + d) if bias else 0)

    dense_width = int(_first(doc, ("intermediate_size", "n_inner"), 0) or 4 * d)
    count = int(_first(doc, EXPERTS, 0))
    if not count or not _is_moe(doc, layer):
        return mlp(dense_width), None
    width = int(doc.get("moe_intermediate_size") or dense_width)
    shared, gate = None, 0
    if _any(doc, SHARED_EXPERTS):
        shared = mlp(width * int(_any(doc, SHARED_EXPERTS)))
    elif _any(doc, SHARED_WIDTH):
        shared, gate = mlp(int(_any(doc, SHARED_WIDTH))), d
    top_k = int(_first(doc, TOP_K, 2))
    return None, Experts(count, top_k, mlp(width), d * count, shared, gate)


def _is_moe(doc: dict, layer: int) -> bool:
    """Each layer's kind where the config lists them (mlp_layer_types: "dense" or "sparse"), else DeepSeek's first
    dense layers, Qwen-MoE's sparse step and dense-only layers."""
    kinds = doc.get("mlp_layer_types")
    if isinstance(kinds, list) and len(kinds) > layer:
        return kinds[layer] != "dense"
    if layer < int(_any(doc, DENSE_LAYERS)) or layer in (doc.get("mlp_only_layers") or ()):
        return False
    return (layer + 1) % int(doc.get("decoder_sparse_step") or 1) == 0
