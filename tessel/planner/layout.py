"""A candidate parallel layout, its text form (`--layout dp=2,tp=2`), and its recipe form.

Semantics are those of tessel.config: the batch is sharded over dp*ep ranks;
global_batch = micro_batch * grad_accum * micro_batches * dp * ep; each of the
grad_accum accumulation steps runs a pipeline of `micro_batches`; without a
pipeline the runner simply splits the rank's batch into grad_accum *
micro_batches chunks.

A Layout's fields are the recipe's names (parallel.<name>, train.grad_accum;
micro_batch is what train.global_batch gives each micro-batch), with the
schema's help and choices; the short spellings `--layout` also takes (zero,
mb, m, ga, v, sp, rc, param_dtype) are ALIASES, resolved at parsing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Literal, get_args, get_origin

from tessel.config import Config, ConfigError, ParallelConfig, TrainConfig, build_config
from tessel.config.schema import recompute_named

# The one table of short `--layout` spellings (and tessel.parallelize's): resolved at parsing, read nowhere else.
ALIASES = {"zero": "zero_stage", "mb": "micro_batch", "m": "micro_batches", "ga": "grad_accum",
           "v": "virtual_stages", "sp": "sequence_parallel", "rc": "recompute", "param_dtype": "zero_param_dtype"}
# micro_batch is the one layout field no recipe names: a recipe gives train.global_batch, which it divides
MICRO_BATCH_HELP = "sequences per micro-batch (train.global_batch / (dp*ep*grad_accum*micro_batches))"


def _schema_field(key: str):
    """The config's field a layout field projects (parallel.<key>, or train.<key>); None for micro_batch."""
    for section in (ParallelConfig, TrainConfig):
        if key in section.model_fields:
            return section.model_fields[key]
    return None


def recompute_mode(value) -> str:
    """'none' | 'full' | 'selective' from what a recipe or --layout says (booleans keep their old meaning)."""
    mode = recompute_named(value)
    if mode not in CHOICES["recompute"]:
        named = ", ".join(CHOICES["recompute"])
        raise ConfigError("--layout", f"recompute={value}: expected one of {named} (or true/false)")
    return mode


@dataclass(frozen=True)
class Layout:
    """A frozen projection of a recipe's layout: ParallelConfig's fields of the same names, and
    train.grad_accum; micro_batch is what train.global_batch gives each micro-batch."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    micro_batch: int = 1
    micro_batches: int = 1
    grad_accum: int = 1
    zero_stage: int = 0
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    tp_overlap: bool = False
    recompute: str = "none"
    zero_param_dtype: str = "fp32"
    tp_mode: str = "1d"
    tp_depth: int = 1
    cp: int = 1
    cp_mode: str = "ring"

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
        return self.micro_batch * self.grad_accum * self.micro_batches * self.batch_shards

    @property
    def chunks(self) -> int:
        """Micro-batches each batch shard runs per optimizer step."""
        return self.grad_accum * self.micro_batches

    def describe(self) -> str:
        parts = [f"{a}{getattr(self, a)}" for a in ("dp", "tp", "pp", "ep", "cp") if getattr(self, a) > 1] or ["dp1"]
        if self.tp_mode != "1d":  # tp64(2d), tp32(2.5d,d2)
            parts = [p + f"({self.tp_mode}{f',d{self.tp_depth}' if self.tp_mode == '2.5d' else ''})"
                     if p == f"tp{self.tp}" else p for p in parts]
        if self.cp > 1 and self.cp_mode != "ring":
            parts[-1] += f"({self.cp_mode})"
        if self.pp > 1:
            parts.append(self.schedule + (f"(v{self.virtual_stages})" if self.virtual_stages > 1 else ""))
        parts.append(f"mb{self.micro_batch}x{self.chunks}")
        if self.zero_stage:
            parts.append(f"zero{self.zero_stage}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.tp_overlap:
            parts.append("overlap")
        if self.recompute != "none":
            parts.append("recompute" if self.recompute == "full" else "selective")
        if self.zero_param_dtype != "fp32":
            parts.append(self.zero_param_dtype)
        return " ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)

    def parallel_fields(self) -> dict:
        """The parallel section of the recipe that trains it: the fields it shares with ParallelConfig."""
        return {k: v for k, v in asdict(self).items() if k in ParallelConfig.model_fields}


# every field's value type, help (the config's description) and choices (the config's Literal), from the schema
KEYS = {f.name: type(f.default) for f in fields(Layout)}
KEY_HELP = {k: MICRO_BATCH_HELP if _schema_field(k) is None else _schema_field(k).description for k in KEYS}
CHOICES = {k: get_args(_schema_field(k).annotation) for k in KEYS
           if _schema_field(k) is not None and get_origin(_schema_field(k).annotation) is Literal}


def layout_text(lay: Layout) -> str:
    """The --layout text of a layout (parse_layout's inverse): the fields that differ from the defaults."""
    default = Layout()
    keys = [k for k in KEYS if getattr(lay, k) != getattr(default, k)]
    return ",".join(f"{k}={str(getattr(lay, k)).lower()}" for k in keys) or "dp=1"


def parse_layout(text: str, global_batch: int | None = None) -> Layout:
    """'dp=2,tp=2,pp=2,micro_batch=1' (or an alias: mb=1) -> Layout. Missing micro-batch fields are derived
    from global_batch."""
    given = _key_values(text, "--layout")
    return complete(Layout(**given), given, global_batch)


def complete(layout: Layout, given: dict, global_batch: int | None) -> Layout:
    """Derive the micro-batching fields `given` leaves out from the global batch."""
    if layout.pp > 1 and "micro_batches" not in given and global_batch:
        per_shard = global_batch // layout.batch_shards
        layout = replace(layout, micro_batches=max(1, per_shard // (layout.micro_batch * layout.grad_accum)))
    if "grad_accum" not in given and global_batch:
        per_pipe = layout.micro_batch * layout.micro_batches * layout.batch_shards
        if per_pipe and global_batch % per_pipe == 0:
            layout = replace(layout, grad_accum=max(1, global_batch // per_pipe))
    if layout.virtual_stages > 1 and "schedule" not in given:
        layout = replace(layout, schedule="interleaved")
    if layout.schedule == "zbv" and "virtual_stages" not in given:  # ZBV's V holds two stages a rank
        layout = replace(layout, virtual_stages=2)
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
            raise ConfigError(option, f"'{item}' is not key=value ({_known_keys()})")
        key, raw = (s.strip() for s in item.split("=", 1))
        key = ALIASES.get(key, key)
        if key not in KEYS:
            raise ConfigError(option, f"unknown key '{key}' ({_known_keys()})")
        try:
            out[key] = _convert(key, raw)
        except ConfigError as err:
            raise ConfigError(option, err.message) from None
    return out


def _known_keys() -> str:
    return f"keys: {', '.join(KEYS)}; aliases: {', '.join(f'{a}={k}' for a, k in ALIASES.items())}"


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
        if value < (0 if key == "zero_stage" else 1):
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
    raw["train"].update(global_batch=layout.global_batch, grad_accum=layout.grad_accum)
    if seq_len is not None:
        raw["train"]["seq_len"] = seq_len
    return build_config(raw)


def config_layout(cfg: Config) -> Layout:
    """The layout a recipe trains: the inverse of layout_config.

    A Layout has no pp_layout (the cost model balances layers over stages) and
    no parameter server (tessel.planner.fit prices dp_arch = "ps" itself).
    """
    p, t = cfg.parallel, cfg.train
    micro_batch = t.global_batch // (p.batch_shards * t.grad_accum * p.micro_batches)  # exact: check_layout divides
    shared = {k: getattr(p, k) for k in KEYS if k in ParallelConfig.model_fields}
    return Layout(**shared, micro_batch=micro_batch, grad_accum=t.grad_accum)
