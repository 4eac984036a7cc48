"""Pipeline parallelism: parity with one process for every schedule (the zero-bubble ones among them), pp x dp,
tied embeddings, recomputation, uneven layouts; evaluation and sampling through the pipeline; activation memory."""

import functools
import tempfile

import torch
import torch.distributed as dist
from torch.testing import assert_close

from tessel.mesh import make_mesh
from tessel.models.gpt import GPT
from tessel.apply import parallelize
from tessel.spawn import spawn
from tessel.train.trainer import Trainer
from tests.helpers import tiny_config, train_and_collect

# fp32. A micro-batch runs the same kernels on the same rows as in the
# single-process run (the reference accumulates over the same m chunks), and
# each stage accumulates its gradients over micro-batches in the same order,
# so most runs match bitwise. What may differ: the gradient norm is summed
# per stage and then across stages (another summation order, a few ulps in the
# clip factor), the dp average and the tied-embedding sum add in another
# order. AdamW divides by sqrt(v) and can magnify ulps where gradients are
# tiny: over 3 steps most weights agree below 1e-6, but an element whose
# gradient is near zero moved by up to 2.3e-5 on an AVX-512 machine (1.2e-5 on
# AVX2; the kernels round differently). 1e-4 covers that with room. A wrong
# stage cut, a lost or doubled micro-batch or a tied gradient not summed moves
# losses by >1e-3 and weights by ~lr = 1e-2, far outside these tolerances.
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
WEIGHT_TOL = dict(rtol=1e-4, atol=1e-4)
STEPS = 3


def _overrides(pp, dp, schedule, m, extra=()):
    v = 2 if schedule in ("interleaved", "zbv") else 1
    return [f"parallel.pp={pp}", f"parallel.dp={dp}", f'parallel.schedule="{schedule}"',
            f"parallel.virtual_stages={v}", f"parallel.micro_batches={m}", f"train.steps={STEPS}", *extra]


@functools.lru_cache(maxsize=None)
def _reference_cached(extra: tuple, m: int) -> dict:
    cfg = tiny_config(f"train.steps={STEPS}", f"parallel.micro_batches={m}", *extra, out_dir=tempfile.mkdtemp())
    return train_and_collect(cfg)


def _reference(extra, m):
    """One process, same weights and data, the batch split into the same m micro-batches."""
    return _reference_cached(tuple(extra), m)


def _run_configs(configs):
    """Inside a spawn: train each config on the current process group; report losses and this rank's weights."""
    out = []
    out_dir = tempfile.mkdtemp(prefix="tessel-pp-")  # not the shared default: other runs write there
    for overrides in configs:
        cfg = tiny_config(*overrides, out_dir=out_dir)
        p = cfg.parallel
        mesh = make_mesh({"pp": p.pp, "dp": p.dp})
        torch.manual_seed(cfg.train.seed)
        model = GPT(cfg.model)
        runner = parallelize(model, mesh, cfg)
        runner.timeline = False
        summary = Trainer(cfg, mesh, runner, dist.get_rank()).fit()
        x = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len), generator=torch.Generator().manual_seed(7))
        out.append({"losses": summary.losses, "state": {k: v.detach().clone() for k, v in runner.state_dict().items()},
                    "eval": runner.evaluate(x[:, :-1], x[:, 1:]).item(),
                    "sample": runner.generate(x[:1, :4], 6, seed=3).tolist(),
                    **runner.extra_metrics()})
    return out


def _check(results, configs, refs):
    for c, (overrides, (extra, m)) in enumerate(zip(configs, refs)):
        ref = _reference(extra, m)
        ev, sample = _eval_and_sample_reference(extra, m)
        seen = set()
        for rank, per_config in enumerate(results):
            got = per_config[c]
            where = f"{overrides} rank {rank}"
            assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **LOSS_TOL,
                         msg=lambda msg: f"{where}: {msg}")
            for name, value in got["state"].items():
                assert_close(value, ref["state"][name], **WEIGHT_TOL, msg=lambda msg: f"{where} {name}: {msg}")
            seen |= set(got["state"])
            # evaluation and sampling through the pipeline equal the whole model's (same weights)
            assert_close(got["eval"], ev, rtol=1e-5, atol=1e-5)
            assert got["sample"] == sample, where
            assert 0.0 <= got["bubble"] < 1.0
        assert seen == set(ref["state"]), f"{overrides}: stages miss {set(ref['state']) - seen}"
        assert ref["losses"][-1] < ref["losses"][0]  # it learns, so parity is not trivially true


def _eval_and_sample_reference(extra, m):
    from tessel.models.gpt import cross_entropy
    from tessel.parallel.runner import LocalRunner
    cfg = tiny_config(f"train.steps={STEPS}", f"parallel.micro_batches={m}", *extra)
    ref = _reference(extra, m)
    model = GPT(cfg.model)
    model.load_state_dict(ref["state"])
    local = LocalRunner(model, cross_entropy, 1, torch.device("cpu"), max_seq_len=cfg.model.max_seq_len,
                        vocab_size=cfg.model.vocab_size)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len), generator=torch.Generator().manual_seed(7))
    return local.evaluate(x[:, :-1], x[:, 1:]).item(), local.generate(x[:1, :4], 6, seed=3).tolist()


FOUR = ["model.n_layer=4"]
EIGHT = ["model.n_layer=8"]
ZERO_BUBBLE = ("zb-h1", "zb-h2", "zbv")


def test_pp2_every_schedule_and_micro_batch_count():
    configs, refs = [], []
    for schedule in ("gpipe", "1f1b", "interleaved"):
        for m in (1, 4, 8):
            if schedule == "interleaved" and m % 2:
                continue  # interleaving needs m divisible by pp
            configs.append(FOUR + _overrides(2, 1, schedule, m))
            refs.append((FOUR, m))
    # tied embeddings across first and last stage, with recomputation
    tied = FOUR + ["model.tie_embeddings=true", "parallel.recompute=true"]
    configs.append(tied + _overrides(2, 1, "1f1b", 4))
    refs.append((tied, 4))
    # an uneven user layout, and a layout balanced by parameter count
    configs.append(FOUR + _overrides(2, 1, "gpipe", 4, ["parallel.pp_layout=[3, 1]"]))
    refs.append((FOUR, 4))
    configs.append(FOUR + _overrides(2, 1, "1f1b", 4, ['parallel.pp_balance="params"']))
    refs.append((FOUR, 4))
    configs.append(FOUR + _overrides(2, 1, "gpipe", 4, ['parallel.pp_balance="time"']))  # ranks agree on one cut
    refs.append((FOUR, 4))
    for schedule in ZERO_BUBBLE:  # the backward split into B and W (zbv: 2 stages a rank in a V)
        for m in (4, 8):
            configs.append(FOUR + _overrides(2, 1, schedule, m))
            refs.append((FOUR, m))
    results = spawn(_run_configs, 2, configs, timeout=300)
    _check(results, configs, refs)
    _check_memory(results, configs, FOUR + _overrides(2, 1, "gpipe", 8), FOUR + _overrides(2, 1, "1f1b", 8))
    _check_split_memory(results, configs, FOUR + _overrides(2, 1, "gpipe", 8), FOUR)


def test_pp4_and_pp2_x_dp2():
    configs, refs = [], []
    for schedule in ("gpipe", "1f1b"):
        for m in (1, 4, 8):
            configs.append(FOUR + _overrides(4, 1, schedule, m))
            refs.append((FOUR, m))
    for m in (4, 8):  # 8 layers: pp=4 x 2 virtual stages of one block each
        configs.append(EIGHT + _overrides(4, 1, "interleaved", m))
        refs.append((EIGHT, m))
    tied = FOUR + ["model.tie_embeddings=true"]
    for schedule in ("1f1b", "interleaved", "zb-h1", "zb-h2"):  # W's data-parallel reduction, the tied sum
        configs.append(tied + _overrides(2, 2, schedule, 4))
        refs.append((tied, 4 * 2))  # dp=2 x m=4: the reference sees 8 micro-batches of the same size
    configs.append(FOUR + _overrides(2, 2, "zbv", 4))  # zbv keeps the embedding and the head on rank 0: untied
    refs.append((FOUR, 4 * 2))
    for schedule in ZERO_BUBBLE:
        for m in (4, 8):
            model = EIGHT if schedule == "zbv" else FOUR  # 8 virtual stages of one block
            configs.append(model + _overrides(4, 1, schedule, m))
            refs.append((model, m))
    results = spawn(_run_configs, 4, configs, timeout=300)
    _check(results, configs, refs)
    _check_memory(results, configs, FOUR + _overrides(4, 1, "gpipe", 8), FOUR + _overrides(4, 1, "1f1b", 8))
    _check_split_memory(results, configs, FOUR + _overrides(4, 1, "gpipe", 8), FOUR)


def _check_memory(results, configs, gpipe, one_f):
    """Bytes of saved activations at the peak of a step, per rank: 1F1B holds p - rank micro-batches, GPipe m."""
    p, m = len(results), 8
    g, f = configs.index(gpipe), configs.index(one_f)
    for rank in range(p):
        peak_g, peak_f = results[rank][g]["act_peak_mb_rank"], results[rank][f]["act_peak_mb_rank"]
        assert peak_f < peak_g
        # each micro-batch saves the same bytes on a stage, so the ratio is exact
        assert_close(peak_f / peak_g, (p - rank) / m, rtol=1e-6, atol=0)


def _check_split_memory(results, configs, gpipe, model):
    """A split backward holds a micro-batch from its F to its W: ZB-H1 min(p, m) micro-batches (1F1B's most,
    on every rank), ZB-H2 min(2p-1, m); on top, the gradients B captured for W (split_backward.WeightWork)."""
    p, m = len(results), 8
    g = configs.index(gpipe)
    peaks = {}
    for schedule, held in (("zb-h1", min(p, m)), ("zb-h2", min(2 * p - 1, m))):
        c = configs.index(model + _overrides(p, 1, schedule, m))
        # in units of one micro-batch's saved activations on the rank (GPipe holds all m at its peak)
        peaks[schedule] = [results[r][c]["act_peak_mb_rank"] / (results[r][g]["act_peak_mb_rank"] / m)
                           for r in range(p)]
        assert all(x > held for x in peaks[schedule]), (schedule, peaks[schedule])
    assert all(h2 > h1 for h1, h2 in zip(peaks["zb-h1"], peaks["zb-h2"])), peaks
