"""The parity sweep behind the support matrix: every (family, axis) cell tessel's rules accept, trained under
that axis's layout against the unmodified single-process transformers model.

A cell: the family's tiny config (tessel.commands.support.tiny_config), the recipe `tessel train` would run on it with
the axis's overrides (tessel.commands.support.AXES), built and stepped as `tessel train` does (the model tessel builds,
parallelize()'s runner, the Trainer's steps: its sampler, clipping, optimizer), against transformers' own model
from the same seed on the whole batches, scored by its own loss (model(input_ids, labels=y, shift_labels=y)),
with tessel's optimizer (AdamW's eps at ADAM_EPS in both runs) and clipping. Compared: the 5 losses, and every
weight after 3 steps (tessel's whole tensors under transformers' names: tessel.api.ParallelJob.full_state_dict,
whatever the layout split).

Cells run in pools of ranks grouped by world size (1, 2, or 4 for the 2D grid): one spawn loops over many
cells. A cell that raises or hangs ends its pool (after CELL_TIMEOUT_S) with its error recorded; the pool is
started again from the next cell, so one family that crashes (tessel or transformers itself) costs one
re-spawn and never the others' results.

    python -m tests.hf_matrix.sweep                   # every accepted cell -> docs/support_parity.json
    python -m tests.hf_matrix.sweep --only llama,qwen3 --axes dp,pp --out /tmp/record.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tessel.hf.config import transformers_config
from tessel.spawn import SpawnError, spawn

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "docs" / "support_parity.json"
STEPS, WEIGHT_STEP = 5, 3  # losses of 5 steps; weights after the 3rd
LR = 1e-3
# a cell that takes longer hangs (a collective one rank never joins), or the machine is far too busy: its pool
# ends, and the cell is left out of the record (status "timeout": untested, not failed)
CELL_TIMEOUT_S = int(os.environ.get("TESSEL_SWEEP_CELL_TIMEOUT", "150"))
# the recipe around the axis: a constant learning rate (the reference steps AdamW at lr without a schedule)
TRAIN = [f"train.steps={STEPS}", f"train.lr={LR}", f"train.min_lr={LR}", "train.warmup_steps=0",
         "logging.progress=false", "logging.tensorboard=false"]

# fp32 throughout; what each axis changes against one process, and so how far it may move the numbers. The
# losses are ~ln(128) = 4.85 after 5 AdamW steps at lr 1e-3; a weight moves by about lr a step.
# - recompute: the same forward run again in backward, the same ops in the same order; tessel scores the logits
#   with its own cross-entropy where transformers uses its loss function (another reduction order): ~1e-7.
# - dp, ZeRO-3: each rank half the batch, gradients averaged (ZeRO-3: reduce-scattered, parameters gathered):
#   sums in another order, ~1e-7 relative per op.
# - tp, tp+SP, the 2D grid: matmuls split and all-reduced, softmax sums over vocabulary shards: the same.
# - pp: micro-batches whose gradients add up across 2 micro-batches instead of one batch: the same.
# - ep: the experts see their tokens regrouped by an all-to-all, expert gradients summed over ep: the same.
# - cp: attention's softmax merged over sequence chunks (ring) or heads gathered (Ulysses): the same.
# - compile: inductor's fused kernels round fp32 in another order, ~1e-6 relative.
# - fused loss: the head and the cross-entropy computed chunk by chunk: sums in another order.
# Measured over the sweep (docs/support_parity.json, the cells that pass): losses within 6e-6 (dp, ZeRO-3),
# 4e-6 (recompute), 1e-6 (tp, tp+SP, pp, ep, cp, the 2D grid, fused loss); weights within 7e-5 absolute (tp),
# 3e-5 (dp, ZeRO-3), 4e-6 (recompute). AdamW moves a weight by ~lr * g / |g|, so an entry whose gradient is
# near zero can turn a 1e-10 rounding difference into part of a step (measured up to 7e-5 under tp, Qwen2/3 and
# OLMo 2, with their losses within 1.5e-6): weights get 1/10 of one step (1e-4) plus WEIGHT_RTOL. A real
# defect (a lost or doubled reduction, a head split by columns, a dropped router loss, a soft-cap applied twice)
# moves losses by > 1e-3 and weights by ~lr.
LOSS_TOL = {axis: 1e-5 for axis in ("dp", "ZeRO-3", "recompute", "tp", "tp+SP", "2D grid", "pp", "ep", "cp ring",
                                    "cp Ulysses", "fused loss")} | {"compile": 5e-5}
WEIGHT_TOL = 1e-4
# and relative to the weight, as tests/parallel/tensor/test_hf_tensor_parallel.py: a norm's gain (~1) moved by
# AdamW's normalized steps carries their rounding relative to its size; 1e-4 of it is 1/10 of one step
WEIGHT_RTOL = 1e-4
MOVED = 1e-4  # the reference's weights must move more than this, or weight parity would say nothing
# AdamW's eps, in both runs (tessel's optimizer and the reference's): 1e-6, not torch's 1e-8. AdamW moves an
# entry by lr * g / (|g| + eps), so an entry whose gradient is below eps moves by a fraction of lr decided by its
# rounding: fp32 rounds a gradient summed over the batch at ~1e-7 of its tensor's scale (1e-2: ~2e-9), and under
# eps = 1e-8 a gradient of -1.8e-9 (the reference) against +2.5e-9 (tessel under cp, Beam's layer-1 v_proj) moved
# one weight by 3.6e-4 after one step, which changed step 2's gradients by 2e-3 and flipped the sign of a
# 1e-6 embedding gradient (a whole step, 1.4e-3) and a router's choices at step 3 (loss 3.4e-4). That chain is
# the reference's own: transformers' model run in fp64 against itself in fp32 differs as much (Beam: loss
# 3.4e-4, weights 1.5e-3; Apertus 2.8e-5, 4.5e-4), and by 4.8e-7 and 3e-5 under eps = 1e-6. At 1e-6 a rounding
# difference of 5e-9 moves a weight by at most lr * 5e-9 / 1e-6 = 5e-6 (1/20 of WEIGHT_TOL), while a gradient a
# defect changes (the models' gradients are 1e-5..1e-1: a lost reduction halves them) still moves its weight by
# ~lr. Parity is a property of the gradients; eps is no part of any layout.
ADAM_EPS = 1e-6


def set_eps(optimizer: torch.optim.Optimizer) -> None:
    """ADAM_EPS on every parameter group (tessel's AdamW, ZeRO's, the reference's)."""
    for group in optimizer.param_groups:
        assert "eps" in group, f"{type(optimizer).__name__} takes no eps: the sweep's argument does not hold"
        group["eps"] = ADAM_EPS


def cell_overrides(axis: str, out_dir: str) -> list[str]:
    from tessel.commands.support import AXES
    return [*AXES[axis], *TRAIN, f'logging.out_dir="{out_dir}"']


def cell_config(path: str, axis: str, out_dir: str):
    from tessel.config import build_config
    from tessel.commands.support import BASE
    return build_config(json.loads(json.dumps({**BASE, "model": {"hf_config": path}})), cell_overrides(axis, out_dir))


def world_of(model_type: str, axis: str, folder: Path) -> int:
    cfg = cell_config(write_config(model_type, folder), axis, str(folder))
    return cfg.parallel.world_size


def write_config(model_type: str, folder: Path) -> str:
    from tessel.commands.support import tiny_config
    path = folder / f"{model_type}.json"
    if not path.exists():
        path.write_text(json.dumps(tiny_config(model_type)))
    return str(path)


# ---- one cell ---------------------------------------------------------------------------------------------

def run_tessel(path: str, axis: str, out_dir: str) -> dict:
    """5 steps as `tessel train` takes them on this process group; the weights after step 3, whole."""
    from tessel.api import ParallelJob
    from tests.helpers import build_trainer
    cfg = cell_config(path, axis, out_dir)
    trainer, model, runner, mesh = build_trainer(cfg)
    set_eps(trainer.state.optimizer)
    losses, weights = [], {}
    for step in range(STEPS):
        losses.append(float(trainer.train_step(step)["loss"]))
        if step + 1 == WEIGHT_STEP:
            weights = ParallelJob(model, mesh, cfg, runner).full_state_dict()
    return {"losses": losses, "weights": weights}


def run_transformers(path: str, axis: str, out_dir: str) -> dict:
    """The unmodified model on the whole batches, scored by its own loss, tessel's AdamW and clipping."""
    from transformers import AutoModelForCausalLM
    from tessel.train.data import BatchSampler, load_tokens
    from tessel.train.optim import build_optimizer
    cfg = cell_config(path, axis, out_dir)
    doc = json.loads(Path(path).read_text())
    torch.manual_seed(cfg.train.seed)  # the seed tessel's copy is drawn from (tests.helpers.build_runner)
    model = AutoModelForCausalLM.from_config(transformers_config(doc))
    model.train()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    opt = build_optimizer(params, cfg.train)
    set_eps(opt)
    tokens = load_tokens(cfg.data, cfg.model.vocab_size, seed=cfg.train.seed)
    sampler = BatchSampler(tokens.train, cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed)
    losses, weights = [], {}
    for step in range(STEPS):
        x, y = sampler.next()
        y = y.contiguous()  # transformers views the targets flat; tessel's are already shifted
        loss = model(input_ids=x, labels=y, shift_labels=y, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
        # torch's clipping is tessel's (min(1, max_norm / (norm + 1e-6))) on one process; tessel's own would
        # gather over the pool's process group, which this single-process reference is no part of
        torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=False)
        if step + 1 == WEIGHT_STEP:
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = max((weights[n] - w).abs().max().item() for n, w in start.items())
    return {"losses": losses, "weights": weights, "moved": moved}


MAX_PARAMS = 10_000_000  # a tiny config builds ~0.2M; one far larger is a size tiny_config does not shrink


def too_large(path: str) -> str | None:
    """Why the family's tiny config is not swept (a model of more than MAX_PARAMS, counted on the meta device:
    a size under a key tessel.commands.support.SIZES does not know), None where it is small."""
    from transformers import AutoModelForCausalLM
    doc = json.loads(Path(path).read_text())
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(transformers_config(doc))
    except Exception:  # transformers cannot build it: the cells' runs say so, in their own words
        return None
    n = sum(p.numel() for p in model.parameters())
    return None if n <= MAX_PARAMS else (f"not swept: the tiny config still builds {n / 1e6:.0f}M parameters "
                                         "(a size tessel.commands.support.SIZES does not shrink)")


def transformers_fails(path: str) -> str | None:
    """Why transformers' own model cannot take one training step on the family's tiny config (its forward or
    backward raises), None where it can: such a family's cells are recorded as that, with no tessel run."""
    try:
        from transformers import AutoModelForCausalLM
        doc = json.loads(Path(path).read_text())
        model = AutoModelForCausalLM.from_config(transformers_config(doc))
        x = torch.randint(0, doc["vocab_size"] if "vocab_size" in doc else 2, (2, 8))
        model(input_ids=x, labels=x, shift_labels=x, use_cache=False).loss.backward()
    except Exception as err:  # whatever transformers raises is its own defect on this config, recorded as such
        return f"transformers' own model fails on the tiny config: {_one_line(err)}"
    return None


def verdict(model_type: str, axis: str, got: dict, want: dict) -> dict:
    """The cell's record: the largest loss and weight differences, and whether they are within the axis's."""
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], want["losses"]))
    missing = sorted(set(want["weights"]) - set(got["weights"]))
    weight_diff = max((float((got["weights"][n].float() - w).abs().max()) for n, w in want["weights"].items()
                       if n in got["weights"] and got["weights"][n].shape == w.shape), default=0.0)
    wrong_shape = [n for n, w in want["weights"].items() if n in got["weights"] and got["weights"][n].shape != w.shape]
    close = all(torch.allclose(got["weights"][n].float(), w, rtol=WEIGHT_RTOL, atol=WEIGHT_TOL)
                for n, w in want["weights"].items() if n in got["weights"] and got["weights"][n].shape == w.shape)
    ok = loss_diff <= LOSS_TOL[axis] and close and not missing and not wrong_shape and want["moved"] > MOVED
    row = {"model_type": model_type, "axis": axis, "status": "pass" if ok else "fail", "loss_diff": loss_diff,
           "weight_diff": weight_diff, "moved": want["moved"], "loss": want["losses"][-1]}
    if missing or wrong_shape:
        row["error"] = f"weights missing {missing[:3]} or of another shape {wrong_shape[:3]}"
    return row


# ---- the pool ---------------------------------------------------------------------------------------------

def _append(log: Path, row: dict) -> None:
    with open(log, "a") as f:  # one line a write: lines of two ranks never interleave
        f.write(json.dumps(row) + "\n")


def _watchdog(log: Path, cell: tuple[str, str]) -> threading.Timer:
    def expire():
        _append(log, {"model_type": cell[0], "axis": cell[1], "status": "timeout",
                      "error": f"no result within {CELL_TIMEOUT_S} s (a hang, or far too slow)"})
        os._exit(3)
    timer = threading.Timer(CELL_TIMEOUT_S, expire)
    timer.daemon = True
    timer.start()
    return timer


def pool(cells: list[tuple[str, str]], folder: str, log: str) -> None:
    """Every rank of the process group loops over `cells`; the cell's parallel run on all of them, its
    reference and verdict on one (a family's cells all on the same rank, which trains the reference once),
    appended to `log`. An exception is recorded; on several ranks it ends the pool (the driver starts a fresh one
    after it: the process group may be left mid-collective)."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    kinds, references = list(dict.fromkeys(kind for kind, _ in cells)), {}
    for kind, axis in cells:
        timer = _watchdog(Path(log), (kind, axis))
        try:
            path, out_dir = write_config(kind, Path(folder)), tempfile.mkdtemp(prefix="run-", dir=folder)
            got = run_tessel(path, axis, out_dir)
            if kinds.index(kind) % world == rank:
                if kind not in references:  # the same config, seed and batches on every axis of the family
                    references[kind] = run_transformers(path, axis, out_dir)
                _append(Path(log), verdict(kind, axis, got, references[kind]))
        except Exception as err:
            _append(Path(log), {"model_type": kind, "axis": axis, "status": "error",
                                "error": _one_line(err), "rank": rank})
            traceback.print_exc()
            if world > 1:  # the process group may be left mid-collective: a fresh pool goes on
                raise
        finally:
            timer.cancel()


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"[:400]


def read_log(log: Path) -> dict[tuple[str, str], dict]:
    """The log's rows by cell, the first row of a cell kept (an error before the pool's teardown's)."""
    rows: dict[tuple[str, str], dict] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            row = json.loads(line)
            rows.setdefault((row["model_type"], row["axis"]), row)
    return rows


LANES = 2  # pools run side by side on a machine of 2 cores: two of one rank, or one of two


def sweep(cells: list[tuple[str, str]], out: Path | None = None, quiet: bool = False,
          precheck: bool = True) -> dict[tuple[str, str], dict]:
    """Every cell's record, the cells grouped by world size (LANES // world pools at once); pools started
    again after a failing cell. A family whose unmodified transformers model cannot take a training step on its
    tiny config is recorded as transformers' failure, without a pool (precheck=False: no such check, for cells
    known to run). `out`: the record merged into that file after each pool (a sweep cut short keeps
    what it measured)."""
    with tempfile.TemporaryDirectory(prefix="tessel-sweep-") as scratch:
        folder, log = Path(scratch), Path(scratch) / "cells.jsonl"
        by_world: dict[tuple[bool, int], list[tuple[str, str]]] = {}  # compile's cells last: they cost the most
        # a family whose tiny config is not tiny, or that transformers itself cannot train, is recorded as such
        # without a pool: its cells would only kill pools
        unfit = {kind: precheck and (too_large(path) or transformers_fails(path))
                 for kind in dict.fromkeys(k for k, _ in cells) for path in [write_config(kind, folder)]}
        for cell in cells:
            if unfit[cell[0]]:
                _append(log, {"model_type": cell[0], "axis": cell[1], "status": "error", "error": unfit[cell[0]]})
            else:
                by_world.setdefault((cell[1] == "compile", world_of(*cell, folder)), []).append(cell)
        for (_, world), group in sorted(by_world.items()):
            lanes = max(1, LANES // world)
            kinds = list(dict.fromkeys(kind for kind, _ in group))  # a family's cells in one lane: one reference
            with ThreadPoolExecutor(lanes) as ex:
                list(ex.map(lambda lane: _drive(world, [c for c in group if kinds.index(c[0]) % lanes == lane],
                                                folder, log, out, quiet), range(lanes)))
        return read_log(log)


def _drive(world: int, group: list[tuple[str, str]], folder: Path, log: Path, out: Path | None, quiet: bool) -> None:
    """Pools of `world` ranks over `group` until every cell has a row (each pool from the first cell without)."""
    while todo := [c for c in group if c not in read_log(log)]:
        started = time.monotonic()
        try:
            spawn(pool, world, todo, str(folder), str(log), timeout=CELL_TIMEOUT_S * len(todo) + 60,
                  env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
        except SpawnError as err:
            if todo[0] not in read_log(log):  # died before its first cell wrote anything: that cell's fault
                _append(log, {"model_type": todo[0][0], "axis": todo[0][1], "status": "error",
                              "error": f"the pool died: {str(err).splitlines()[-1][:300]}"})
        if out is not None:
            write_record(read_log(log), out)
        if not quiet:
            done = sum(c in read_log(log) for c in group)
            print(f"world {world}: {done}/{len(group)} cells ({time.monotonic() - started:.0f} s)", file=sys.stderr)


# ---- the full matrix --------------------------------------------------------------------------------------

@functools.cache
def matrix_rows() -> tuple:
    """tessel.commands.support's matrix, made once a process (it judges ~1200 layouts: seconds)."""
    from tessel.commands.support import matrix
    return tuple(matrix())


def accepted_cells(families: list[str] | None = None, axes: list[str] | None = None) -> list[tuple[str, str]]:
    """Every (family, axis) the rules accept (tessel.commands.support's matrix), compile last: it costs the most."""
    from tessel.commands.support import AXES
    rows = [row for row in matrix_rows() if families is None or row.model_type in families]
    cells = [(row.model_type, axis) for row in rows for axis in AXES if row.cells[axis].status != "refused"
             and row.cells[axis].status != "n/a" and (axes is None or axis in axes)]
    return sorted(cells, key=lambda c: (c[1] == "compile", c[0], list(AXES).index(c[1])))


COSTLY = ("compile", "2D grid")


def sample(cells: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The suite's sample (tests/hf_matrix/test_sweep_sample.py): the cheapest that covers every axis and every
    family, one cell a family (the fewest possible), deterministic for a given matrix. Axis j's cell is its
    (13 j mod n)-th family (so the axes meet different families); each family not met yet takes its cheapest
    accepted axis: fewest ranks first (a cell of w ranks runs w copies of the model, and the sweep runs two
    one-rank cells side by side), compile and the 2D grid last, the i-th family the (i mod k)-th of its k
    cheapest (so the families alternate between those axes)."""
    from tessel.commands.support import AXES
    chosen: list[tuple[str, str]] = []
    for j, axis in enumerate(AXES):
        kinds = [kind for kind, a in cells if a == axis]
        if kinds:
            chosen.append((kinds[13 * j % len(kinds)], axis))
    met = {kind for kind, _ in chosen}
    for i, kind in enumerate(sorted({kind for kind, _ in cells})):
        if kind not in met:
            own = _cheapest(kind, [a for k, a in cells if k == kind])
            chosen.append((kind, own[i % len(own)]))
    return chosen


def _cheapest(kind: str, axes: list[str]) -> list[str]:
    """Those of the family's `axes` that cost least to sweep: by ranks (the world size of the cell's recipe, as
    sweep() groups it), then not COSTLY."""
    with tempfile.TemporaryDirectory() as folder:
        cost = {axis: (world_of(kind, axis, Path(folder)), axis in COSTLY) for axis in axes}
    return [axis for axis in axes if cost[axis] == min(cost.values())]


def record(rows: dict[tuple[str, str], dict]) -> dict:
    import transformers
    cells = {f"{kind}/{axis}": {k: v for k, v in row.items() if k not in ("model_type", "axis", "rank")}
             for (kind, axis), row in sorted(rows.items()) if row["status"] != "timeout"}
    return {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0],
            "steps": STEPS, "weights_after": WEIGHT_STEP, "cells": cells}


def write_record(rows: dict[tuple[str, str], dict], out: Path) -> None:
    """Merge into the record at `out`: cells swept now replace their old rows; the others stay, unless the
    versions differ (then only this sweep's)."""
    new = record(rows)
    if out.exists():
        old = json.loads(out.read_text())
        if (old.get("transformers"), old.get("torch")) == (new["transformers"], new["torch"]):
            new["cells"] = dict(sorted({**old["cells"], **new["cells"]}.items()))
    out.write_text(json.dumps(new, indent=1, sort_keys=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated model types (default: every family of the matrix)")
    parser.add_argument("--axes", help="comma-separated axes (default: every axis)")
    parser.add_argument("--out", type=Path, default=RECORD)
    parser.add_argument("--sample", action="store_true", help="only the suite's sample of the cells")
    parser.add_argument("--missing", action="store_true", help="only cells the record at --out has no row for")
    args = parser.parse_args(argv)
    cells = accepted_cells(args.only.split(",") if args.only else None, args.axes.split(",") if args.axes else None)
    cells = sample(cells) if args.sample else cells
    if args.missing and args.out.exists():
        recorded = json.loads(args.out.read_text())["cells"]
        cells = [c for c in cells if f"{c[0]}/{c[1]}" not in recorded]
    print(f"{len(cells)} accepted cells", file=sys.stderr)
    rows = sweep(cells, args.out)
    write_record(rows, args.out)
    bad = [f"{k}/{a}: {r.get('error', '')} loss {r.get('loss_diff')} weight {r.get('weight_diff')}"
           for (k, a), r in rows.items() if r["status"] != "pass"]
    print(f"{len(rows) - len(bad)} of {len(rows)} cells pass; record: {args.out}", *bad, sep="\n", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
