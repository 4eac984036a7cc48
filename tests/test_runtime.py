"""tessel.runtime: which device "auto" picks, and what train.deterministic switches on."""

from __future__ import annotations

import os

import pytest
import torch

from tessel.config import build_config
from tessel.commands.launch import check_devices
from tessel.elastic.rank import rank_environment
from tessel.runtime import ALLOC_CONF_VARS, auto_uses_cuda, make_deterministic, pick_device
from tessel.spawn import rank_env


def _gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


@pytest.mark.parametrize("gpus, ranks, cuda", [(0, 1, False), (1, 1, True), (1, 2, False), (8, 8, True),
                                               (4, 8, False)])
def test_auto_takes_the_gpus_only_when_every_local_rank_has_one(monkeypatch, gpus, ranks, cuda):
    _gpus(monkeypatch, gpus)
    assert auto_uses_cuda(ranks) is cuda


def test_auto_with_fewer_gpus_than_ranks_runs_on_the_cpu_and_says_so(monkeypatch, capsys):
    # NCCL refuses two ranks on one GPU: 2 ranks on a 1-GPU laptop would die at the rendezvous
    _gpus(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert pick_device("auto") == torch.device("cpu")
    check_devices(build_config({"parallel": {"dp": 2}}), nproc=2)
    err = capsys.readouterr().err
    assert "2 ranks per node but 1 GPU(s)" in err and "run on the CPU" in err and len(err.splitlines()) == 1


def test_auto_without_gpus_says_nothing(monkeypatch, capsys):
    _gpus(monkeypatch, 0)
    check_devices(build_config({"parallel": {"dp": 2}}), nproc=2)
    assert capsys.readouterr().err == ""


def test_deterministic_sets_cublas_workspace_unless_the_user_did(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        make_deterministic()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # cuBLAS's reproducible workspace
        assert torch.are_deterministic_algorithms_enabled()
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        make_deterministic()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(False)


EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_cuda_ranks_get_expandable_segments_unless_the_user_chose(monkeypatch):
    for var in ALLOC_CONF_VARS:
        monkeypatch.delenv(var, raising=False)
    auto, cpu = build_config({}), build_config({"runtime": {"device": "cpu"}})
    # the launcher's ranks (torchrun's environment), where they may take a GPU
    assert rank_environment(auto, {}).items() >= EXPANDABLE.items()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in rank_environment(cpu, {})
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    assert rank_environment(auto, mine)["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    # newer torch reads PYTORCH_ALLOC_CONF first: a user who set that one gets nothing of ours beside it
    assert "PYTORCH_CUDA_ALLOC_CONF" not in rank_environment(auto, {"PYTORCH_ALLOC_CONF": "expandable_segments:False"})
    # tessel.spawn's ranks under NCCL; gloo's never start CUDA
    assert rank_env("nccl", 1).items() >= EXPANDABLE.items() and "PYTORCH_CUDA_ALLOC_CONF" not in rank_env("gloo", 1)
    assert rank_env("nccl", 1, mine)["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")  # the ranks inherit the user's own
    assert "PYTORCH_CUDA_ALLOC_CONF" not in rank_env("nccl", 1)
