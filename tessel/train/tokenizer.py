"""Text <-> token ids: bytes by default, or a tokenizer of the `tokenizers` library (a tokenizer.json).

A Codec turns the sample prompt into ids and generated ids back into text,
and tokenizes corpora (tessel.train.data for the stdlib corpus,
tessel.train.prepare for `tessel data prepare`).

`train_bpe` builds tessel's own tokenizer: a byte-level BPE (GPT-2's
pre-tokenizer and byte alphabet, so every text encodes and decodes back to
itself) trained with BpeTrainer on a text file. Training is deterministic:
the same text and vocabulary size give the same tokenizer.json, byte for byte
(tests/train/test_tokenizer.py checks it), so a cached one is as good as a
fresh one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

import numpy as np

EOT = "<|endoftext|>"  # the document separator of tessel's BPE (id 0), as GPT-2 names it
CHUNK_CHARS = 1 << 20  # text per encode call: whole lines, about 1 MiB


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used; the message says why, in one line."""


class Codec(Protocol):
    """Text <-> token ids."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteCodec:
    """UTF-8 bytes as ids 0..255 (tessel's default: the stdlib corpus is read as bytes)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


class TokenizerCodec:
    """A `tokenizers` Tokenizer; special tokens (the document separator) decode to nothing."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def eot_id(self) -> int | None:
        """The id of the document separator, if the tokenizer has one."""
        return self.tokenizer.token_to_id(EOT)


def read_tokenizer(path: str | Path) -> TokenizerCodec:
    """The tokenizer in a tokenizer.json; TokenizerError naming the file otherwise."""
    from tokenizers import Tokenizer  # deferred: only runs with a tokenizer load the library
    path = Path(path)
    try:
        return TokenizerCodec(Tokenizer.from_file(str(path)))
    except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise TokenizerError(f"{path} is not a tokenizers tokenizer.json ({reason})") from None


def train_bpe(text_file: Path, vocab_size: int, out: Path) -> Path:
    """A byte-level BPE of `vocab_size` ids (EOT first) trained on the UTF-8 text of `text_file`,
    written to `out` (atomically: concurrent builders write the same bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # deferred: as above
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(text_chunks(read_text(text_file)), trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tokenizer.save(str(tmp))
    os.replace(tmp, out)
    return out


def read_text(path: Path) -> str:
    """A file's bytes as text; bytes that are not UTF-8 (a few latin-1 test files of the stdlib) become U+FFFD."""
    return Path(path).read_bytes().decode("utf-8", errors="replace")


def text_chunks(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """`text` cut at line ends into pieces of about `size` characters (encode_batch runs them in parallel)."""
    chunks, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        chunks.append(text[start:end])
        start = end
    return chunks


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16, the .bin format's: ids of a larger vocabulary do not fit, and are refused."""
    if vocab_size > 2**16:
        raise TokenizerError(f"its {vocab_size} ids do not fit uint16, the token format of .bin files "
                             "(nanoGPT's; data.source = 'bin')")
    return np.dtype(np.uint16)


def encode_file(codec: TokenizerCodec, text_file: Path, out: Path) -> Path:
    """The text of `text_file` as uint16 ids in `out` (written atomically)."""
    dtype = token_dtype(codec.vocab_size)
    encoded = codec.tokenizer.encode_batch(text_chunks(read_text(text_file)), add_special_tokens=False)
    ids = np.fromiter((i for e in encoded for i in e.ids), dtype=dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    ids.tofile(tmp)
    os.replace(tmp, out)
    return out
