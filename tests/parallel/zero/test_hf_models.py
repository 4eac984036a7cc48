"""ZeRO-3 on Hugging Face models as a user drives them: model(input_ids=..., labels=...).loss.

Tiny LlamaForCausalLM and GPT2LMHeadModel (tied embedding, Conv1D) built by transformers
from local configs, trained with their own loss at dp=2 against FSDP2 (fully_shard on each
decoder layer and the root, as tessel's default units) and DDP:
- the output stays a ModelOutput in training mode (out.loss works);
- fp32 and bf16 storage (FSDP2's MixedPrecisionPolicy) end bit for bit where FSDP2 does;
- outside gathered() a parameter's values raise a Python error while model.dtype and
  model.device still answer; save_pretrained writes whole weights that from_pretrained
  loads back, equal to FSDP2's.

Tolerance: none, as in test_any_module.py: the same forward and backward on the same
weights on each rank, a sum of two gradients halved, elementwise AdamW.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tessel.spawn import spawn
from tests.parallel.zero.modules import tiny_gpt2, tiny_llama, token_batch
from tests.parallel.zero.references import ddp, fp32_weights, fsdp, zero

STEPS = 3


def _train(kind: str, net, model, opt) -> dict:
    losses, output_type = [], None
    net.train()
    for step in range(STEPS):
        x = token_batch(step, dist.get_rank())
        out = model(input_ids=x, labels=x)
        output_type = type(out).__name__
        out.loss.backward()
        losses.append(out.loss.item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "output_type": output_type, "weights": fp32_weights(kind, net, model, opt)}


def _outside_gathered(net) -> dict:
    try:
        net.model.layers[0].self_attn.q_proj.weight.sum()
        error = "no error"
    except RuntimeError as err:
        error = str(err)
    return {"error": error, "dtype": net.dtype, "device": net.device.type}


def _runs(save_dir: str) -> dict:
    out = {}
    for kind in ("fsdp", "zero3", "fsdp-bf16", "zero3-bf16"):
        net = tiny_llama()
        mixed = kind.endswith("bf16")
        model, opt = (fsdp(net, list(net.model.layers), mixed) if kind.startswith("fsdp")
                      else zero(net, 3, mixed))
        out["llama", kind] = _train(kind, net, model, opt)
        if kind == "zero3":
            out["outside"] = _outside_gathered(net)
            # every rank takes part (state_dict gathers); one writes
            net.save_pretrained(save_dir, is_main_process=dist.get_rank() == 0)
    for kind in ("ddp", "zero3"):
        net = tiny_gpt2()
        model, opt = ddp(net) if kind == "ddp" else zero(net, 3)
        out["gpt2", kind] = _train(kind, net, model, opt)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("llama-zero3")
    return spawn(_runs, 2, str(save_dir)), save_dir


def _assert_same(got: dict, want: dict, where: str) -> None:
    assert got["losses"] == want["losses"], where
    assert got["weights"].keys() == want["weights"].keys(), where
    for name, w in want["weights"].items():
        assert torch.equal(got["weights"][name], w), f"{where} {name}: {(got['weights'][name] - w).abs().max()}"


@pytest.mark.parametrize("model,kind,ref", [("llama", "zero3", "fsdp"), ("llama", "zero3-bf16", "fsdp-bf16"),
                                            ("gpt2", "zero3", "ddp")])
def test_zero3_trains_hf_models_like_fsdp2_and_ddp(runs, model, kind, ref):
    results, _ = runs
    for rank, run in enumerate(results):
        got, want = run[model, kind], run[model, ref]
        assert got["output_type"] == want["output_type"] and got["output_type"].startswith("CausalLMOutput")
        _assert_same(got, want, f"rank {rank} {model} {kind}")
    assert results[0][model, ref]["losses"][-1] < results[0][model, ref]["losses"][0], "the run must learn"


def test_zero3_parameters_between_uses_and_save_pretrained(runs):
    results, save_dir = runs
    for run in results:
        assert "model.layers.0.self_attn.q_proj.weight" in run["outside"]["error"]
        assert "gathered()" in run["outside"]["error"]
        assert (run["outside"]["dtype"], run["outside"]["device"]) == (torch.float32, "cpu")
    from transformers import LlamaForCausalLM
    loaded = LlamaForCausalLM.from_pretrained(Path(save_dir)).state_dict()
    want = results[0]["llama", "fsdp"]["weights"]
    assert loaded.keys() == want.keys()
    for name, w in want.items():
        assert torch.equal(loaded[name], w), name

