"""Every bad input of a command is refused before any work or process: exit 2, one line on stderr
naming the argument, no traceback.

BAD is the table: one (argv, the text the error line must contain) row per case. `{tmp}` in an
argument is a folder holding the FILES below. Rows for more commands join the same table.
"""

import json
import multiprocessing.process
import subprocess
import sys

import numpy as np
import pytest

# imported now, not inside a test: a first matplotlib import may run fc-list, which no_spawn forbids
import tessel.calibrate.bench  # noqa: F401
import tessel.calibrate.topology_probe  # noqa: F401
import tessel.cli
import tessel.observe.plots  # noqa: F401
import tessel.planning  # noqa: F401
from tessel.comm.topology import Topology
from tests.helpers import write_recipe

ROW = {"loss": 5.5, "tokens_per_s": 1000.0, "lr": 1e-3}
FILES = {
    "good.jsonl": "".join(json.dumps({"step": s, **ROW}) + "\n" for s in range(3)),
    "not_json.jsonl": "step 0: loss 5.5\n",
    "no_loss.jsonl": json.dumps({"step": 0, "lr": 1e-3, "tokens_per_s": 1.0}) + "\n",
    "empty.jsonl": "",
    "a_file": "not a folder\n",
}
UNWRITABLE = "/proc/tessel/out"  # /proc takes no new files, not even from root

BAD = [
    # plan
    (["plan", "--world", "0"], "--world"),
    (["plan", "--world", "abc"], "--world"),  # a usage error of the parser, one line too
    (["plan", "--global-batch", "0"], "--global-batch"),
    (["plan", "--top", "0"], "--top"),
    (["plan", "--cluster", "tpu"], "--cluster"),
    (["plan", "--model", "gpt-17"], "--model"),
    (["plan", "--precision", "fp8"], "--precision"),
    (["plan", "--out", "{tmp}"], "--out"),  # a folder
    (["plan", "--out", UNWRITABLE + "/plan.toml"], "--out"),
    (["plan", "--out", "{tmp}/a_file/plan.toml"], "--out"),  # its parent is a file
    (["plan", "--cluster", "this", "--world", "1", "--layout", "dp=2"], "--layout"),  # before measuring
    (["plan", "--bogus"], "--bogus"),
    # simulate
    (["simulate", "--world", "-1"], "--world"),
    (["simulate", "--trace", UNWRITABLE + "/trace.json"], "--trace"),
    (["simulate", "--png", "{tmp}"], "--png"),
    # probe
    (["probe", "--world", "0"], "--world"),
    (["probe", "--size-mb", "0"], "--size-mb"),
    (["probe", "--reps", "0"], "--reps"),
    (["probe", "--out", "{tmp}"], "--out"),
    # bench comm
    (["bench", "comm", "--sizes", "1X"], "--sizes"),
    (["bench", "comm", "--sizes", "4K,0"], "--sizes"),
    (["bench", "comm", "--world", "0"], "--world"),
    (["bench", "comm", "--iters", "0"], "--iters"),
    (["bench", "comm", "--iters", "x"], "--iters"),
    (["bench", "comm", "--warmup", "-1"], "--warmup"),
    (["bench", "comm", "--ops", "all_reduce,bcast"], "--ops"),
    (["bench", "comm", "--algorithms", "tree"], "--algorithms"),
    (["bench", "comm", "--ops", "all_gather", "--algorithms", "hierarchical"], "--algorithms"),  # no rows
    (["bench", "comm", "--world", "4", "--node-size", "3"], "--node-size"),
    (["bench", "comm", "--node-size", "0"], "--node-size"),
    (["bench", "comm", "--topology", "{tmp}/missing.json"], "--topology"),
    (["bench", "comm", "--topology", "{tmp}/not_json.jsonl"], "--topology"),
    (["bench", "comm", "--world", "4", "--topology", "{tmp}/topology2.json"], "--topology"),  # 2 ranks
    (["bench", "comm", "--json", "{tmp}"], "--json"),
    # plot
    (["plot"], "METRICS"),
    (["plot", "{tmp}/missing.jsonl"], "METRICS"),
    (["plot", "{tmp}/not_json.jsonl"], "METRICS"),
    (["plot", "{tmp}/no_loss.jsonl"], "'loss'"),
    (["plot", "{tmp}/empty.jsonl"], "METRICS"),
    (["plot", "{tmp}/good.jsonl", "--out", "{tmp}"], "--out"),
    (["plot", "{tmp}/good.jsonl", "--out", UNWRITABLE + "/curves.png"], "--out"),
    # train: the command line
    (["train", "{tmp}/tiny.toml", "--resume", "{tmp}/missing"], "--resume"),
    (["train", "{tmp}/tiny.toml", "--resume", "{tmp}/ckroot"], "--resume"),  # the checkpoints root
    (["train", "{tmp}/tiny.toml", "--resume", "{tmp}/ckroot/step_00000002"], "--resume"),  # no manifest
    (["train", "{tmp}/tiny.toml", "--resume", ""], "--resume"),
    (["train", "{tmp}/tiny.toml", "--nproc-per-node", "0"], "--nproc-per-node"),
    (["train", "{tmp}/tiny.toml", "--nproc-per-node", "3"], "--nproc-per-node"),  # the layout cannot take 3
    (["train", "{tmp}/tiny.toml", "--max-restarts", "-1"], "--max-restarts"),
    (["train", "{tmp}/tiny.toml", "--nnodes", "4:2"], "--nnodes"),
    (["train", "{tmp}/tiny.toml", "--nnodes", "3"], "--nnodes"),  # no rendezvous endpoint
    (["train", "{tmp}/tiny.toml", "--nnodes", "two"], "--nnodes"),
    (["train", "{tmp}/tiny.toml", "--grace", "0"], "--grace"),
    (["train", "{tmp}/tiny.toml", "--overwrite", "--resume", "auto"], "--overwrite"),
    # train: the recipe and the fields it sets
    (["train", "{tmp}/latin1.toml"], "recipe"),  # not UTF-8
    (["train", "{tmp}"], "recipe"),  # a folder
    (["train", "{tmp}/tiny.toml", "--set", "parallel.tp=3"], "parallel.tp"),
    (["train", "{tmp}/tiny.toml", "--set", "train.seed=-1"], "train.seed"),
    (["train", "{tmp}/tiny.toml", "--set", "train.seed=18446744073709551616"], "train.seed"),
    (["train", "{tmp}/tiny.toml", "--set", 'train.sample_prompt=""', "--set", "train.sample_tokens=8"],
     "train.sample_prompt"),  # crashed after all of training
    (["train", "{tmp}/tiny.toml", "--set", 'runtime.device="cuda"'], "runtime.device"),  # no GPU here
    (["train", "{tmp}/tiny.toml", "--set", 'runtime.backend="nccl"'], "runtime.backend"),
    (["train", "{tmp}/tiny.toml", "--set", 'runtime.topology="{tmp}/not_json.jsonl"'], "runtime.topology"),
    (["train", "{tmp}/tiny.toml", "--set", "model.n_layer=100000"], "memory"),
    (["train", "{tmp}/tiny.toml", "--set", "train.global_batch=1000000000"], "memory"),
    # train: folders
    (["train", "{tmp}/tiny.toml", "--set", 'logging.out_dir="{tmp}/a_file"'], "logging.out_dir"),
    (["train", "{tmp}/tiny.toml", "--set", 'logging.out_dir="' + UNWRITABLE + '"'], "logging.out_dir"),
    (["train", "{tmp}/tiny.toml", "--set", "checkpoint.every=2", "--set", 'checkpoint.dir="{tmp}/a_file"'],
     "checkpoint.dir"),
    (["train", "{tmp}/tiny.toml", "--set", 'logging.out_dir="{tmp}/used"'], "logging.out_dir"),  # a run's files
    # train: data
    (["train", "{tmp}/tiny.toml", "--set", 'data.source="bin"', "--set", 'data.path="{tmp}/empty.bin"'],
     "data.path"),
    (["train", "{tmp}/tiny.toml", "--set", 'data.source="bin"', "--set", 'data.path="{tmp}/odd.bin"'],
     "data.path"),
    (["train", "{tmp}/tiny.toml", "--set", 'data.source="bin"', "--set", 'data.path="{tmp}/short.bin"'],
     "train.seq_len"),
    (["train", "{tmp}/tiny.toml", "--set", 'data.source="bin"', "--set", 'data.path="{tmp}/oov.bin"'],
     "data.path"),  # ids >= vocab_size: tp=1 crashed
    (["train", "{tmp}/tiny.toml", "--set", 'data.source="bin"', "--set", 'data.path="{tmp}/oov.bin"',
      "--set", "parallel.tp=2", "--set", "parallel.dp=1"], "data.path"),  # tp=2 trained on them silently
]


@pytest.fixture
def tmp(tmp_path):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    Topology(world_size=2, nodes=[[0, 1]]).save(tmp_path / "topology2.json")
    write_recipe(tmp_path / "tiny.toml", "parallel.dp=2", f'logging.out_dir="{tmp_path / "out"}"')
    (tmp_path / "latin1.toml").write_bytes("[model]\n# caf\xe9\nn_layer = 2\n".encode("latin-1"))
    (tmp_path / "ckroot" / "step_00000002").mkdir(parents=True)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text(FILES["good.jsonl"])
    tokens = np.arange(1000, dtype=np.uint16) % 256
    tokens.tofile(tmp_path / "train.bin")
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "odd.bin").write_bytes(tokens.tobytes()[:-1])
    tokens[:10].tofile(tmp_path / "short.bin")
    np.where(np.arange(1000) == 500, 300, tokens).astype(np.uint16).tofile(tmp_path / "oov.bin")
    return tmp_path


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test on any new process: torchrun (_standalone), subprocesses, multiprocessing."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a process was spawned for a bad input")
    monkeypatch.setattr(tessel.cli, "_standalone", forbidden)
    monkeypatch.setattr(subprocess, "Popen", forbidden)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", forbidden)


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """tessel.cli.main in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_:
        tessel.cli.main(argv)
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def filled(argv: list[str], tmp) -> list[str]:
    return [a.format(tmp=tmp) for a in argv]


def assert_refused(code: int, out: str, err: str, field: str) -> None:
    lines = err.splitlines()
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert field in lines[0], lines[0]
    assert "Traceback" not in out + err


@pytest.mark.parametrize("argv,field", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_refused_in_one_line(argv, field, tmp, no_spawn, capsys):
    assert_refused(*run_cli(filled(argv, tmp), capsys), field)


def test_the_table_covers_every_command():
    assert len(BAD) >= 30
    assert {a[0] for a, _ in BAD} >= {"train", "plan", "simulate", "probe", "bench", "plot"}


REAL = [  # the installed entry point, in a process of its own
    (["plan", "--world", "0"], "--world"),
    (["plan", "--world", "abc"], "--world"),
    (["bench", "comm", "--sizes", "1X"], "--sizes"),
    (["plot", "{tmp}/not_json.jsonl"], "METRICS"),
    (["train", "{tmp}/tiny.toml", "--set", 'logging.out_dir="{tmp}/used"'], "logging.out_dir"),
    (["train", "{tmp}/tiny.toml", "--set", 'data.source="bin"', "--set", 'data.path="{tmp}/oov.bin"'],
     "data.path"),
]


@pytest.mark.parametrize("argv,field", REAL, ids=[" ".join(a) for a, _ in REAL])
def test_real_entry_point_prints_one_line(argv, field, tmp):
    proc = subprocess.run([sys.executable, "-m", "tessel", *filled(argv, tmp)], capture_output=True,
                          text=True, timeout=120)
    assert_refused(proc.returncode, proc.stdout, proc.stderr, field)


# valid inputs still run: to the end, or up to the process they spawn


def test_plan_json_exits_0(capsys):
    code, out, _ = run_cli(["plan", "--model", "gpt3-1.3b", "--world", "16", "--json"], capsys)
    assert code == 0 and json.loads(out)["world"] == 16


def test_plot_writes_a_png(tmp, capsys):
    png = tmp / "new" / "curves.png"
    code, out, _ = run_cli(["plot", str(tmp / "good.jsonl"), "--out", str(png)], capsys)
    assert code == 0 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv", [
    ["bench", "comm", "--world", "2", "--sizes", "4K,1.5M", "--node-size", "1", "--json", "{tmp}/b/rows.json"],
    ["bench", "comm", "--world", "2", "--ops", "all_reduce", "--algorithms", "ring", "--topology",
     "{tmp}/topology2.json"],
    ["probe", "--world", "2", "--out", "{tmp}/t/topology.json"],
])
def test_valid_flags_reach_the_launch(argv, tmp, monkeypatch, capsys):
    launched = []
    monkeypatch.setattr(tessel.cli, "_standalone", lambda nproc: launched.append(nproc) or 0)
    code, _, err = run_cli(filled(argv, tmp), capsys)
    assert (code, err, launched) == (0, "", [2])


def test_help_still_exits_0(capsys):
    code, out, _ = run_cli(["plan", "--help"], capsys)
    assert code == 0 and "--world" in out
