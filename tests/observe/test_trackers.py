"""logging.trackers: W&B (offline) and MLflow (file store) get every row of metrics.jsonl, the config and the
summary, across a resume; TensorBoard keeps its old switch; a tracker that is not installed is refused before
any process starts."""

import importlib.util
import json

import pytest

import tessel.commands.cli
from tessel.config import ConfigError
from tessel.train.trainer import Trainer
from tests.helpers import build_runner, metrics_rows, tiny_config, write_recipe
from tests.observe.wandb_records import read_run

RUN = "run0tracked"


def _fit(out, steps: int, *extra: str):
    cfg = tiny_config(f"train.steps={steps}", "checkpoint.every=3", 'logging.trackers=["tensorboard", "wandb", '
                      '"mlflow"]', "logging.tensorboard=true", 'logging.project="tiny"', *extra, out_dir=str(out))
    _, runner, mesh = build_runner(cfg)
    return Trainer(cfg, mesh, runner, 0, run_id=RUN).fit()


def test_wandb_and_mlflow_record_every_step_the_config_and_the_summary_across_a_resume(tmp_path):
    _fit(tmp_path, 3)
    summary = _fit(tmp_path, 6, 'checkpoint.resume="auto"')  # steps 3-5, appended to the same runs
    want = {}
    for row in metrics_rows(tmp_path):
        want[row["step"]] = row  # the last row of a step counts
    assert sorted(want) == list(range(6))

    # W&B: offline run folders under out_dir/wandb, one per attempt, both with tessel's run id
    files = sorted((tmp_path / "wandb").glob(f"offline-run-*-{RUN}/run-{RUN}.wandb"))
    assert len(files) == 2
    attempts = [read_run(f) for f in files]
    history = {step: row for a in attempts for step, row in a["history"].items()}
    assert sorted(history) == list(range(6))
    for step, row in want.items():  # the same numbers, exactly (both are JSON of the same floats)
        assert {k: history[step][k] for k in ("loss", "lr", "grad_norm")} == {k: row[k] for k in
                                                                               ("loss", "lr", "grad_norm")}
    assert attempts[0]["config"]["model"]["n_layer"] == 2 and attempts[0]["config"]["logging"]["project"] == "tiny"
    assert attempts[1]["summary"]["final_loss"] == summary.losses[-1] and attempts[1]["summary"]["steps"] == 3

    # MLflow: one run in the file store (tagged with the run id), resumed rather than duplicated
    (experiment,) = [d for d in (tmp_path / "mlruns").iterdir() if d.is_dir() and (d / "meta.yaml").exists()
                     and d.name != "0"]
    (run,) = [d for d in experiment.iterdir() if (d / "metrics").is_dir()]
    assert (run / "tags" / "tessel.run_id").read_text() == RUN
    for key in ("loss", "lr", "grad_norm"):
        logged = {}
        for line in (run / "metrics" / key).read_text().splitlines():
            _, value, step = line.split()
            logged[int(step)] = float(value)
        assert logged == {s: want[s][key] for s in range(6)}
    assert (run / "params" / "train.steps").read_text() == "3"  # the config as the run started it
    assert json.loads((run / "artifacts" / "config.json").read_text())["model"]["n_layer"] == 2
    assert json.loads((run / "artifacts" / "summary.json").read_text())["final_loss"] == summary.losses[-1]
    assert (tmp_path / "tensorboard").is_dir()


def test_tensorboard_switch_still_works_and_trackers_are_checked():
    assert tiny_config("logging.tensorboard=true").logging.active_trackers == ["tensorboard"]
    assert tiny_config("logging.tensorboard=false").logging.active_trackers == []
    assert tiny_config('logging.trackers=["mlflow"]').logging.active_trackers == ["mlflow"]
    with pytest.raises(ConfigError, match="logging.tensorboard"):
        tiny_config("logging.tensorboard=false", 'logging.trackers=["tensorboard"]')
    with pytest.raises(ConfigError, match="logging.trackers"):
        tiny_config('logging.trackers=["wandb", "wandb"]')


def test_a_tracker_that_is_not_installed_is_refused_before_spawning(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    recipe = write_recipe(tmp_path / "r.toml", f'logging.out_dir="{tmp_path / "out"}"')
    with pytest.raises(SystemExit) as done:
        tessel.commands.cli.main(["train", str(recipe), "--set", 'logging.trackers=["wandb"]'])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and "logging.trackers" in err and "tessel[wandb]" in err
    assert not (tmp_path / "out").exists()  # refused before the run claimed its folder
