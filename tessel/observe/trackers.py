"""Experiment trackers beside metrics.jsonl: Weights & Biases and MLflow, fed the same rows (logging.trackers).

Rank 0 opens them with the run (tessel.train.trainer) and hands each the run's
config once, every metrics row as it is written, and the summary at the end.
TensorBoard stays in tessel.observe.metrics (its writer predates this module).

- W&B: offline by default (logging.wandb_mode): a run folder under
  `out_dir/wandb/` that `wandb sync` uploads later; the run's id is tessel's
  run id, so a resumed attempt continues the same W&B run.
- MLflow: a file store at `out_dir/mlruns` unless logging.mlflow_uri names
  another; the MLflow run carries the tag `tessel.run_id` and a resumed attempt
  logs into it again. The config is logged as params (flattened) and as
  `config.json`, the summary as `summary.json`.

Both are optional extras (`pip install 'tessel[wandb]'`, `'tessel[mlflow]'`);
`check_installed` refuses a recipe that names one that is missing, before any
process starts.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Protocol

from tessel.config import Config, ConfigError

PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny")}  # tracker: (module, pip name)


class Tracker(Protocol):
    """Where a run's metrics rows go beside metrics.jsonl."""

    def log(self, step: int, row: dict) -> None: ...

    def finish(self, summary: dict | None) -> None:
        """The run's summary; None when it stopped early (a signal) and a resume will continue it."""


def check_installed(cfg: Config) -> None:
    """ConfigError naming logging.trackers for a tracker whose package is not installed (imports nothing)."""
    for name in cfg.logging.active_trackers:
        if name in PACKAGES and importlib.util.find_spec(PACKAGES[name][0]) is None:
            raise ConfigError("logging.trackers", f"'{name}' needs the {PACKAGES[name][1]} package, which is not "
                              f"installed: pip install 'tessel[{name}]' (or remove it from logging.trackers)")


def open_trackers(cfg: Config, run_id: str | None, resumed: bool) -> list[Tracker]:
    """The run's W&B and MLflow trackers (TensorBoard is the metrics log's own)."""
    check_installed(cfg)  # a rank under a torchrun of the user's own has not been checked before
    config = cfg.model_dump(mode="json")
    opened: list[Tracker] = []
    for name in cfg.logging.active_trackers:
        if name == "wandb":
            opened.append(WandbTracker(cfg, run_id, resumed, config))
        elif name == "mlflow":
            opened.append(MlflowTracker(cfg, run_id, resumed, config))
    return opened


def numbers(row: dict) -> dict[str, float]:
    """The row's scalars (a tracker plots numbers; lists and text stay in metrics.jsonl)."""
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


class WandbTracker:
    def __init__(self, cfg: Config, run_id: str | None, resumed: bool, config: dict):
        import wandb  # deferred: an optional extra, a second to import
        folder = Path(cfg.logging.out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.logging.project, id=run_id, name=run_id, dir=str(folder), mode=cfg.logging.wandb_mode,
            config=config, resume="allow" if resumed else None,
            # tessel prints its own progress; W&B neither captures the console nor samples the machine
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True, x_disable_meta=True))

    def log(self, step: int, row: dict) -> None:
        self.run.log(numbers(row), step=step)

    def finish(self, summary: dict | None) -> None:
        if summary:
            self.run.summary.update(summary)
        self.run.finish()


class MlflowTracker:
    TAG = "tessel.run_id"

    def __init__(self, cfg: Config, run_id: str | None, resumed: bool, config: dict):
        uri = cfg.logging.mlflow_uri
        if uri is None:
            # MLflow 3 keeps its file store in maintenance mode and asks for this to use it
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (Path(cfg.logging.out_dir) / "mlruns").absolute().as_uri()
        from mlflow.entities import Param  # deferred: an optional extra, a second to import
        from mlflow.tracking import MlflowClient  # deferred: as above
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(cfg.logging.project)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(cfg.logging.project))
        earlier = self.client.search_runs([experiment_id], f"tags.`{self.TAG}` = '{run_id}'") if resumed else []
        if earlier:  # a resumed attempt goes on logging into the run it continues
            self.run_id = earlier[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return
        self.run_id = self.client.create_run(experiment_id, run_name=run_id,
                                             tags={self.TAG: run_id or ""}).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in _flatten(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])
        self.client.log_dict(self.run_id, config, "config.json")

    def log(self, step: int, row: dict) -> None:
        from mlflow.entities import Metric  # deferred: loaded already by __init__
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in numbers(row).items()])

    def finish(self, summary: dict | None) -> None:
        if summary:
            self.client.log_dict(self.run_id, summary, "summary.json")
        # None: stopped early (a resume goes on with this run); {}: finished with nothing new to add
        self.client.set_terminated(self.run_id, status="KILLED" if summary is None else "FINISHED")


def _flatten(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        elif value is not None:
            flat[f"{prefix}{key}"] = value
    return flat
