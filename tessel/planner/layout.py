"""A candidate parallel layout, its text form (`--layout dp=2,tp=2`), and its recipe form.

Semantics are those of tessel.config: the batch is sharded over dp*ep ranks;
global_batch = micro_batch * grad_accum * micro_batches * dp * ep; each of the
grad_accum accumulation steps runs a pipeline of `micro_batches`; without a
pipeline the runner simply splits the rank's batch into grad_accum *
micro_batches chunks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from tessel.config import Config, ConfigError, build_config

KEYS = {"dp": int, "tp": int, "pp": int, "ep": int, "zero": int, "mb": int, "m": int, "ga": int,
        "schedule": str, "v": int, "sp": bool, "recompute": str, "param_dtype": str, "tp_mode": str,
        "tp_depth": int, "cp": int, "cp_mode": str}
ALIASES = {"zero_stage": "zero", "micro_batch": "mb", "micro_batches": "m", "grad_accum": "ga",
           "virtual_stages": "v", "sequence_parallel": "sp", "rc": "recompute", "zero_param_dtype": "param_dtype"}
# what each key means, for `tessel plan --help` and the errors below
KEY_HELP = {
    "dp": "data-parallel degree", "tp": "tensor-parallel degree (inside a node)", "pp": "pipeline stages",
    "ep": "expert-parallel degree (MoE)", "zero": "ZeRO stage 0-3 over dp x ep (x cp)",
    "cp": "context-parallel degree: each sequence split over cp ranks (inside a node)",
    "cp_mode": "ring | ulysses: how cp computes attention",
    "mb": "sequences per micro-batch", "m": "micro-batches per pipeline flush",
    "ga": "accumulation steps per optimizer step",
    "schedule": "gpipe | 1f1b | interleaved | zb-h1 | zb-h2 | zbv | 2bw | pipedream (2bw, pipedream: the recipe "
                "needs parallel.allow_async = true)",
    "v": "virtual stages per pipeline rank (interleaved; zbv: 2)", "sp": "sequence parallelism (true/false)",
    "recompute": "none | full | selective (true = full, false = none)",
    "param_dtype": "fp32 | bf16: ZeRO's parameter storage (bf16 needs zero >= 1 and pp = 1)",
    "tp_mode": "1d | 2d | 2.5d | 3d: the tp group as Megatron's, a q x q grid, q x q x tp_depth, a cube",
    "tp_depth": "2.5d: the grid's depth d (tp = q*q*d)",
}
CHOICES = {"schedule": ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "2bw", "pipedream"),
           "recompute": ("none", "full", "selective"),
           "param_dtype": ("fp32", "bf16"), "tp_mode": ("1d", "2d", "2.5d", "3d"), "cp_mode": ("ring", "ulysses")}
RECOMPUTE = {True: "full", False: "none", "true": "full", "false": "none", "1": "full", "0": "none",
             "yes": "full", "no": "none", "on": "full", "off": "none"}


def recompute_mode(value) -> str:
    """'none' | 'full' | 'selective' from what a recipe or --layout says (booleans keep their old meaning)."""
    mode = RECOMPUTE.get(value.lower() if isinstance(value, str) else value, value)
    if mode not in CHOICES["recompute"]:
        raise ConfigError("--layout", f"recompute={value}: expected one of none, full, selective (or true/false)")
    return mode


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    mb: int = 1  # sequences per micro-batch
    m: int = 1  # micro-batches per pipeline flush (parallel.micro_batches)
    ga: int = 1  # accumulation steps per optimizer step (train.grad_accum)
    schedule: str = "1f1b"
    v: int = 1  # virtual stages (interleaved)
    sp: bool = False
    recompute: str = "none"  # none | full (every block) | selective (the attention core, Korthikanti et al. 2022)
    param_dtype: str = "fp32"  # ZeRO's parameter storage (parallel.zero_param_dtype): fp32 or bf16
    tp_mode: str = "1d"  # 1d (Megatron) | 2d | 2.5d | 3d: the tp group as a grid (tessel.planner.grid_cost)
    tp_depth: int = 1  # 2.5d: the grid's depth
    cp: int = 1  # context parallelism: each sequence in chunks over cp ranks (tessel.parallel.context)
    cp_mode: str = "ring"  # ring attention or Ulysses' all-to-all (parallel.cp_mode)

    def __post_init__(self):
        object.__setattr__(self, "recompute", recompute_mode(self.recompute))  # True/False: full/none

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.ep * self.cp

    @property
    def axis_sizes(self) -> dict[str, int]:
        """Every mesh axis's degree (tessel.axes), as ParallelConfig.axis_sizes gives a recipe's."""
        return {"pp": self.pp, "dp": self.dp, "ep": self.ep, "cp": self.cp, "tp": self.tp}

    @property
    def token_shards(self) -> int:
        """Ranks that see different tokens of a step (dp x ep x cp): losses and replicated gradients are
        averaged over them, and ZeRO shards over them."""
        return self.dp * self.ep * self.cp

    @property
    def batch_shards(self) -> int:
        return self.dp * self.ep

    @property
    def global_batch(self) -> int:
        return self.mb * self.ga * self.m * self.batch_shards

    @property
    def chunks(self) -> int:
        """Micro-batches each batch shard runs per optimizer step."""
        return self.ga * self.m

    def describe(self) -> str:
        parts = [f"{a}{getattr(self, a)}" for a in ("dp", "tp", "pp", "ep", "cp") if getattr(self, a) > 1] or ["dp1"]
        if self.tp_mode != "1d":  # tp64(2d), tp32(2.5d,d2)
            parts = [p + f"({self.tp_mode}{f',d{self.tp_depth}' if self.tp_mode == '2.5d' else ''})"
                     if p == f"tp{self.tp}" else p for p in parts]
        if self.cp > 1 and self.cp_mode != "ring":
            parts[-1] += f"({self.cp_mode})"
        if self.pp > 1:
            parts.append(self.schedule + (f"(v{self.v})" if self.v > 1 else ""))
        parts.append(f"mb{self.mb}x{self.chunks}")
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.sp:
            parts.append("sp")
        if self.recompute != "none":
            parts.append("recompute" if self.recompute == "full" else "selective")
        if self.param_dtype != "fp32":
            parts.append(self.param_dtype)
        return " ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)

    def parallel_fields(self) -> dict:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "ep": self.ep, "zero_stage": self.zero,
                "micro_batches": self.m, "sequence_parallel": self.sp, "schedule": self.schedule,
                "virtual_stages": self.v, "recompute": self.recompute, "zero_param_dtype": self.param_dtype,
                "tp_mode": self.tp_mode, "tp_depth": self.tp_depth, "cp": self.cp, "cp_mode": self.cp_mode}


def layout_text(lay: Layout) -> str:
    """The --layout text of a layout (parse_layout's inverse): the fields that differ from the defaults."""
    default = Layout()
    keys = [k for k in ("dp", "tp", "pp", "ep", "mb", "m", "ga", "zero", "schedule", "v", "sp", "recompute",
                        "param_dtype", "tp_mode", "tp_depth", "cp", "cp_mode") if getattr(lay, k) != getattr(default, k)]
    return ",".join(f"{k}={str(getattr(lay, k)).lower()}" for k in keys) or "dp=1"


def parse_layout(text: str, global_batch: int | None = None) -> Layout:
    """'dp=2,tp=2,pp=2,mb=1' -> Layout. Missing micro-batch fields are derived from global_batch."""
    fields = _key_values(text, "--layout")
    return complete(Layout(**fields), fields, global_batch)


def complete(layout: Layout, given: dict, global_batch: int | None) -> Layout:
    """Derive the micro-batching fields `given` leaves out from the global batch."""
    if layout.pp > 1 and "m" not in given and global_batch:
        per_shard = global_batch // layout.batch_shards
        layout = replace(layout, m=max(1, per_shard // (layout.mb * layout.ga)))
    if "ga" not in given and global_batch:
        per_pipe = layout.mb * layout.m * layout.batch_shards
        if per_pipe and global_batch % per_pipe == 0:
            layout = replace(layout, ga=max(1, global_batch // per_pipe))
    if layout.v > 1 and "schedule" not in given:
        layout = replace(layout, schedule="interleaved")
    if layout.schedule == "zbv" and "v" not in given:  # ZBV's V holds two stages a rank
        layout = replace(layout, v=2)
    return layout


def parse_fix(text: str) -> dict:
    """'tp=8,recompute=selective' -> {"tp": 8, "recompute": "selective"}: layout fields pinned while the
    search chooses the rest (`tessel plan --fix`)."""
    return _key_values(text, "--fix")


def _key_values(text: str, option: str) -> dict:
    """'k=v,k=v' -> {key: converted value}, aliases resolved; a ConfigError names `option`."""
    out: dict = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise ConfigError(option, f"'{item}' is not key=value (keys: {', '.join(KEYS)})")
        key, raw = (s.strip() for s in item.split("=", 1))
        key = ALIASES.get(key, key)
        if key not in KEYS:
            raise ConfigError(option, f"unknown key '{key}' (keys: {', '.join(KEYS)})")
        try:
            out[key] = _convert(key, raw)
        except ConfigError as err:
            raise ConfigError(option, err.message) from None
    return out


def _convert(key: str, raw: str):
    if key == "recompute":
        return recompute_mode(raw)
    if key in CHOICES and raw not in CHOICES[key]:
        raise ConfigError("--layout", f"{key}={raw}: expected one of {', '.join(CHOICES[key])}")
    kind = KEYS[key]
    if kind is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError("--layout", f"{key}={raw}: expected true/false")
    if kind is int:
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError("--layout", f"{key}={raw}: expected an integer") from None
        if value < (0 if key == "zero" else 1):
            raise ConfigError("--layout", f"{key}={raw}: out of range")
        return value
    return raw


def layout_config(base: Config, layout: Layout, seq_len: int | None = None) -> Config:
    """The recipe that trains `layout`: base config with the parallel and batch fields replaced.

    Goes through build_config, so every rule of tessel.config (divisibility,
    heads per tp rank, stages per layer ...) is checked and reported by field.
    """
    raw = base.model_dump(exclude_none=True)
    raw["parallel"].update(layout.parallel_fields())
    raw["train"].update(global_batch=layout.global_batch, grad_accum=layout.ga)
    if seq_len is not None:
        raw["train"]["seq_len"] = seq_len
    return build_config(raw)


def config_layout(cfg: Config) -> Layout:
    """The layout a recipe trains: the inverse of layout_config.

    A Layout has no pp_layout (the cost model balances layers over stages) and
    no parameter server (tessel.planner.fit prices dp_arch = "ps" itself).
    """
    p, t = cfg.parallel, cfg.train
    mb = t.global_batch // (p.batch_shards * t.grad_accum * p.micro_batches)  # exact: check_layout divides
    return Layout(dp=p.dp, tp=p.tp, pp=p.pp, ep=p.ep, zero=p.zero_stage, mb=mb, m=p.micro_batches,
                  ga=t.grad_accum, schedule=p.schedule, v=p.virtual_stages, sp=p.sequence_parallel,
                  recompute=p.recompute, param_dtype=p.zero_param_dtype, tp_mode=p.tp_mode, tp_depth=p.tp_depth,
                  cp=p.cp, cp_mode=p.cp_mode)
