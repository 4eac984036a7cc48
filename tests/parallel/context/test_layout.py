"""The load-balanced sequence layout and the sampler that cuts batches by it: no processes."""

import numpy as np
import pytest
import torch

from tessel.parallel.context import layout
from tessel.train.data import BatchSampler


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_every_position_once_and_the_causal_work_balanced(cp):
    seq = 2 * cp * 5
    held = [layout.positions(seq, cp, r) for r in range(cp)]
    assert sorted(p for ps in held for p in ps) == list(range(seq))
    assert all(ps == sorted(ps) for ps in held)  # positions rise with the local index: a plain causal diagonal
    # query i attends to i + 1 keys: every rank's queries attend to as many keys in all
    assert len({sum(p + 1 for p in ps) for ps in held}) == 1
    assert layout.rank_chunks(0, 4) == (0, 7) and layout.rank_chunks(3, 4) == (3, 4)
    with pytest.raises(ValueError, match="2\\*cp"):
        layout.positions(seq + 1, cp, 0)


def test_the_sampler_hands_a_cp_rank_its_chunks_of_the_same_rows():
    tokens = np.arange(1000, dtype=np.int64)
    whole = BatchSampler(tokens, 16, 4, seed=7, shard=1, num_shards=2)
    mine = BatchSampler(tokens, 16, 4, seed=7, shard=1, num_shards=2, columns=layout.positions(16, 2, 1))
    (x, y), (xc, yc) = whole.batch_at(3), mine.batch_at(3)
    cols = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11])  # chunks 1 and 2 of 4
    assert torch.equal(xc, x[:, cols]) and torch.equal(yc, y[:, cols])
    assert torch.equal(yc, xc + 1)  # each target is still the token after its input
