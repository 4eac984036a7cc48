"""Token sources and the layout-independent batch sampler."""

import numpy as np
import torch

from tessel.config import DataConfig
from tessel.train.data import BatchSampler, load_tokens


def test_shards_partition_the_global_batch():
    tokens = np.arange(1000)
    whole = BatchSampler(tokens, 8, 12, seed=3)
    parts = [BatchSampler(tokens, 8, 12, seed=3, shard=s, num_shards=4) for s in range(4)]
    for step in range(3):
        x, y = whole.next()
        xs = torch.cat([p.next()[0] for p in parts])
        assert torch.equal(xs, x)
        assert torch.equal(y[:, :-1], x[:, 1:])  # targets are inputs shifted by one


def test_resume_continues_the_same_stream():
    tokens = np.arange(1000)
    a = BatchSampler(tokens, 8, 4, seed=1)
    for _ in range(5):
        a.next()
    b = BatchSampler(tokens, 8, 4, seed=1)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.next()[0], b.next()[0])


def test_stdlib_corpus_split_is_disjoint_and_real(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSEL_CACHE", str(tmp_path))
    data = load_tokens(DataConfig(source="stdlib", max_bytes=2_000_000, val_fraction=0.1), 256)
    assert len(data.train) > 1_000_000 and len(data.val) > 50_000
    text = bytes(data.train[:20000]).decode("utf-8", errors="replace")
    assert "def " in text and "import" in text
    again = load_tokens(DataConfig(source="stdlib", max_bytes=2_000_000, val_fraction=0.1), 256)
    assert np.array_equal(np.asarray(again.val[:1000]), np.asarray(data.val[:1000]))  # deterministic


def test_bin_source_reads_nanogpt_files(tmp_path):
    arr = (np.arange(5000) % 300).astype(np.uint16)
    arr.tofile(tmp_path / "train.bin")
    arr[:1000].tofile(tmp_path / "val.bin")
    data = load_tokens(DataConfig(source="bin", path=str(tmp_path / "train.bin")), 300)
    assert len(data.train) == 5000 and len(data.val) == 1000 and int(data.train.max()) == 299
