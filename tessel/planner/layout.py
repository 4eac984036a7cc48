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
        "schedule": str, "v": int, "sp": bool, "recompute": bool}
ALIASES = {"zero_stage": "zero", "micro_batch": "mb", "micro_batches": "m", "grad_accum": "ga",
           "virtual_stages": "v", "sequence_parallel": "sp", "rc": "recompute"}


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
    recompute: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.ep

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
        parts = [f"{a}{getattr(self, a)}" for a in ("dp", "tp", "pp", "ep") if getattr(self, a) > 1] or ["dp1"]
        if self.pp > 1:
            parts.append(self.schedule + (f"(v{self.v})" if self.v > 1 else ""))
        parts.append(f"mb{self.mb}x{self.chunks}")
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.sp:
            parts.append("sp")
        if self.recompute:
            parts.append("recompute")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)

    def parallel_fields(self) -> dict:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "ep": self.ep, "zero_stage": self.zero,
                "micro_batches": self.m, "sequence_parallel": self.sp, "schedule": self.schedule,
                "virtual_stages": self.v, "recompute": self.recompute}


def parse_layout(text: str, global_batch: int | None = None) -> Layout:
    """'dp=2,tp=2,pp=2,mb=1' -> Layout. Missing micro-batch fields are derived from global_batch."""
    fields: dict = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise ConfigError("--layout", f"'{item}' is not key=value (keys: {', '.join(KEYS)})")
        key, raw = (s.strip() for s in item.split("=", 1))
        key = ALIASES.get(key, key)
        if key not in KEYS:
            raise ConfigError("--layout", f"unknown key '{key}' (keys: {', '.join(KEYS)})")
        fields[key] = _convert(key, raw)
    layout = Layout(**fields)
    if layout.pp > 1 and "m" not in fields and global_batch:
        per_shard = global_batch // layout.batch_shards
        layout = replace(layout, m=max(1, per_shard // (layout.mb * layout.ga)))
    if "ga" not in fields and global_batch:
        per_pipe = layout.mb * layout.m * layout.batch_shards
        if per_pipe and global_batch % per_pipe == 0:
            layout = replace(layout, ga=max(1, global_batch // per_pipe))
    if layout.v > 1 and "schedule" not in fields:
        layout = replace(layout, schedule="interleaved")
    return layout


def _convert(key: str, raw: str):
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
                  recompute=p.recompute)
