"""The trainer's interfaces are typed, not probed: every implementation has every method of its
protocol, and the trainer, its guard, its checkpoints and the parameter server ask nothing by name."""

import ast
import inspect
from pathlib import Path

import pytest

from tessel.parallel.pipeline.runner import PipelineRunner
from tessel.parallel.ps.worker import WorkerRunner
from tessel.parallel.runner import CheckpointableOptimizer, LocalRunner, Runner
from tessel.parallel.zero.optim import ZeroAdamW
from tessel.train.checkpoint.optimizer_state import OptimizerState, OwnState, PerParameterState
from tessel.train.checkpoint.tensors import LocalTensors, StateTensors
from tessel.train.cohort import Cohort
from tessel.train.mesh_cohort import MeshCohort
from tessel.train.ps.checkpoint import ServerSnapshot
from tessel.train.ps.trainer import WorkerCohort
from tests.helpers import ROOT

IMPLEMENTATIONS = [(Runner, LocalRunner), (Runner, PipelineRunner), (Runner, WorkerRunner),
                   (CheckpointableOptimizer, ZeroAdamW), (OptimizerState, PerParameterState),
                   (OptimizerState, OwnState), (StateTensors, LocalTensors), (StateTensors, ServerSnapshot),
                   (Cohort, MeshCohort), (Cohort, WorkerCohort)]


def _methods(cls) -> dict[str, list[str]]:
    """name -> parameter names (without self) of the functions a class defines or inherits."""
    return {name: list(inspect.signature(fn).parameters)[1:] for name, fn in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_")}


@pytest.mark.parametrize("protocol, cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_every_protocol_method_is_implemented_with_its_parameters(protocol, cls):
    have = _methods(cls)
    for name, params in _methods(protocol).items():
        assert name in have, f"{cls.__name__} lacks {protocol.__name__}.{name}"
        assert have[name][:len(params)] == params, f"{cls.__name__}.{name}{have[name]} vs {params}"


def test_no_probing_of_runners_or_optimizers():
    files = [*sorted((ROOT / "tessel" / "train").rglob("*.py")), ROOT / "tessel" / "parallel" / "runner.py",
             *sorted((ROOT / "tessel" / "parallel" / "ps").glob("*.py"))]
    probes = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in files
              for node in ast.walk(ast.parse(Path(path).read_text()))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr")]
    assert not probes, probes
