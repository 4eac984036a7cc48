"""The runner's two ways of posting receives, and its cached activation accounting, agree exactly.

Under gloo the runner posts receives ahead of need and gets the loss as a
tagged message; under NCCL it posts receives in the schedule's batches and
broadcasts the loss. Saved-activation bytes are measured by a hook on the first
forward of each (chunk, shape) and counted from a cache after. Both paths run
here on gloo (the NCCL-style one forced), against each other: the same
arithmetic in the same order, so losses, gradients and activation peaks must be
equal bitwise (the runs themselves are checked against one process in
test_pipeline.py).
"""

import torch
import torch.distributed as dist

from tessel.mesh import make_mesh
from tessel.models.gpt import GPT
from tessel.apply import parallelize
from tessel.spawn import spawn
from tests.helpers import tiny_config

CASES = (("gpipe", 4), ("1f1b", 4), ("interleaved", 4))


def _run_paths():
    mesh = make_mesh({"pp": 2})
    out = {}
    for schedule, m in CASES:
        v = 2 if schedule == "interleaved" else 1
        cfg = tiny_config("model.n_layer=4", "parallel.pp=2", f'parallel.schedule="{schedule}"',
                          f"parallel.virtual_stages={v}", f"parallel.micro_batches={m}")
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, cfg.model.vocab_size, (2 * m, cfg.train.seq_len), generator=g)
        y = torch.randint(0, cfg.model.vocab_size, (2 * m, cfg.train.seq_len), generator=g)
        for prepost in (True, False):
            torch.manual_seed(0)
            runner = parallelize(GPT(cfg.model), mesh, cfg)
            if not prepost:
                runner.executor.prepost = False  # receives in the schedule's batches, loss broadcast: NCCL's path
                runner.loss_by_message = False
                runner.recorder.saved.dynamic = [True] * len(runner.chunks)  # the hook measures every forward
            rows = []
            for _ in range(2):  # the second step counts from the cache on the default path
                loss = runner.forward_backward(x, y).item()
                metrics = runner.extra_metrics()
                grads = {n: p.grad.clone() for n, p in runner.named_parameters().items()}
                rows.append((loss, metrics["act_peak_mb_rank"], metrics["bubble"], grads))
                for p in runner.parameters():
                    p.grad = None
            out[(schedule, m, prepost)] = rows
    dist.barrier()
    return out


def test_preposted_and_batched_receives_agree():
    results = spawn(_run_paths, 2)
    for rank, out in enumerate(results):
        for schedule, m in CASES:
            fast, batched = out[(schedule, m, True)], out[(schedule, m, False)]
            for step, (a, b) in enumerate(zip(fast, batched)):
                where = f"{schedule} m={m} rank {rank} step {step}"
                assert a[0] == b[0], f"{where}: loss {a[0]} vs {b[0]}"
                assert a[0] == results[1][(schedule, m, True)][step][0], f"{where}: not the last stage's loss"
                assert a[1] == b[1] > 0, f"{where}: activation peak {a[1]} vs {b[1]}"
                assert 0.0 <= a[2] < 1.0 and 0.0 <= b[2] < 1.0
                assert a[3].keys() == b[3].keys() and a[3]
                for name in a[3]:
                    assert torch.equal(a[3][name], b[3][name]), f"{where}: gradient of {name}"
