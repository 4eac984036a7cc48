"""Checkpoints: resharding across layouts, checksums and fallback, safe loading, a full disk."""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing import assert_close

from tessel.config import Config
from tessel.errors import FatalError
from tessel.mesh import make_mesh
from tessel.sharding import mark_sharded, set_logical_shape
from tessel.spawn import spawn
from tessel.train.checkpoint import manager as checkpoint
from tessel.train.checkpoint.manager import CheckpointError, CheckpointManager, commit, latest_valid, verify
from tessel.train.checkpoint.optimizer_state import PerParameterState
from tessel.train.checkpoint.safe_dcp import METADATA_FILE, UnsafeCheckpointError
from tessel.train.checkpoint.tensors import LocalTensors
from tests.helpers import build_trainer, tiny_config

# Layouts are recipe overrides; a strategy joins the matrix by adding its own.
# Saved in data, tensor x data, pipeline, ZeRO-2, tensor x ZeRO-2 and pipeline x ZeRO-1 layouts; loaded
# in tensor, wider data, pipeline x data, ZeRO-1, tensor x ZeRO-3 and pipeline x ZeRO-3 layouts (ZeRO
# saves and loads logical whole tensors through its optimizer's hook,
# tessel.parallel.zero.checkpoint, under the full model's names on a pipeline's stages;
# tessel.train.checkpoint.logical puts a tp or ep shard's whole tensor together on save and cuts this
# rank's piece on load). The moe- layouts train an MoE model with tied embeddings, saved under ep x ZeRO-2
# and loaded under pipeline x ep x ZeRO-1: a pipeline's last stage holds the tied head as a copy of its
# own and reads its optimizer state by the head's name. No token is dropped (capacity_factor = n_experts),
# so the layouts train one model (capacity is counted per rank). The gpt2- layouts train a Hugging Face GPT-2
# (tied), whose fused q|k|v is split per head under tp: saved as pieces of the logical tensor
# (tessel.train.checkpoint.packed), read back by tp x pp and cut from the whole by tp x ZeRO-3.
MOE = ["model.n_experts=4", "model.capacity_factor=4.0", "model.tie_embeddings=true"]
GPT2 = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 32,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
HF_GPT2 = ['model.hf_config="{root}/gpt2.json"']
SAVE_LAYOUTS = {"dp1": [], "dp2tp2": ["parallel.dp=2", "parallel.tp=2"], "pp2": ["parallel.pp=2"],
                "dp2zero2": ["parallel.dp=2", "parallel.zero_stage=2"],
                "dp2tp2zero2": ["parallel.dp=2", "parallel.tp=2", "parallel.zero_stage=2"],
                "pp2dp2zero1": ["parallel.pp=2", "parallel.dp=2", "parallel.zero_stage=1"],
                "moe-dp1": MOE, "moe-ep2zero2": [*MOE, "parallel.ep=2", "parallel.zero_stage=2"],
                "gpt2-tp2": [*HF_GPT2, "parallel.tp=2"]}
LOAD_LAYOUTS = {"tp2": ["parallel.tp=2"], "dp4": ["parallel.dp=4"], "pp2dp2": ["parallel.pp=2", "parallel.dp=2"],
                "dp2zero1": ["parallel.dp=2", "parallel.zero_stage=1"],
                "dp2tp2zero3": ["parallel.dp=2", "parallel.tp=2", "parallel.zero_stage=3"],
                "pp2dp2zero3": ["parallel.pp=2", "parallel.dp=2", "parallel.zero_stage=3"],
                "moe-pp2": [*MOE, "parallel.pp=2"],
                "moe-pp2ep2zero1": [*MOE, "parallel.pp=2", "parallel.ep=2", "parallel.zero_stage=1"],
                "gpt2-pp2tp2": [*HF_GPT2, "parallel.pp=2", "parallel.tp=2"],
                "gpt2-dp2tp2zero3": [*HF_GPT2, "parallel.dp=2", "parallel.tp=2", "parallel.zero_stage=3"]}
SAVE_AT, STEPS = 3, 5  # checkpoint after 3 steps; the loaded run takes steps 3 and 4: the second depends on
# the optimizer's state as well as the weights
BARE = {"model": {}}  # the least a manifest holds (library use: no trainer state, a model of its own)
# fp32. Layouts differ only in how the gradient sum is ordered (all-reduce over
# dp, accumulation over micro-batches): the loss after 3 AdamW steps moves by
# a few ulps (measured < 2e-6). A wrong or missing shard moves it by >1e-2; a lost optimizer state (the
# head's of a tied pair) moves the second step's by 2e-3.
NEXT_LOSS_TOL = dict(rtol=1e-5, atol=1e-5)


def _fit(cfg: Config, init_seed: int | None = None) -> list[float]:
    return build_trainer(cfg, init_seed)[0].fit().losses


def _common(root: Path, name: str) -> list[str]:
    return [f"train.steps={STEPS}", "fault.heartbeat_s=0", f'logging.out_dir="{root}/logs-{name}"']


def _family(name: str) -> str:
    return name.split("-")[0] if "-" in name else "dense"


def _layout(overrides: list[str], root: str) -> list[str]:
    return [o.format(root=root) for o in overrides]


def _save(root: str, name: str) -> list[float]:
    """Train STEPS steps in layout `name`, checkpointing after SAVE_AT: returns all the losses."""
    return _fit(tiny_config(*_layout(SAVE_LAYOUTS[name], root), *_common(Path(root), name),
                            f'checkpoint.dir="{root}/{name}"', f"checkpoint.every={SAVE_AT}"))


def _load(root: str, name: str, sources: list[str]) -> dict[str, list[float]]:
    """Resume layout `name` from each source's checkpoint of its model (other initial weights: the load must
    win)."""
    out = {}
    for src in (s for s in sources if _family(s) == _family(name)):
        cfg = tiny_config(*_layout(LOAD_LAYOUTS[name], root), *_common(Path(root), name),
                          f'checkpoint.resume="{root}/{src}/step_{SAVE_AT:08d}"', f'checkpoint.dir="{root}/x"')
        losses = _fit(cfg, init_seed=99)
        assert len(losses) == STEPS - SAVE_AT  # resumed at step SAVE_AT
        out[src] = losses
    return out


def _phase(root: str, saves: list[str], loads: list[str], sources: list[str]) -> tuple[dict, dict]:
    """One process group saves in some layouts, then loads every source into others."""
    return {n: _save(root, n) for n in saves}, {n: _load(root, n, sources) for n in loads}


def _in_world(world: int, *args) -> tuple[dict, dict]:
    return _phase(*args) if world == 1 else spawn(_phase, world, *args)[0]


def _by_world(layouts: dict[str, list[str]], root: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name, overrides in layouts.items():
        out.setdefault(tiny_config(*_layout(overrides, root)).parallel.world_size, []).append(name)
    return out


def test_resharding_matrix_next_step_loss(tmp_path):
    root, sources = str(tmp_path), list(SAVE_LAYOUTS)
    (tmp_path / "gpt2.json").write_text(json.dumps(GPT2))
    saves, loads = _by_world(SAVE_LAYOUTS, root), _by_world(LOAD_LAYOUTS, root)
    worlds = sorted(set(saves) | set(loads))
    saved, loaded = {}, {}
    # phase 1: every world saves; the last also loads (all sources exist by then). Phase 2: the rest load.
    # Spawning dominates the time, so each world is spawned at most twice.
    for w in worlds:
        s, l = _in_world(w, root, saves.get(w, []), loads.get(w, []) if w == worlds[-1] else [], sources)
        saved.update(s)
        loaded.update(l)
    for w in worlds[:-1]:
        loaded.update(_in_world(w, root, [], loads.get(w, []), sources)[1])
    assert sorted(loaded) == sorted(LOAD_LAYOUTS) and sorted(saved) == sorted(SAVE_LAYOUTS)
    for name, got in loaded.items():
        assert sorted(got) == sorted(s for s in SAVE_LAYOUTS if _family(s) == _family(name))
        for src, losses in got.items():
            assert_close(torch.tensor(losses), torch.tensor(saved[src][SAVE_AT:]), **NEXT_LOSS_TOL,
                         msg=lambda m: f"saved in {src}, loaded in {name}: {m}")
    # the runs differ from a fresh start: a load that silently did nothing would fail above
    assert abs(saved["dp1"][SAVE_AT] - saved["dp1"][0]) > 0.05


# ---- sharded parameters (the convention TP / ZeRO-3 use): logical tensors, padding ----------
class _Runner:
    """The part of tessel.parallel.runner.Runner that checkpoints use."""

    def __init__(self, model):
        self.model = model

    def named_checkpoint_tensors(self) -> dict:
        return dict(self.model.state_dict(keep_vars=True))


def _sharded_model(mesh, rows: int, logical_rows: int | None):
    """A (rows*dp, 3) table split by rows over dp, like a vocab-parallel embedding."""
    n, r = mesh.size("dp"), mesh.coord("dp")
    full = torch.arange(rows * n * 3, dtype=torch.float32).reshape(rows * n, 3)
    model = nn.Module()
    model.table = nn.Parameter(full[r * rows:(r + 1) * rows].clone())
    model.bias = nn.Parameter(torch.ones(3))  # replicated
    mark_sharded(model.table, "dp", dim=0)
    if logical_rows is not None:
        set_logical_shape(model.table, (logical_rows, 3))
    return model


def _sharded_roundtrip(root: str, save: bool, rows: int, logical_rows: int | None):
    mesh = make_mesh({"dp": dist.get_world_size() if dist.is_initialized() else 1})
    model = _sharded_model(mesh, rows, logical_rows)
    opt = torch.optim.AdamW(model.parameters(), weight_decay=0.0)
    mgr = CheckpointManager(root, mesh)
    if save:
        model.table.grad, model.bias.grad = torch.ones_like(model.table), torch.ones_like(model.bias)
        opt.step()
        mgr.save(1, LocalTensors(_Runner(model), PerParameterState(opt)), BARE)
        return None
    with torch.no_grad():
        model.table.zero_()
    mgr.load(Path(root) / "step_00000001", LocalTensors(_Runner(model), PerParameterState(opt)))
    return model.table.detach().clone(), opt.state[model.table]["exp_avg"].clone()


def test_sharded_parameter_saved_logical_and_resharded(tmp_path):
    # saved over dp=4 with 3 rows each, but only 10 logical rows (2 rows of padding on the last rank)
    spawn(_sharded_roundtrip, 4, str(tmp_path), True, 3, 10)
    whole, exp_avg = _sharded_roundtrip(str(tmp_path), False, 10, None)  # one process: the logical tensor
    # one AdamW step with unit gradients moves every weight by -lr (1e-3), up to fp32 rounding
    assert_close(whole, torch.arange(30, dtype=torch.float32).reshape(10, 3) - 1e-3, rtol=0, atol=1e-5)
    assert_close(exp_avg, torch.full((10, 3), 0.1))  # (1 - beta1) * grad
    halves = spawn(_sharded_roundtrip, 2, str(tmp_path), False, 5, None)  # dp=2: 5 rows each
    assert_close(torch.cat([h[0] for h in halves]), whole, rtol=0, atol=0)


# ---- integrity: truncation, flipped bytes, fallback ---------------------------------------
def _tiny_state(seed: int):
    cfg = tiny_config("fault.heartbeat_s=0")
    trainer, model, runner, mesh = build_trainer(cfg, init_seed=seed)
    return cfg, mesh, model, runner, trainer


def _shard_file(ckpt: Path) -> Path:
    return next(f for f in ckpt.iterdir() if f.suffix == ".distcp")


def test_truncated_and_flipped_shards_fall_back_to_previous(tmp_path):
    cfg, mesh, model, runner, trainer = _tiny_state(0)
    mgr = CheckpointManager(tmp_path, mesh, keep=5)
    weights = {}
    for step in (1, 2, 3):
        trainer.train_step(step)
        mgr.save(step, trainer.state.tensors, BARE)
        weights[step] = model.lm_head.weight.detach().clone()
    newest = tmp_path / "step_00000003"
    shard = _shard_file(newest)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated
    middle = _shard_file(tmp_path / "step_00000002")
    data = bytearray(middle.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, same size
    middle.write_bytes(bytes(data))

    messages: list[str] = []
    found = latest_valid(tmp_path, messages.append)
    assert found is not None and found[0].name == "step_00000001"
    assert "step_00000003" in messages[0] and "truncated" in messages[0] and shard.name in messages[0]
    assert "step_00000002" in messages[1] and "checksum" in messages[1] and middle.name in messages[1]

    _, mesh2, model2, runner2, trainer2 = _tiny_state(7)
    mgr.load(found[0], trainer2.state.tensors)
    assert torch.equal(model2.lm_head.weight, weights[1])
    with pytest.raises(CheckpointError, match="checksum"):
        verify(tmp_path / "step_00000002")  # an explicit path is verified too, never silently used


def test_async_save_holds_the_state_of_its_step(tmp_path):
    cfg, mesh, model, runner, trainer = _tiny_state(0)
    mgr = CheckpointManager(tmp_path, mesh, async_save=True)
    trainer.train_step(0)
    at_save = model.lm_head.weight.detach().clone()
    mgr.save(1, trainer.state.tensors, BARE)
    trainer.train_step(1)  # training goes on while the files are written; the staged copy is unaffected
    mgr.wait()
    assert not torch.equal(model.lm_head.weight, at_save)
    _, _, model2, runner2, trainer2 = _tiny_state(5)
    mgr.load(latest_valid(tmp_path)[0], trainer2.state.tensors)
    assert torch.equal(model2.lm_head.weight, at_save)


# ---- safe loading ---------------------------------------------------------------------------
class _Payload:
    """Unpickling this creates a file: the proof that code from a checkpoint ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _recommit(ckpt: Path) -> None:
    """What an attacker can do: re-checksum the tampered files so the manifest matches."""
    tmp = ckpt.with_name(".tmp-evil")
    ckpt.rename(tmp)
    model = json.loads((tmp / "manifest.json").read_text())["model"]
    (tmp / "manifest.json").unlink()
    commit(tmp, ckpt, 1, {"model": model})


def test_malicious_pickle_is_refused_and_nothing_runs(tmp_path):
    cfg, mesh, model, runner, trainer = _tiny_state(0)
    trainer.train_step(0)
    mgr = CheckpointManager(tmp_path / "ck", mesh)
    mgr.save(1, trainer.state.tensors, BARE)
    ckpt = tmp_path / "ck" / "step_00000001"
    marker = tmp_path / "pwned"

    # 1. every tensor entry pointed at a torch.save file whose pickle calls open() (checksums redone)
    shard = _shard_file(ckpt)
    good, good_md = shard.read_bytes(), (ckpt / METADATA_FILE).read_text()
    buf = io.BytesIO()
    torch.save(_Payload(str(marker)), buf)  # saving records the call; only unpickling would run it
    shard.write_bytes(buf.getvalue())
    doc = json.loads(good_md)
    for entry in doc["storage"]:
        entry.update(offset=0, length=len(buf.getvalue()))
    (ckpt / METADATA_FILE).write_text(json.dumps(doc))
    _recommit(ckpt)
    assert verify(ckpt)  # the manifest is consistent: only safe loading stands in the way
    with pytest.raises(CheckpointError, match="refused to unpickle"):
        mgr.load(ckpt, trainer.state.tensors)
    assert not marker.exists()

    # 2. DCP's stock pickled metadata instead of JSON: never read
    shard.write_bytes(good)
    (ckpt / METADATA_FILE).unlink()
    evil = pickle.dumps(_Payload(str(marker)))
    (ckpt / ".metadata").write_bytes(evil)
    _recommit(ckpt)
    with pytest.raises(CheckpointError, match=METADATA_FILE):
        verify(ckpt)
    with pytest.raises(FileNotFoundError):
        mgr.load(ckpt, trainer.state.tensors)
    assert not marker.exists()

    # 3. JSON metadata that names a non-tensor (pickled bytes) entry
    (ckpt / ".metadata").unlink()
    doc = {"version": "1", "tensors": {"x": {"dtype": "pickle", "size": [], "chunks": []}}, "storage": []}
    (ckpt / METADATA_FILE).write_text(json.dumps(doc))
    _recommit(ckpt)
    with pytest.raises(UnsafeCheckpointError):
        mgr.load(ckpt, trainer.state.tensors)
    assert not marker.exists()
    assert not any("pickle" in f.name for f in os.scandir(ckpt))


# ---- a full disk ----------------------------------------------------------------------------------
def test_disk_full_while_writing_the_manifest_stops_in_one_line(tmp_path, monkeypatch):
    cfg, mesh, model, runner, trainer = _tiny_state(0)
    mgr = CheckpointManager(tmp_path, mesh)
    trainer.train_step(0)
    mgr.save(1, trainer.state.tensors, BARE)

    def over_quota(tmp: Path, manifest: dict) -> None:
        (tmp / "manifest.json").write_text("{")  # what was written before the quota ran out
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(tmp / "manifest.json"))
    monkeypatch.setattr(checkpoint, "write_manifest", over_quota)
    with pytest.raises(FatalError) as err:
        mgr.save(2, trainer.state.tensors, BARE)
    assert str(err.value) == (f"disk quota exceeded (EDQUOT) writing checkpoint {tmp_path / '.tmp-step_00000002'}; "
                              f"the previous checkpoint {tmp_path / 'step_00000001'} is intact")
    assert sorted(os.listdir(tmp_path)) == ["step_00000001"]
    verify(tmp_path / "step_00000001")


def _checkpoint_bytes(root: Path) -> int:
    """The size of one checkpoint of the tiny model with its AdamW state, saved by one process."""
    cfg, mesh, model, runner, trainer = _tiny_state(0)
    trainer.train_step(0)
    CheckpointManager(root, mesh).save(1, trainer.state.tensors, BARE)
    return sum(f.stat().st_size for f in (root / "step_00000001").iterdir())


def _fill_disk(dirs: list[str]) -> list[tuple[bool, str]]:
    """Train 6 steps on dp=2, checkpointing every 2, into each dir (synchronous, then async saves)."""
    out = []
    for d, async_save in zip(dirs, ("false", "true")):
        cfg = tiny_config("parallel.dp=2", "train.steps=6", "checkpoint.every=2", "fault.heartbeat_s=0",
                          f'checkpoint.dir="{d}"', f"checkpoint.async_save={async_save}")
        try:
            build_trainer(cfg)[0].fit()
            out.append((False, "no error"))
        except FatalError as err:
            out.append((True, str(err)))
    return out


def test_disk_full_stops_every_rank_in_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a disk that fills up) needs root")
    # room for the step-2 checkpoint (two ranks add their RNG states), not for step 4's beside it
    size_kib = _checkpoint_bytes(tmp_path / "measure") * 3 // 2 // 1024
    dirs = [tmp_path / "sync", tmp_path / "async"]
    mounted = []
    try:
        for d in dirs:
            d.mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(d)], check=True)
            mounted.append(d)
        results = spawn(_fill_disk, 2, [str(d) for d in dirs])
        for d, by_rank in zip(dirs, zip(*results)):
            for fatal, message in by_rank:
                assert fatal, message
                assert message == (f"no space left on device (ENOSPC) writing checkpoint {d / '.tmp-step_00000004'}; "
                                   f"the previous checkpoint {d / 'step_00000002'} is intact")
            assert sorted(os.listdir(d)) == ["step_00000002"]  # the partial step 4 is gone
            assert verify(d / "step_00000002")["step"] == 2
    finally:
        for d in mounted:
            subprocess.run(["umount", str(d)], check=False)
