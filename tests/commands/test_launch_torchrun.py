"""tessel.commands.launch: the torchrun arguments that carry a run's grace period."""

from __future__ import annotations

import argparse

import torch.distributed.run as torchrun

from tessel.commands.launch import shutdown_args


def _parser(*flags: str):
    def make() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser()
        for flag in flags:
            parser.add_argument(flag, type=int)
        parser.add_argument("training_script")
        parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
        return parser
    return make


def test_the_installed_torchrun_accepts_what_it_is_given():
    args = shutdown_args(90)
    _, unknown = torchrun.get_args_parser().parse_known_args([*args, "script.py"])
    assert unknown == [] and args in ([], ["--shutdown-timeout=90"])


def test_the_grace_goes_to_a_torchrun_that_takes_it(monkeypatch):
    monkeypatch.setattr(torchrun, "get_args_parser", _parser("--max-restarts", "--shutdown-timeout"))  # torch 2.13's
    assert shutdown_args(90) == ["--shutdown-timeout=90"]


def test_an_older_torchrun_gets_no_flag_it_would_refuse(monkeypatch):
    # torch 2.11's torchrun has no --shutdown-timeout and exits 2 on it (seen on a GPU machine's torch build)
    monkeypatch.setattr(torchrun, "get_args_parser", _parser("--max-restarts"))
    assert shutdown_args(90) == []
