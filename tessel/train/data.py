"""Token sources and a resumable, layout-independent batch sampler.

Sources:
- `stdlib`: the Python standard library's own .py files as byte tokens, a real
  corpus every machine has. Files are split into train/validation by a hash of
  their path, so the split is the same everywhere and no file is in both.
  With `data.tokenizer` the corpus is tokenized once (cached beside it); with
  `stdlib-bpe-N` that tokenizer is tessel's byte-level BPE of N ids, trained
  on the corpus's first BPE_TRAIN_BYTES (tessel.train.tokenizer), built on
  demand and cached.
- `bin`: nanoGPT-style memory-mapped uint16 token files (train.bin, val.bin).
- `synthetic`: a fixed random Markov chain, learnable and tiny, for tests.

The sampler draws the *global* batch of step s from a generator seeded by
(seed, s) and hands each data-parallel shard its slice. So the batch of a step
depends on neither the layout nor the history: the single-process reference
sees exactly the union of what the ranks see, and resuming needs only the step.

`validate_data` checks a recipe's data before any rank starts (files, lengths,
the largest id against the vocabulary, cached beside a .bin file); the sampler
checks each batch's ids again for library users who build it themselves.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tessel.config import Config, ConfigError, DataConfig, ModelConfig, builtin_bpe_vocab
from tessel.parallel.data.uneven import rows
from tessel.train.tokenizer import (EOT, ByteCodec, Codec, TokenizerError, encode_file, read_tokenizer, token_dtype,
                                    train_bpe)


def cache_dir() -> Path:
    root = os.environ.get("TESSEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tessel")
    return Path(root)


def _atomic_write(path: Path, data: np.ndarray) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    data.tofile(tmp)
    os.replace(tmp, path)  # concurrent builders race harmlessly: each writes the same bytes


def build_stdlib_corpus(max_bytes: int, val_fraction: float) -> tuple[Path, Path]:
    """Concatenate the stdlib's .py files (site-packages excluded) into train/val byte files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    tag = f"{zlib.crc32(str(root).encode()):08x}-{max_bytes}-{val_fraction}"
    out = cache_dir() / f"stdlib-{tag}"
    train_path, val_path = out / "train.u8", out / "val.u8"
    if train_path.exists() and val_path.exists():
        return train_path, val_path
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    total = 0
    for path in files:
        rel = str(path.relative_to(root))
        split = "val" if (zlib.crc32(rel.encode()) % 10_000) < val_fraction * 10_000 else "train"
        try:
            text = path.read_bytes()
        except OSError:
            continue
        parts[split].append(text)
        total += len(text)
        if total >= max_bytes:
            break
    for split, path in (("train", train_path), ("val", val_path)):
        _atomic_write(path, np.frombuffer(b"".join(parts[split]), dtype=np.uint8))
    return train_path, val_path


# ---- tokenizers ---------------------------------------------------------------------------------
BPE_TRAIN_BYTES = 8_000_000  # the stdlib text tessel's BPE learns from: ~2 s, whatever data.max_bytes is
BPE_VAL_FRACTION = 0.05  # ... its training split at DataConfig's default


def tokenizer_file(d: DataConfig) -> Path | None:
    """data.tokenizer's tokenizer.json (tessel's stdlib BPE built and cached on first use); None for bytes."""
    vocab = builtin_bpe_vocab(d.tokenizer)
    if vocab is None:
        return None if d.tokenizer is None else Path(d.tokenizer)
    text, _ = build_stdlib_corpus(BPE_TRAIN_BYTES, BPE_VAL_FRACTION)
    out = cache_dir() / "tokenizers" / f"stdlib-bpe-{vocab}-{text.parent.name}.json"
    return out if out.exists() else train_bpe(text, vocab, out)


def text_codec(d: DataConfig) -> Codec:
    """How the run's text becomes ids and back: data.tokenizer's, or bytes."""
    path = tokenizer_file(d)
    return ByteCodec() if path is None else read_tokenizer(path)


def tokenized_stdlib(d: DataConfig) -> tuple[Path, Path]:
    """The stdlib corpus's train/val splits as uint16 ids of data.tokenizer, tokenized once and cached
    beside the corpus under the tokenizer's sha256."""
    train_text, val_text = build_stdlib_corpus(d.max_bytes, d.val_fraction)
    path = tokenizer_file(d)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    out = [train_text.with_name(f"{split}-{digest}.u16") for split in ("train", "val")]
    if all(p.exists() for p in out):
        return out[0], out[1]
    codec = read_tokenizer(path)
    for text, ids in zip((train_text, val_text), out):
        encode_file(codec, text, ids)
    return out[0], out[1]


def synthetic_tokens(vocab_size: int, n_tokens: int, seed: int = 0) -> np.ndarray:
    """A first-order Markov chain where each token has 4 likely successors."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab_size, size=(vocab_size, 4))
    choice = rng.integers(0, 4, size=n_tokens)
    noise = rng.random(n_tokens) < 0.05
    random_tok = rng.integers(0, vocab_size, size=n_tokens)
    out = np.empty(n_tokens, dtype=np.int64)
    out[0] = 0
    for i in range(1, n_tokens):
        out[i] = random_tok[i] if noise[i] else successors[out[i - 1], choice[i]]
    return out


@dataclass
class TokenData:
    train: np.ndarray
    val: np.ndarray


SYNTHETIC_TOKENS = 100_000


def load_tokens(cfg: DataConfig, vocab_size: int, seed: int = 0) -> TokenData:
    if cfg.source == "stdlib" and cfg.tokenizer is not None:
        train_path, val_path = tokenized_stdlib(cfg)
        return TokenData(np.memmap(train_path, dtype=np.uint16, mode="r"),
                         np.memmap(val_path, dtype=np.uint16, mode="r"))
    if cfg.source == "stdlib":
        train_path, val_path = build_stdlib_corpus(cfg.max_bytes, cfg.val_fraction)
        return TokenData(np.memmap(train_path, dtype=np.uint8, mode="r"),
                         np.memmap(val_path, dtype=np.uint8, mode="r"))
    if cfg.source == "bin":
        train = np.memmap(cfg.path, dtype=np.uint16, mode="r")
        val_path = val_bin(Path(cfg.path))
        if val_path is not None:
            return TokenData(train, np.memmap(val_path, dtype=np.uint16, mode="r"))
        cut = split_point(len(train), cfg.val_fraction)
        return TokenData(train[:cut], train[cut:])
    tokens = synthetic_tokens(vocab_size, SYNTHETIC_TOKENS, seed)
    cut = split_point(len(tokens), cfg.val_fraction)
    return TokenData(tokens[:cut], tokens[cut:])


def val_bin(train_path: Path) -> Path | None:
    """The validation file of a `bin` source: a sibling val.bin, or None (split the train file)."""
    val_path = train_path.with_name("val.bin")
    return val_path if val_path.exists() and val_path != train_path else None


def split_point(n_tokens: int, val_fraction: float) -> int:
    """Tokens before the cut train, the rest validate."""
    return int(n_tokens * (1 - val_fraction))


# ---- validation, before any rank starts -------------------------------------------------

def validate_data(cfg: Config) -> None:
    """Check the token data against the model and the batch shape before spawning.

    Every split must hold more than train.seq_len + 1 tokens (BatchSampler draws
    windows of seq_len + 1), and every id must be below model.vocab_size: past
    it, tp=1 dies in the embedding with an IndexError naming nothing, and the
    vocab-parallel embedding of tp>1 masks the id and trains on a wrong loss.
    Raises ConfigError naming the field and the file.
    """
    d = cfg.data
    if d.tokenizer is not None:
        _check_tokenizer_fits(d, cfg.model)
    if d.source == "bin":
        splits = _bin_splits(d)
    elif d.source == "stdlib" and d.tokenizer is not None:
        train, val = tokenized_stdlib(d)
        splits = [(f"the stdlib corpus tokenized by {d.tokenizer} ({train}, data.max_bytes = {d.max_bytes})",
                   train.stat().st_size // 2),
                  (f"its validation split ({val}, data.val_fraction = {d.val_fraction})", val.stat().st_size // 2)]
    elif d.source == "stdlib":
        splits = _stdlib_splits(d, cfg.model.vocab_size)
    else:  # ids come from rng.integers(0, vocab_size) in synthetic_tokens: below it by construction
        cut = split_point(SYNTHETIC_TOKENS, d.val_fraction)
        splits = [("the synthetic data's training split", cut),
                  (f"the synthetic data's validation split (data.val_fraction = {d.val_fraction})",
                   SYNTHETIC_TOKENS - cut)]
    for what, n_tokens in splits:
        _require_windows(what, n_tokens, cfg.train.seq_len)
    if d.source == "bin":
        for path in filter(None, (Path(d.path), val_bin(Path(d.path)))):
            _require_ids_below(path, cfg.model.vocab_size)


def _check_tokenizer_fits(d: DataConfig, m: ModelConfig) -> None:
    """data.tokenizer reads, fits uint16 ids, has no id the model's vocabulary lacks, and, with packed documents,
    ends its documents with model.document_separator.

    A separator other than the tokenizer's <|endoftext|> (the id `tessel data prepare` ends every document
    with) is refused, not warned about: the run would mask attention at some other token, cutting documents
    where none ends and leaving the real boundaries open, and its loss would look like any other run's; a
    warning scrolls past in a multi-rank log, and the fix is one field. A tokenizer without <|endoftext|> says
    nothing about where documents end (the data may mark them with a token of its own): any separator goes."""
    try:
        codec = text_codec(d)
        n = codec.vocab_size
        token_dtype(n)
    except TokenizerError as err:
        raise ConfigError("data.tokenizer", str(err)) from None
    if n > m.vocab_size:
        raise ConfigError("data.tokenizer", f"{d.tokenizer} has {n} ids, but model.vocab_size is {m.vocab_size}: "
                                            "the model has no embedding for the ids past it")
    eot = codec.eot_id()
    if m.document_separator is not None and eot is not None and eot != m.document_separator:
        raise ConfigError("model.document_separator", f"({m.document_separator}) is not the end of a document in "
                          f"{d.tokenizer}: its {EOT} is id {eot}, which `tessel data prepare` ends each document with")


def _bin_splits(d: DataConfig) -> list[tuple[str, int]]:
    if d.path is None:
        raise ConfigError("data.path", "is required when data.source = 'bin'")
    train, val = Path(d.path), val_bin(Path(d.path))
    n_train = bin_tokens(train)
    if val is not None:
        return [(str(train), n_train), (str(val), bin_tokens(val))]
    cut = split_point(n_train, d.val_fraction)
    return [(f"{train} (its training split, without a sibling val.bin)", cut),
            (f"{train} (its validation split, data.val_fraction = {d.val_fraction})", n_train - cut)]


def _stdlib_splits(d: DataConfig, vocab_size: int) -> list[tuple[str, int]]:
    if vocab_size < 256:
        raise ConfigError("model.vocab_size", f"({vocab_size}) is below 256, but the stdlib corpus is bytes")
    train, val = build_stdlib_corpus(d.max_bytes, d.val_fraction)
    return [(f"the stdlib corpus's training split ({train}, data.max_bytes = {d.max_bytes})", train.stat().st_size),
            (f"the stdlib corpus's validation split ({val}, data.val_fraction = {d.val_fraction})",
             val.stat().st_size)]


def bin_tokens(path: Path) -> int:
    """Tokens in a nanoGPT .bin file (raw uint16), after checking it is one."""
    if not path.exists():
        raise ConfigError("data.path", f"no such file: {path}")
    if path.is_dir():
        raise ConfigError("data.path", f"{path} is a directory, not a token file")
    if not path.is_file():
        raise ConfigError("data.path", f"{path} is not a regular file")
    size = path.stat().st_size
    if size == 0:
        raise ConfigError("data.path", f"{path} is empty")
    if size % 2:
        raise ConfigError("data.path", f"{path} has {size} bytes, an odd count: not uint16 tokens (nanoGPT's format)")
    return size // 2


def _require_windows(what: str, n_tokens: int, seq_len: int) -> None:
    if n_tokens <= seq_len + 1:
        raise ConfigError("train.seq_len", f"{what} holds {n_tokens} tokens; sampling windows of train.seq_len + 1 "
                                           f"= {seq_len + 1} tokens needs at least {seq_len + 2}")


def _require_ids_below(path: Path, vocab_size: int) -> None:
    top, position = token_stats(path)
    if top >= vocab_size:
        raise ConfigError("data.path", f"{path} holds token id {top} at position {position}, "
                                       f"but model.vocab_size is {vocab_size}")


# ---- the largest id of a .bin file, scanned once and cached beside it ---------------------

SCAN_CHUNK = 1 << 24  # tokens per numpy pass: 32 MiB of uint16 in memory at a time, whatever the file
STATS_FORMAT = 1


def token_stats(path: Path) -> tuple[int, int]:
    """(largest token id, its first position) of a .bin file, from its cache when the file is unchanged."""
    st = path.stat()
    key = {"format": STATS_FORMAT, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    for cache in _stats_paths(path):
        stats = _read_stats(cache, key)
        if stats is not None:
            return stats
    try:
        stats = scan_max(path)
    except OSError as err:
        raise ConfigError("data.path", f"cannot read {path}: {err.strerror or err}") from None
    _write_stats(path, {**key, "max": stats[0], "position": stats[1]})
    return stats


def scan_max(path: Path) -> tuple[int, int]:
    """The largest uint16 token of a file and its first position, one bounded chunk at a time."""
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    top, position = -1, 0
    for start in range(0, len(tokens), SCAN_CHUNK):
        chunk = tokens[start:start + SCAN_CHUNK]
        chunk_top = int(chunk.max())
        if chunk_top > top:  # argmax only when the maximum moves: one extra pass at most per chunk
            top, position = chunk_top, start + int(chunk.argmax())
    return top, position


def _stats_paths(path: Path) -> list[Path]:
    """The sidecar beside the file, then its stand-in in the cache (for folders we cannot write)."""
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:16]
    return [path.with_name(path.name + ".tessel-stats.json"), cache_dir() / "bin-stats" / f"{digest}.json"]


def _read_stats(cache: Path, key: dict) -> tuple[int, int] | None:
    """The cached (max, position), or None when missing, stale (size or mtime moved) or corrupt."""
    try:
        doc = json.loads(cache.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or any(doc.get(k) != v for k, v in key.items()):
        return None
    if not (isinstance(doc.get("max"), int) and isinstance(doc.get("position"), int)):
        return None
    return doc["max"], doc["position"]


def _write_stats(path: Path, doc: dict) -> None:
    for cache in _stats_paths(path):
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, cache)  # readers never see half a file
            return
        except OSError:
            continue  # a read-only folder: try the next place; without any, the next run scans again


class BatchSampler:
    """Random windows of seq_len+1 tokens; step s's global batch is a pure function of (seed, s).

    A rank reads rows `shard` of `num_shards` of it; under context parallelism only `columns` of each
    row (its chunks of the same sequences: inputs and targets at the same positions)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int,
                 shard: int = 0, num_shards: int = 1, vocab_size: int | None = None,
                 shares: list[int] | None = None, columns: list[int] | None = None):
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"the token source has {len(tokens)} tokens, fewer than seq_len+1 = {seq_len + 1}")
        if global_batch % num_shards:
            raise ValueError(f"global_batch {global_batch} is not divisible by {num_shards} shards")
        self.tokens, self.seq_len, self.global_batch = tokens, seq_len, global_batch
        self.seed, self.shard, self.num_shards = seed, shard, num_shards
        self.vocab_size = vocab_size  # None: ids are not checked
        # an uneven dp split: shard i reads shares[i] micro-batches' rows (tessel.parallel.data.uneven)
        per = global_batch // num_shards
        self.rows = rows(shares, shard, global_batch) if shares else slice(shard * per, (shard + 1) * per)
        # context parallelism: this rank's chunks of every sample (tessel.parallel.context.layout)
        self.columns = torch.tensor(columns, dtype=torch.long) if columns is not None else None
        self.step = 0

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.global_batch)
        rows = np.stack([np.asarray(self.tokens[s: s + self.seq_len + 1], dtype=np.int64) for s in starts])
        if self.vocab_size is not None:
            self._check_ids(rows, starts, step)
        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:]  # inputs (B, T), targets (B, T)

    def _check_ids(self, rows: np.ndarray, starts: np.ndarray, step: int) -> None:
        """One max() per batch: an id past the vocabulary would index out of the embedding (tp=1) or be
        masked to a silent wrong loss (the vocab-parallel embedding)."""
        top = int(rows.max())
        if top < self.vocab_size:
            return
        row, col = np.unravel_index(int(rows.argmax()), rows.shape)
        source = self.tokens.filename if isinstance(self.tokens, np.memmap) else "the in-memory token array"
        raise ValueError(f"the batch of step {step} holds token id {top} (position {int(starts[row]) + int(col)} "
                         f"of the tokens sampled from {source}), but the model's vocabulary (model.vocab_size) "
                         f"has {self.vocab_size} ids")

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.global_batch_at(step)
        x, y = x[self.rows], y[self.rows]
        if self.columns is not None:
            return x[:, self.columns], y[:, self.columns]
        return x, y

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.seed = int(state["step"]), int(state["seed"])
