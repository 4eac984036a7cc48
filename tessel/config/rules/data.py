"""What a run reads before it starts: initial weights (model.init_from), token files (data.source = 'bin'),
the vocabulary byte-level data needs, and the tokenizer (data.tokenizer: tessel's stdlib BPE with a vocabulary
it can build, or an existing file; its contents and its size against the model are checked with the data,
tessel.train.data.validate_data)."""

from __future__ import annotations

import re
from pathlib import Path

from tessel.config.rule import Rule, check_rules, on_part
from tessel.config.schema import DataConfig

BUILTIN_TOKENIZER = re.compile(r"stdlib-bpe-(\d+)")
BPE_VOCAB = (512, 65536)  # a byte-level BPE needs its 256 bytes and room to merge; ids must fit uint16


def builtin_bpe_vocab(tokenizer: str | None) -> int | None:
    """N for data.tokenizer = 'stdlib-bpe-N' (tessel's BPE trained on the stdlib corpus), None otherwise."""
    found = BUILTIN_TOKENIZER.fullmatch(tokenizer or "")
    return int(found.group(1)) if found else None


def _bpe(d: DataConfig) -> bool:
    return d.tokenizer is not None and builtin_bpe_vocab(d.tokenizer) is not None


def _file(d: DataConfig) -> bool:
    return d.tokenizer is not None and builtin_bpe_vocab(d.tokenizer) is None


TOKENIZER = [
    Rule("data.tokenizer", lambda d: BPE_VOCAB[0] <= builtin_bpe_vocab(d.tokenizer) <= BPE_VOCAB[1],
         lambda d: f"'{d.tokenizer}': the stdlib BPE's vocabulary must be {BPE_VOCAB[0]}..{BPE_VOCAB[1]} ids",
         when=_bpe),
    Rule("data.tokenizer", lambda d: Path(d.tokenizer).is_file(),
         lambda d: f"no such file: {d.tokenizer} (a tokenizer.json of the tokenizers library, or 'stdlib-bpe-N')",
         when=_file),
]


def check_tokenizer(d: DataConfig) -> None:
    """data.tokenizer alone (`tessel prepare` checks it before it reads a recipe's other sections)."""
    check_rules(TOKENIZER, d)


def _bin(c) -> bool:
    return c.data.source == "bin"


RULES = [
    Rule("model.init_from", lambda c: Path(c.model.init_from).exists(),
         lambda c: f"no such file or folder: {c.model.init_from}", when=lambda c: c.model.init_from is not None),
    Rule("data.path", lambda c: c.data.path is not None, "is required when data.source = 'bin'", when=_bin),
    Rule("data.path", lambda c: Path(c.data.path).is_file(), lambda c: f"no such file: {c.data.path}", when=_bin),
    Rule("model.vocab_size",
         lambda c: c.model.vocab_size >= 256 or c.data.source == "bin" or c.data.tokenizer is not None,
         "byte-level data needs vocab_size >= 256", when=lambda c: c.data.source in ("stdlib", "bin")),
    *on_part(lambda c: c.data, TOKENIZER),
]
