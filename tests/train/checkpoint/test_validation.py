"""Checkpoint validation before use: manifest schema, files and symlinks, DCP chunk coverage, shapes,
the run that owns a checkpoint; and `--resume auto` falling back past broken ones end to end."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessel.train.checkpoint.manager import (CheckpointError, CheckpointManager, check_resume_target, choose, commit,
                                             latest_valid, newest_run_id, prune, run_model, step_dir, verify)
from tessel.train.checkpoint.safe_dcp import METADATA_FILE
from tests.helpers import ROOT, build_trainer, metrics_rows, tiny_config

RUN = "run-a"


def _trainer(*overrides: str, seed: int = 0):
    cfg = tiny_config("fault.heartbeat_s=0", *overrides)
    trainer, model, runner, mesh = build_trainer(cfg, init_seed=seed)
    return cfg, trainer, model, runner, mesh


def _info(cfg, trainer) -> dict:
    return trainer.state.manifest_info(cfg, 1)


@pytest.fixture(scope="module")
def series(tmp_path_factory) -> Path:
    """Two good checkpoints of run RUN (steps 1 and 2) with the trainer's full manifest."""
    root = tmp_path_factory.mktemp("series")
    cfg, trainer, _, runner, mesh = _trainer()
    mgr = CheckpointManager(root, mesh, keep=5, run_id=RUN)
    for step in (1, 2):
        trainer.train_step(step - 1)
        mgr.save(step, trainer.state.tensors, _info(cfg, trainer))
    return root


@pytest.fixture
def ckpts(series, tmp_path) -> Path:
    root = tmp_path / "ck"
    shutil.copytree(series, root)
    return root


MODEL = run_model(tiny_config())


def _edit_manifest(ckpt: Path, edit) -> None:
    doc = json.loads((ckpt / "manifest.json").read_text())
    doc = edit(doc) or doc
    (ckpt / "manifest.json").write_text(json.dumps(doc))


def _rewrite(ckpt: Path, name: str, data: bytes) -> None:
    """Replace a file and re-checksum it in the manifest (what someone with write access can do)."""
    (ckpt / name).write_bytes(data)
    _edit_manifest(ckpt, lambda doc: doc["files"].__setitem__(
        name, {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}))


def _edit_metadata(ckpt: Path, edit) -> None:
    doc = json.loads((ckpt / METADATA_FILE).read_text())
    edit(doc)
    _rewrite(ckpt, METADATA_FILE, json.dumps(doc).encode())


def _one_skip(root: Path, **expect) -> tuple[tuple[Path, dict], str]:
    messages: list[str] = []
    found = latest_valid(root, messages.append, **expect)
    assert found is not None and found[0].name == "step_00000001", messages
    assert len(messages) == 1 and "step_00000002" in messages[0] and "\n" not in messages[0], messages
    return found, messages[0]


# ---- manifests of the wrong shape ---------------------------------------------------------------
def _drop(*path):
    def edit(doc):
        for key in path[:-1]:
            doc = doc[key]
        del doc[path[-1]]
    return edit


def _set(key, value):
    return lambda doc: doc.__setitem__(key, value)


def _file_entry(key, value):
    return lambda doc: doc["files"][METADATA_FILE].__setitem__(key, value)


MALFORMED = {  # name: (edit, what the reason names)
    "entry without sha256": (_drop("files", METADATA_FILE, "sha256"), "sha256"),
    "entry without bytes": (_drop("files", METADATA_FILE, "bytes"), "bytes"),
    "files a string": (_set("files", METADATA_FILE), "files"),
    "files null": (_set("files", None), "files"),
    "no step": (_drop("step"), "step"),
    "no model": (_drop("model"), "model"),
    "step a string": (_set("step", "2"), "step"),
    "bytes negative": (_file_entry("bytes", -1), "bytes"),
    "sha256 not hex": (_file_entry("sha256", "z" * 64), "sha256"),
    "run_id a number": (_set("run_id", 7), "run_id"),
    "model a list": (_set("model", [2, 4]), "model"),
    "no sampler": (_drop("sampler"), "sampler"),
    "layout without dp": (_drop("layout", "dp"), "layout/dp"),
    "a list, not an object": (lambda doc: [doc], "not a tessel-checkpoint-1 manifest"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_manifest_is_skipped_for_the_older_good_one(ckpts, name):
    edit, names = MALFORMED[name]
    _edit_manifest(ckpts / "step_00000002", edit)
    found, message = _one_skip(ckpts, model=MODEL, run_id=None)
    assert names in message, message
    assert found[1]["step"] == 1
    with pytest.raises(CheckpointError, match=re.escape(names)):
        verify(ckpts / "step_00000002", MODEL)


# ---- another model -------------------------------------------------------------------------------
def test_another_models_checkpoint_is_skipped_by_auto_and_refused_by_path(ckpts):
    _edit_manifest(ckpts / "step_00000002", lambda doc: doc["model"].update(n_layer=3))
    _, message = _one_skip(ckpts, model=MODEL)
    assert "another model: n_layer 3 (this run: 2)" in message
    with pytest.raises(CheckpointError, match="another model"):
        choose(ckpts, str(ckpts / "step_00000002"), model=MODEL)
    assert latest_valid(ckpts)[0].name == "step_00000002"  # no model given: any model will do


def test_a_checkpoint_from_before_a_new_model_field_still_loads(ckpts):
    # saved before model.sliding_window existed: its manifest does not name it; unset is its default, null
    _edit_manifest(ckpts / "step_00000002", lambda doc: doc["model"].pop("sliding_window"))
    assert choose(ckpts, str(ckpts / "step_00000002"), model=MODEL) == ckpts / "step_00000002"
    assert latest_valid(ckpts, model=MODEL)[0].name == "step_00000002"  # --resume auto takes it too


# ---- files: symlinks, names, what the metadata reads --------------------------------------------
def _shard(ckpt: Path) -> Path:
    return next(f for f in ckpt.iterdir() if f.suffix == ".distcp")


def _symlink_outside(ckpt: Path, name: str, tmp_path: Path) -> None:
    outside = tmp_path / f"outside-{name}"
    shutil.copy(ckpt / name, outside)  # the same bytes: size and checksum still match
    (ckpt / name).unlink()
    (ckpt / name).symlink_to(outside)


def _storage_to(name: str):
    def edit(doc):
        for s in doc["storage"]:
            s["path"] = name
    return edit


def test_symlinked_shard_and_manifest_are_refused(ckpts, tmp_path):
    newest = ckpts / "step_00000002"
    shard = _shard(newest).name
    _symlink_outside(newest, shard, tmp_path)
    _, message = _one_skip(ckpts)
    assert f"{shard} is a symlink" in message
    _symlink_outside(ckpts / "step_00000001", "manifest.json", tmp_path)
    with pytest.raises(CheckpointError, match="manifest.json is a symlink"):
        verify(ckpts / "step_00000001")


def test_metadata_reads_only_files_the_manifest_lists(ckpts):
    newest = ckpts / "step_00000002"
    shutil.copy(_shard(newest), newest / "extra.distcp")  # in the folder, not in the manifest
    _edit_metadata(newest, _storage_to("extra.distcp"))
    _, message = _one_skip(ckpts)
    assert "'extra.distcp', a file the manifest does not list" in message
    older = ckpts / "step_00000001"
    _edit_manifest(older, lambda doc: doc["files"].__setitem__("sub/x.distcp", doc["files"][_shard(older).name]))
    with pytest.raises(CheckpointError, match="not a plain file name"):
        verify(older)


# ---- DCP metadata must cover every tensor exactly -----------------------------------------------
TABLE = "model/tok_emb.weight"  # (256, 32), one chunk when saved by one process


def _chunks(doc) -> list[dict]:
    return doc["tensors"][TABLE]["chunks"]


COVERAGE = {  # name: (edit of the metadata, what the reason says)
    "chunk out of bounds": (lambda doc: _chunks(doc)[0].update(offsets=[1, 0]), "outside the tensor's size"),
    "overlapping chunks": (lambda doc: _chunks(doc).append(dict(_chunks(doc)[0])), "overlap"),
    "a gap": (lambda doc: _chunks(doc)[0]["sizes"].__setitem__(0, 255), "chunks hold 8160 of its 8192 elements"),
    "a chunk without storage": (lambda doc: doc.__setitem__(
        "storage", [s for s in doc["storage"] if s["index"]["fqn"] != TABLE]), "has no storage entry"),
    "storage past the file's end": (lambda doc: next(s for s in doc["storage"] if s["index"]["fqn"] == TABLE)
                                    .update(length=10 ** 9), "from bytes 0..1000000000"),
}


@pytest.mark.parametrize("name", list(COVERAGE))
def test_metadata_that_does_not_cover_a_tensor_exactly_is_skipped(ckpts, name):
    edit, says = COVERAGE[name]
    _edit_metadata(ckpts / "step_00000002", edit)
    _, message = _one_skip(ckpts)
    assert TABLE in message and says in message, message


# ---- shapes: before anything is loaded; and the pre-spawn check of --resume PATH ----------------------
EXP_AVG = "optim/layers.0.attn.wq.weight/exp_avg"  # (32, 32)


def _widen(fqn: str):
    """The tensor one row taller in the metadata (still covered exactly: its chunk grows too)."""
    def edit(doc):
        doc["tensors"][fqn]["size"][0] += 1
        doc["tensors"][fqn]["chunks"][0]["sizes"][0] += 1
    return edit


def test_optimizer_state_of_another_shape_is_refused_before_loading(ckpts):
    ckpt = ckpts / "step_00000002"
    _edit_metadata(ckpt, _widen(EXP_AVG))
    verify(ckpt, MODEL)  # consistent in itself: only the shapes tell
    cfg, trainer, model, runner, mesh = _trainer(seed=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"'{EXP_AVG}' has shape \[33, 32\] in the checkpoint, "
                                              r"but this run's is \[32, 32\]"):
        CheckpointManager(ckpts, mesh).load(ckpt, trainer.state.tensors)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing was loaded
    with pytest.raises(CheckpointError, match=rf"step_00000002: '{EXP_AVG}' has shape \[33, 32\]"):
        check_resume_target(ckpt, cfg)


def test_model_of_another_shape_is_refused_before_loading(ckpts):
    _, trainer, _, runner, mesh = _trainer("model.d_model=64")
    with pytest.raises(CheckpointError, match=r"'model/tok_emb.weight' has shape \[256, 32\] in the checkpoint, "
                                              r"but this run's is \[256, 64\]"):
        CheckpointManager(ckpts, mesh).load(ckpts / "step_00000002", trainer.state.tensors)


def test_check_resume_target_says_what_is_wrong_in_one_line(ckpts, tmp_path):
    cfg = tiny_config()
    reasons = {}
    for name, path, c in [("missing", ckpts / "step_00000009", cfg), ("root", ckpts, cfg),
                          ("file", ckpts / "step_00000002" / "manifest.json", cfg),
                          ("model", ckpts / "step_00000002", tiny_config("model.n_layer=3"))]:
        with pytest.raises(CheckpointError) as err:
            check_resume_target(path, c)
        reasons[name] = str(err.value)
        assert "\n" not in reasons[name]
    assert reasons["missing"] == f"{ckpts / 'step_00000009'} does not exist"
    assert "is a folder of checkpoints" in reasons["root"] and "--resume auto" in reasons["root"]
    assert f"--resume {ckpts / 'step_00000002'}" in reasons["root"]
    assert "is a file" in reasons["file"]
    assert "another model: n_layer 2 (this run: 3)" in reasons["model"]
    _edit_manifest(ckpts / "step_00000001", _drop("files", METADATA_FILE, "sha256"))
    with pytest.raises(CheckpointError, match="malformed manifest.json: files/dcp_metadata.json/sha256"):
        check_resume_target(ckpts / "step_00000001", cfg)
    assert check_resume_target(ckpts / "step_00000002", cfg)["step"] == 2


# ---- which run owns a checkpoint ----------------------------------------------------------------
def _adopt(src: Path, dst: Path, run_id: str | None) -> None:
    """A copy of checkpoint src at dst, as if run `run_id` had written it (its step is the folder's)."""
    shutil.copytree(src, dst)
    _edit_manifest(dst, lambda doc: doc.update(run_id=run_id, step=int(dst.name.split("_")[1])))


def test_prune_counts_and_deletes_only_the_runs_own(ckpts):
    for step in (10, 12):  # an older run's later steps in the same folder
        _adopt(ckpts / "step_00000002", step_dir(ckpts, step), "old-run")
    cfg, trainer, _, runner, mesh = _trainer()
    mgr = CheckpointManager(ckpts, mesh, keep=2, run_id="new-run")
    for step in (3, 4, 5):
        mgr.save(step, trainer.state.tensors, _info(cfg, trainer))
    names = sorted(d.name for d in ckpts.iterdir())
    # run-a's 1 and 2 and old-run's 10 and 12 are not this run's; of its own, the newest 2 stay
    assert names == ["step_00000001", "step_00000002", "step_00000004", "step_00000005", "step_00000010",
                     "step_00000012"]
    prune(ckpts, 1, RUN)
    assert not (ckpts / "step_00000001").exists() and (ckpts / "step_00000002").exists()


def test_auto_takes_only_the_runs_own_checkpoints(ckpts):
    _adopt(ckpts / "step_00000002", step_dir(ckpts, 5), "run-b")
    messages: list[str] = []
    found = latest_valid(ckpts, messages.append, MODEL, run_id=RUN)
    assert found[0].name == "step_00000002"
    assert len(messages) == 1 and "step_00000005: belongs to run run-b, not to this run (run-a)" in messages[0]
    assert latest_valid(ckpts, model=MODEL)[0].name == "step_00000005"  # no run id: any run's
    # an explicit path is the user's choice: not filtered by run
    assert choose(ckpts, str(step_dir(ckpts, 5)), model=MODEL, run_id=RUN) == step_dir(ckpts, 5)
    _, _, _, _, mesh = _trainer()
    assert CheckpointManager(ckpts, mesh, run_id=RUN).find("auto", MODEL)[0].name == "step_00000002"


def test_a_run_never_replaces_another_runs_step_folder(ckpts):
    _adopt(ckpts / "step_00000002", step_dir(ckpts, 5), "run-b")
    cfg, trainer, _, runner, mesh = _trainer()
    with pytest.raises(CheckpointError, match="step_00000005 belongs to run run-b; run run-a will not replace it"):
        CheckpointManager(ckpts, mesh, run_id=RUN).save(5, trainer.state.tensors, _info(cfg, trainer))
    assert verify(step_dir(ckpts, 5), MODEL, "run-b")["run_id"] == "run-b"
    assert not any(d.name.startswith(".tmp") for d in ckpts.iterdir())  # refused before writing
    # the same run saving a step again (after a rollback) replaces its own folder
    tmp = ckpts / ".tmp-step_00000005"
    shutil.copytree(ckpts / "step_00000001", tmp)
    (tmp / "manifest.json").unlink()
    commit(tmp, step_dir(ckpts, 5), 5, {"model": MODEL}, "run-b")
    assert verify(step_dir(ckpts, 5))["step"] == 5


def test_newest_run_id_reads_the_newest_manifest_with_the_schema(ckpts, tmp_path):
    assert newest_run_id(ckpts) == RUN
    _adopt(ckpts / "step_00000002", step_dir(ckpts, 7), "run-b")
    _edit_manifest(step_dir(ckpts, 7), _drop("step"))
    (_shard(ckpts / "step_00000002")).write_bytes(b"")  # files are not checked: no hashing
    assert newest_run_id(ckpts) == RUN
    assert newest_run_id(tmp_path / "nowhere") is None


# ---- end to end: tessel train --resume auto past two broken checkpoints ----------------------------
def _tessel_train(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tessel", "train", str(ROOT / "recipes" / "tiny.toml"), "--set",
           f'logging.out_dir="{out}"', "--set", "train.eval_every=0", "--set", "train.sample_tokens=0",
           "--set", "checkpoint.every=2", *overrides]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def test_cli_resume_auto_skips_broken_manifests(tmp_path):
    out = tmp_path / "run"
    _tessel_train(out, "--set", "train.steps=6")
    ckpts = out / "checkpoints"
    assert sorted(d.name for d in ckpts.iterdir()) == ["step_00000002", "step_00000004", "step_00000006"]
    _edit_manifest(ckpts / "step_00000006", _drop("files", METADATA_FILE, "sha256"))
    _edit_manifest(ckpts / "step_00000004", _set("step", "4"))
    proc = _tessel_train(out, "--set", "train.steps=8", "--resume", "auto")
    log = proc.stderr + proc.stdout
    assert "skipping" in log and "step_00000006: malformed manifest.json: files/dcp_metadata.json/sha256" in log
    assert "step_00000004: malformed manifest.json: step: Input should be a valid integer" in log
    assert f"resumed from {ckpts / 'step_00000002'} at step 2" in log
    assert [r["step"] for r in metrics_rows(out)][-6:] == [2, 3, 4, 5, 6, 7]
