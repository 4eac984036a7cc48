"""docs/cluster.md's two-machine commands, run as written, one per node of the network emulator."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tessel.testing.emulator import Emulator, require_root
from tests.helpers import cli_env

ROOT = Path(__file__).resolve().parents[3]


def readme_lines() -> list[str]:
    """The command lines of docs/cluster.md's 'Two machines by hand' block, one per machine."""
    text = (ROOT / "docs" / "cluster.md").read_text()
    block = re.search(r"\*\*Two machines by hand\.\*\*.*?```bash\n(.*?)```", text, re.S)
    assert block, "docs/cluster.md: no 'Two machines by hand' block"
    return [line for line in block.group(1).splitlines() if line.strip()]


@pytest.mark.skipif(require_root() is not None, reason=str(require_root()))
def test_readme_two_machine_commands_train_on_two_emulated_nodes(tmp_path):
    lines = readme_lines()
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")  # the folder both machines see
    env = cli_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # torchrun
    procs, logs = [], []
    with Emulator(nodes=2, nproc_per_node=2, rate=None) as emu:
        assert len(lines) == 2 and all(f"--local-addr={emu.ip(k)}" in lines[k] for k in range(2))
        try:
            for k, line in enumerate(lines):
                logs.append(open(tmp_path / f"node{k}.log", "w"))
                procs.append(subprocess.Popen(["ip", "netns", "exec", emu.ns(k), "bash", "-c", line], cwd=tmp_path,
                                              env=env, stdout=logs[-1], stderr=subprocess.STDOUT,
                                              start_new_session=True))
            deadline = time.monotonic() + 240
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                if any(p.poll() not in (None, 0) for p in procs):
                    break  # one node failed: the other would wait for it
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
            for f in logs:
                f.close()
    out = [(tmp_path / f"node{k}.log").read_text() for k in range(2)]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in out)
    assert "world 4" in "".join(out)  # 2 nodes x 2 ranks in one mesh
    rows = [json.loads(r) for r in (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(20))
    assert rows[-1]["loss"] < rows[0]["loss"]
