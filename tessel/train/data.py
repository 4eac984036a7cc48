"""Token sources and a resumable, layout-independent batch sampler.

Sources:
- `stdlib`: the Python standard library's own .py files as byte tokens, a real
  corpus every machine has. Files are split into train/validation by a hash of
  their path, so the split is the same everywhere and no file is in both.
- `bin`: nanoGPT-style memory-mapped uint16 token files (train.bin, val.bin).
- `synthetic`: a fixed random Markov chain, learnable and tiny, for tests.

The sampler draws the *global* batch of step s from a generator seeded by
(seed, s) and hands each data-parallel shard its slice. So the batch of a step
depends on neither the layout nor the history: the single-process reference
sees exactly the union of what the ranks see, and resuming needs only the step.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tessel.config import DataConfig


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


def load_tokens(cfg: DataConfig, vocab_size: int, seed: int = 0) -> TokenData:
    if cfg.source == "stdlib":
        train_path, val_path = build_stdlib_corpus(cfg.max_bytes, cfg.val_fraction)
        return TokenData(np.memmap(train_path, dtype=np.uint8, mode="r"),
                         np.memmap(val_path, dtype=np.uint8, mode="r"))
    if cfg.source == "bin":
        train = np.memmap(cfg.path, dtype=np.uint16, mode="r")
        val_path = Path(cfg.path).with_name("val.bin")
        if val_path.exists() and val_path != Path(cfg.path):
            return TokenData(train, np.memmap(val_path, dtype=np.uint16, mode="r"))
        cut = int(len(train) * (1 - cfg.val_fraction))
        return TokenData(train[:cut], train[cut:])
    tokens = synthetic_tokens(vocab_size, 100_000, seed)
    cut = int(len(tokens) * (1 - cfg.val_fraction))
    return TokenData(tokens[:cut], tokens[cut:])


class BatchSampler:
    """Random windows of seq_len+1 tokens; step s's global batch is a pure function of (seed, s)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int,
                 shard: int = 0, num_shards: int = 1):
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"the token source has {len(tokens)} tokens, fewer than seq_len+1 = {seq_len + 1}")
        if global_batch % num_shards:
            raise ValueError(f"global_batch {global_batch} is not divisible by {num_shards} shards")
        self.tokens, self.seq_len, self.global_batch = tokens, seq_len, global_batch
        self.seed, self.shard, self.num_shards = seed, shard, num_shards
        self.step = 0

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.global_batch)
        rows = np.stack([np.asarray(self.tokens[s: s + self.seq_len + 1], dtype=np.int64) for s in starts])
        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:]  # inputs (B, T), targets (B, T)

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.global_batch_at(step)
        per = self.global_batch // self.num_shards
        sl = slice(self.shard * per, (self.shard + 1) * per)
        return x[sl], y[sl]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.seed = int(state["step"]), int(state["seed"])
