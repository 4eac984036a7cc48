"""`tessel data prepare INPUT --tokenizer T --out DIR`: text into the `.bin` token files `data.source = "bin"` reads.

INPUT is a text file (one document), a JSONL file (one document per line, the
string under --field), or a folder of them (every file whose suffix is in
TEXT_SUFFIXES or .jsonl, recursively, in sorted order). Each document goes to
the validation split when a hash of its name (path, and line for JSONL) falls
under --val-fraction, so the split is the same on every machine and run. A
tokenizer with a document separator (tessel's BPE: <|endoftext|>) gets it
appended after every document.

Documents are tokenized in batches by --workers processes (each loads the
tokenizer once) while a rich progress bar counts the bytes; the ids are
written in input order as raw uint16 (nanoGPT's format) to DIR/train.bin and
DIR/val.bin, with the tokenizer beside them (DIR/tokenizer.json) and what was
done in DIR/prepare.json. A vocabulary past 65536 ids does not fit uint16 and
is refused, as is a tokenizer with more ids than the model (--model-config, a
Hugging Face config.json, or --recipe) has embeddings. Every input is checked
before any process starts; the files appear whole or not at all.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import tempfile
import zlib
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from tessel.config import ConfigError, DataConfig, check_tokenizer, load_config
from tessel.hf.shape import HFConfigError, model_shape
from tessel.observe.progress import Work, work_progress
from tessel.train.data import text_codec, tokenizer_file
from tessel.train.tokenizer import TokenizerCodec, TokenizerError, read_tokenizer, token_dtype

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
BATCH_CHARS = 1 << 20  # text per task handed to a worker


@dataclass
class PrepareJob:
    inputs: list[Path]  # the files, in order
    root: Path  # documents are named relative to it
    tokenizer: Path
    out: Path
    val_fraction: float
    workers: int
    field: str
    vocab_size: int  # the tokenizer's


# ---- checks -------------------------------------------------------------------------------------
def check_prepare(input_: str, tokenizer: str, out: str, model_config: str | None = None, recipe: str | None = None,
                  val_fraction: float = 0.05, workers: int = 2, field: str = "text",
                  overwrite: bool = False) -> PrepareJob:
    """Every argument of `tessel data prepare`, checked before any work; ConfigError naming it."""
    if not 0 <= val_fraction < 1:
        raise ConfigError("--val-fraction", f"must be at least 0 and below 1 (got {val_fraction})")
    if workers < 1:
        raise ConfigError("--workers", f"must be at least 1 (got {workers})")
    if model_config is not None and recipe is not None:
        raise ConfigError("--model-config", "give --model-config or --recipe, not both")
    inputs, root = input_files(Path(input_), field)
    path, vocab = checked_tokenizer(tokenizer)
    limit = model_vocab(model_config, recipe)
    if limit is not None and vocab > limit:
        flag = "--model-config" if model_config is not None else "--recipe"
        raise ConfigError(flag, f"the model has {limit} embeddings (vocab_size), but the tokenizer {tokenizer} has "
                                f"{vocab} ids: ids past the model's vocabulary cannot be trained on")
    check_out(Path(out), overwrite)
    return PrepareJob(inputs, root, path, Path(out), val_fraction, workers, field, vocab)


def input_files(path: Path, field: str) -> tuple[list[Path], Path]:
    if not path.exists():
        raise ConfigError("INPUT", f"no such file or folder: {path}")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (*TEXT_SUFFIXES, ".jsonl"))
        if not files:
            raise ConfigError("INPUT", f"{path} holds no text ({', '.join(TEXT_SUFFIXES)}) or .jsonl file")
        root = path
    elif path.is_file():
        files, root = [path], path.parent
    else:
        raise ConfigError("INPUT", f"{path} is not a regular file or folder")
    for f in files:
        if f.suffix == ".jsonl":
            _check_jsonl_head(f, field)
    return files, root


def _check_jsonl_head(path: Path, field: str) -> None:
    """The first record of a JSONL file holds a string under `field` (later lines are checked as read)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        line = next((ln for ln in f if ln.strip()), None)
    if line is None:
        return
    _document(line, path, 1, field)


def _document(line: str, path: Path, number: int, field: str) -> str:
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as err:
        raise ConfigError("INPUT", f"{path} line {number} is not JSON ({err.msg})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get(field), str):
        raise ConfigError("--field", f"{path} line {number} has no string field '{field}'")
    return doc[field]


def checked_tokenizer(tokenizer: str) -> tuple[Path, int]:
    """(its tokenizer.json, built first for 'stdlib-bpe-N', its vocabulary size), which must fit uint16."""
    d = DataConfig(tokenizer=tokenizer)
    try:
        check_tokenizer(d)
    except ConfigError as err:
        raise ConfigError("--tokenizer", err.message) from None
    try:
        vocab = text_codec(d).vocab_size
        token_dtype(vocab)
    except TokenizerError as err:
        raise ConfigError("--tokenizer", str(err)) from None
    return tokenizer_file(d), vocab


def model_vocab(model_config: str | None, recipe: str | None) -> int | None:
    """The vocabulary of the model the tokens are for: a Hugging Face config.json or a recipe's model."""
    if model_config is not None:
        try:
            return int(model_shape(model_config)["vocab_size"])
        except HFConfigError as err:
            raise ConfigError("--model-config", str(err)) from None
    if recipe is not None:
        try:
            return load_config(recipe).model.vocab_size
        except ConfigError as err:
            raise ConfigError("--recipe", f"{recipe}: {err}") from None
    return None


def check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{out} is a file; give a folder")
    if (out / "train.bin").exists() and not overwrite:
        raise ConfigError("--out", f"{out} already holds train.bin (pass --overwrite to replace it)")
    parent = next(p for p in out.absolute().parents if p.exists()) if not out.exists() else out
    try:
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as err:
        raise ConfigError("--out", f"cannot write {out}: nothing can be created in {parent} ({err.strerror})") from None


# ---- the work -------------------------------------------------------------------------------------
def documents(job: PrepareJob) -> Iterator[tuple[str, str, int]]:
    """(name, text, bytes of input it was read from) of every document, in input order."""
    for path in job.inputs:
        rel = str(path.relative_to(job.root))
        if path.suffix != ".jsonl":
            raw = path.read_bytes()
            yield rel, raw.decode("utf-8", errors="replace"), len(raw)
            continue
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                line = raw.decode("utf-8", errors="replace")
                yield f"{rel}:{number}", _document(line, path, number, job.field) if line.strip() else "", len(raw)


def is_val(name: str, val_fraction: float) -> bool:
    return zlib.crc32(name.encode()) % 10_000 < val_fraction * 10_000


Batch = tuple[list[tuple[bool, str]], int]  # documents as (goes to val?, text), bytes of input they came from


def batches(job: PrepareJob) -> Iterator[Batch]:
    """The documents, about BATCH_CHARS of text per task; blank JSONL lines are skipped (counted as read)."""
    batch, size, raw = [], 0, 0
    for name, text, nbytes in documents(job):
        if text:
            batch.append((is_val(name, job.val_fraction), text))
        size, raw = size + len(text), raw + nbytes
        if size >= BATCH_CHARS:
            yield batch, raw
            batch, size, raw = [], 0, 0
    if raw:
        yield batch, raw


_WORKER: dict = {}


def _start_worker(tokenizer: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already; no threads inside each
    codec = read_tokenizer(tokenizer)
    _WORKER.update(codec=codec, eot=codec.eot_id())


def _encode(task: Batch) -> tuple[np.ndarray, np.ndarray, int]:
    """A worker's task: (train ids, val ids, bytes of input) of one batch, documents in order."""
    batch, nbytes = task
    codec: TokenizerCodec = _WORKER["codec"]
    eot = [] if _WORKER["eot"] is None else [_WORKER["eot"]]
    encoded = codec.tokenizer.encode_batch([text for _, text in batch], add_special_tokens=False)
    split: dict[bool, list[int]] = {False: [], True: []}
    for (val, _), e in zip(batch, encoded):
        split[val] += e.ids + eot
    return np.array(split[False], dtype=np.uint16), np.array(split[True], dtype=np.uint16), nbytes


def prepare(job: PrepareJob, progress: bool = True) -> dict:
    """Tokenize job's documents into job.out/{train,val}.bin; what was done (also in prepare.json)."""
    total = sum(p.stat().st_size for p in job.inputs)
    job.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=job.out))
    counts = {"train": 0, "val": 0}
    try:
        files = {split: open(tmp / f"{split}.bin", "wb") for split in counts}
        # fork: the workers need only this module, and the pool starts before the bar's thread does
        # a bar on a terminal only (tessel.observe.progress): nothing in a log
        bar = work_progress("tokenizing", total, in_bytes=True) if progress else nullcontext(Work())
        with multiprocessing.get_context("fork").Pool(job.workers, _start_worker, (str(job.tokenizer),)) as pool, \
                bar as work:
            for train, val, nbytes in pool.imap(_encode, batches(job)):
                for split, ids in (("train", train), ("val", val)):
                    ids.tofile(files[split])
                    counts[split] += len(ids)
                work.advance(nbytes)
        for f in files.values():
            f.close()
        report = _finish(job, tmp, counts)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def _finish(job: PrepareJob, tmp: Path, counts: dict[str, int]) -> dict:
    if counts["train"] == 0:
        raise ConfigError("INPUT", "every document fell into the validation split; lower --val-fraction")
    if counts["val"] == 0:
        (tmp / "val.bin").unlink()  # the bin source then splits train.bin by data.val_fraction
    shutil.copyfile(job.tokenizer, tmp / "tokenizer.json")
    report = {"inputs": len(job.inputs), "tokenizer": str(job.tokenizer), "vocab_size": job.vocab_size,
              "tokenizer_sha256": hashlib.sha256(job.tokenizer.read_bytes()).hexdigest(),
              "train_tokens": counts["train"], "val_tokens": counts["val"], "dtype": "uint16"}
    (tmp / "prepare.json").write_text(json.dumps(report, indent=1))
    for name in ("val.bin", "train.bin", "tokenizer.json", "prepare.json"):  # train.bin last: it marks a whole set
        if (tmp / name).exists():
            os.replace(tmp / name, job.out / name)
        elif name == "val.bin" and (job.out / name).exists():
            (job.out / name).unlink()  # a stale val.bin of an earlier prepare would be read as this one's
    return report
