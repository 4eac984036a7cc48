"""`tessel plan`'s outputs of issue 18: time to train, TFLOP/s with and without recompute, every term of
the winner's step, --fix, --set cluster.<field>, and --help naming every layout key."""

import json

import pytest

import tessel.commands.cli
from tessel.planner.layout import KEY_HELP

SMALL = ["plan", "--model", "gpt3-1.3b", "--world", "16", "--cluster", "a100", "--json"]


def run(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        tessel.commands.cli.main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 0, err
    return out


def test_help_lists_every_layout_key_and_the_new_flags(capsys):
    text = " ".join(run(["plan", "--help"], capsys).split())
    for key in KEY_HELP:
        assert f"{key}:" in text, key
    for flag in ("--tokens", "--explain", "--fix", "cluster.inter.bandwidth"):
        assert flag in text


def test_tokens_tflops_explain_and_fix(capsys):
    report = json.loads(run(SMALL + ["--tokens", "300e9", "--explain", "--fix", "tp=2,recompute=selective"],
                            capsys))
    best = report["plans"][0]
    assert {(p["layout"]["tp"], p["layout"]["recompute"]) for p in report["plans"]} == {(2, "selective")}
    assert report["days_to_train"] == pytest.approx(300e9 / best["tokens_per_s"] / 86400)
    # selective recompute runs every attention core twice: counted by hardware FLOP/s, not by MFU
    assert report["model_tflops_per_device_with_recompute"] > report["model_tflops_per_device"] > 0
    assert sum(best["time_s"].values()) == pytest.approx(best["step_s"])  # the terms add up to the step
    terms = "\n".join(report["step_terms"])
    for name in best["time_s"]:
        assert name in terms
    assert "nvlink busy" in terms and "memory per device" in terms


def test_set_cluster_overrides_a_preset_constant(capsys):
    layout = ["--layout", "dp=16,mb=1"]  # dp over two nodes: its gradients cross the NICs
    base = json.loads(run(SMALL + layout, capsys))["plans"][0]
    slow = json.loads(run(SMALL + layout + ["--set", "cluster.inter.bandwidth=1e9"], capsys))["plans"][0]
    assert slow["link_busy_s"]["nic"] == pytest.approx(25 * base["link_busy_s"]["nic"], rel=0.05)
    assert slow["step_s"] > base["step_s"]
