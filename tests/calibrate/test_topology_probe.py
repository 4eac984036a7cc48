"""`tessel probe` recovers the emulator's node grouping; clustering and topology files unit-tested."""

import json
import subprocess

import pytest

from tessel.testing.emulator import Emulator, require_root
from tessel.calibrate.topology_probe import format_topology, infer_nodes
from tessel.comm.topology import Topology, nodes_from_nproc, resolve_nodes


def test_infer_nodes_cuts_at_the_bandwidth_gap():
    fast, slow = 40.0, 1.0
    node = [0, 1, 0, 1, 1, 0]  # interleaved placement: grouping must not assume contiguous ranks
    bw = [[0 if i == j else (fast if node[i] == node[j] else slow) * (1 + 0.05 * ((i + j) % 3))
           for j in range(6)] for i in range(6)]
    assert infer_nodes(bw) == [[0, 2, 5], [1, 3, 4]]
    # a uniform network shows no gap: one node
    uniform = [[0 if i == j else 10.0 + 0.3 * ((i * j) % 4) for j in range(4)] for i in range(4)]
    assert infer_nodes(uniform) == [[0, 1, 2, 3]]


def test_topology_roundtrip_and_resolution(tmp_path, monkeypatch):
    topo = Topology(world_size=4, nodes=[[0, 1], [2, 3]], intra_gbps=40.0, inter_gbps=1.0)
    path = topo.save(tmp_path / "t.json")
    back = Topology.load(path)
    assert back.nodes == [[0, 1], [2, 3]] and back.nproc_per_node == 2 and back.node_of(3) == 1
    assert json.loads(path.read_text())["version"] == 1
    monkeypatch.setenv("TESSEL_TOPOLOGY", str(path))
    assert resolve_nodes(4) == [[0, 1], [2, 3]]
    monkeypatch.delenv("TESSEL_TOPOLOGY")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert resolve_nodes(6, nproc_per_node=3) == nodes_from_nproc(6, 3) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError):
        Topology(world_size=3, nodes=[[0, 1]])


@pytest.mark.skipif(require_root() is not None, reason=str(require_root()))
def test_probe_recovers_emulated_nodes(tmp_path):
    out = tmp_path / "topo.json"
    # 200 Mbit/s between nodes: far below loopback even on a loaded machine, so the gap is clear
    emu = Emulator(nodes=2, nproc_per_node=2, rate="200mbit")
    with emu:
        # best of 5 per direction: a loaded machine stalls some repetitions, rarely all of them
        runs = emu.run(["-m", "tessel", "probe", "--out", str(out), "--size-mb", "1", "--reps", "5"], timeout=300)
        assert all(r.returncode == 0 for r in runs), "\n".join(r.log[-3000:] for r in runs)
    topo = Topology.load(out)
    # ground truth: the node each rank says it ran on (the probe infers from bandwidth alone)
    truth: dict[str, list[int]] = {}
    for rank, host in enumerate(topo.hosts):
        truth.setdefault(host.rsplit("/", 1)[1], []).append(rank)
    assert sorted(truth.values()) == topo.nodes, format_topology(topo)
    assert len(topo.nodes) == 2
    # the shaping is what it measured: a 1 MiB message through tbf at 200 Mbit/s whose bucket
    # lets 256 KiB pass at once takes >= 768 KiB / 200 Mbit/s, i.e. <= 0.27 Gbit/s; loopback
    # measures 10-17 Gbit/s on this machine even at a load average of 20
    assert topo.inter_gbps < 0.3 < 2 * 0.3 < topo.intra_gbps
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert emu.name not in left  # namespaces (and with them veths and the bridge) are gone


@pytest.mark.skipif(require_root() is not None, reason=str(require_root()))
def test_emulator_pins_tcp_congestion_control_and_rejects_an_unknown_one():
    def cc(ns):
        return subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-n", "net.ipv4.tcp_congestion_control"],
                              capture_output=True, text=True, check=True).stdout.strip()

    with Emulator(nodes=2, nproc_per_node=1, congestion="reno") as emu:  # reno is always built in
        assert [cc(emu.ns(k)) for k in range(2)] == ["reno", "reno"]
    bad = Emulator(nodes=2, nproc_per_node=1, congestion="no-such-cc")
    with pytest.raises(ValueError, match="Emulator.congestion='no-such-cc'"):
        with bad:
            pass
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert emu.name not in left and bad.name not in left


@pytest.mark.skipif(require_root() is not None, reason=str(require_root()))
def test_emulator_cleans_up_after_a_failing_run():
    emu = Emulator(nodes=2, nproc_per_node=1, rate="100mbit")
    with emu:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert emu.ns(0) in names and emu.switch in names
        runs = emu.run(["--no-python", "false"], timeout=120)  # every rank of the job fails
    assert all(r.returncode != 0 for r in runs)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert emu.name not in left


def test_config_rejects_a_missing_topology_file():
    from tessel.config import ConfigError, build_config
    with pytest.raises(ConfigError) as err:
        build_config({}, ['runtime.topology="/nonexistent/topo.json"'])
    assert err.value.field == "runtime.topology"
