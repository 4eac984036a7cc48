"""train.precision = "fp8" (tessel.parallel.float8): the blocks' linear layers multiply in float8 through
torchao's float8 matmul, emulated on this CPU (the same casts and scales, the product in high precision).

What is checked: that tessel's matmul is torchao's float8 linear bit for bit; which layers it reaches (not the
head, the embedding or a router; not a shard whose dimensions are not multiples of 16); that every layout of
issue 33 that tessel builds for fp8 trains as one process does in fp8; that the recipe rules refuse what is
not built and a GPU without float8 before any rank starts; and that checkpoints stay in high precision (an fp8
run resumes under bf16 and the reverse).
"""

import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

from tessel.config import ConfigError, check_layout
from tessel.parallel.float8.apply import float8_layers
from tessel.parallel.float8.matmul import Float8Matmul
from tessel.parallel.tensor.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from tessel.spawn import spawn
from tests.helpers import build_runner, build_trainer, tiny_config, train_and_collect

# d_model 64 and d_ff 256: every block matrix and its tp2 / tp4 shards are multiples of 16 (float8 GEMMs)
FP8 = ['train.precision="fp8"', "model.d_model=64", "model.d_ff=256", "train.steps=4"]
BF16 = [o if o != 'train.precision="fp8"' else 'train.precision="bf16"' for o in FP8]
SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
PP2 = ["parallel.pp=2", "parallel.micro_batches=2"]
WORLD2 = {"dp2": ["parallel.dp=2"], "tp2_sp": SP, "pp2": PP2, "dp2_zero3": ["parallel.dp=2", "parallel.zero_stage=3"],
          "tp2_sp_rowwise": [*SP, 'train.fp8_recipe="rowwise"']}
WORLD4 = {"tp4_sp": ["parallel.tp=4", "parallel.sequence_parallel=true"], "dp2_tp2_sp": ["parallel.dp=2", *SP],
          "pp2_tp2_sp": [*PP2, *SP]}
REFERENCE = {"tp2_sp_rowwise": ['train.fp8_recipe="rowwise"']}  # the others' reference: one process, tensorwise

# Tolerances. A layout changes what each float8 cast scales over, not what is computed: under dp (and a
# pipeline's micro-batches) a cast scales half of the tokens, under tp a rank's own shard of a weight, and in
# tp's row-parallel layers a partial product over half of K. e4m3 keeps 3 mantissa bits, so an element cast
# under another scale can round to its neighbouring value (2^-4 relative). Measured after 4 AdamW steps (lr
# 1e-2, loss ~5.45) against one fp8 process: losses within 2.7e-3 (dp2, pp2, ZeRO-3, dp2 x tp2, pp2 x tp2),
# 6.7e-3 (tp2 rowwise), 2.0e-2 (tp2 and tp4 tensorwise, whose row-parallel casts scale each rank's partial
# sum on its own amax); gradient norms within 4.4% relative. One fp8 process against one bf16 process differs by
# as much (1.4e-2 in loss and 16% in gradient norm over 8 steps): a layout adds no more than float8's own
# rounding. What these runs check beyond the bf16 parity suite (which checks every layout's communication
# exactly) is that float8 composes: each layout runs, stays on the one-process fp8 curve, and every block
# linear on every rank multiplied in float8 (counted).
LOSS_TOL = dict(rtol=0, atol=3e-2)
NORM_TOL = dict(rtol=0.1, atol=0)


def test_the_matmul_is_torchaos_float8_linear_bit_for_bit():
    """tessel's Float8Matmul calls torchao's float8 matmul with the config torchao's Float8Linear builds."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear
    torch.manual_seed(0)
    for recipe in ("tensorwise", "rowwise"):
        linear = nn.Linear(64, 32, bias=True)
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
        theirs = Float8Linear.from_float(nn.Linear(64, 32).requires_grad_(), config)
        theirs.weight, theirs.bias = nn.Parameter(linear.weight.detach().clone()), nn.Parameter(linear.bias.detach().clone())
        x = torch.randn(2, 8, 64, dtype=torch.bfloat16 if recipe == "rowwise" else torch.float32)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        ours = Float8Matmul(recipe, emulate=True)(a, linear.weight, linear.bias)
        ref = theirs(b)
        assert torch.equal(ours, ref), recipe
        ours.float().square().sum().backward()
        ref.float().square().sum().backward()
        assert torch.equal(a.grad, b.grad) and torch.equal(linear.weight.grad, theirs.weight.grad), recipe
        # and it is not the bf16 product: the operands were cast to float8
        assert not torch.equal(ours, nn.functional.linear(x, linear.weight.to(x.dtype), linear.bias.to(x.dtype)))


def test_float8_reaches_the_blocks_linears_only():
    cfg = tiny_config(*FP8, "model.n_experts=4", "model.moe_every=2")
    model, runner, _ = build_runner(cfg)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            in_block = name.startswith("layers.")
            assert ("linear_forward" in getattr(module.forward, "__qualname__", "")) == in_block, name
    assert "forward" not in vars(model.lm_head)  # the head keeps nn.Linear's own forward
    # tessel's router is a plain parameter (fp32 routing); a Hugging Face router is an nn.Linear named gate
    assert [n for n, _ in model.named_parameters() if "router" in n]
    gate = nn.Sequential()
    gate.add_module("gate", nn.Linear(64, 16))
    gate.add_module("up_proj", nn.Linear(64, 16))
    assert float8_layers(gate) == [gate.up_proj]
    # checkpoints stay in high precision: the same names, shapes and dtypes as a bf16 model's
    plain, _, _ = build_runner(tiny_config(*BF16, "model.n_experts=4", "model.moe_every=2"))
    assert {n: (t.shape, t.dtype) for n, t in model.state_dict().items()} == \
           {n: (t.shape, t.dtype) for n, t in plain.state_dict().items()}


def test_rules_refuse_what_fp8_does_not_build():
    with pytest.raises(ConfigError, match="train.precision.*tp_mode = '2d'"):
        check_layout(tiny_config(*FP8, "parallel.tp=4", 'parallel.tp_mode="2d"'))
    with pytest.raises(ConfigError, match="train.precision.*tp_overlap"):
        check_layout(tiny_config(*FP8, *SP, "parallel.tp_overlap=true"))
    with pytest.raises(ConfigError, match="train.precision.*'ps'"):
        check_layout(tiny_config(*FP8, "parallel.dp=2", 'parallel.dp_arch="ps"', "parallel.ps_servers=1"))


def test_a_gpu_without_float8_is_refused_before_spawn_naming_it(monkeypatch):
    from tessel.commands.launch import check_devices
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"train.precision.*A100-SXM4-80GB has 8\.0"):
        check_devices(tiny_config(*FP8, 'runtime.device="cuda"'), 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    check_devices(tiny_config(*FP8, 'runtime.device="cuda"'), 1)  # a Hopper GPU trains in fp8


def test_fp8_learns_as_bf16_does_and_differs_from_it():
    fp8, bf16 = (train_and_collect(tiny_config(*o, "train.steps=8")) for o in (FP8, BF16))
    assert fp8["losses"][-1] < fp8["losses"][0] - 0.1
    # float8 rounding moves the curve a little, never far (1.4e-2 measured over these 8 steps, loss ~5.4)
    assert_close(torch.tensor(fp8["losses"]), torch.tensor(bf16["losses"]), rtol=0, atol=4e-2)
    assert fp8["losses"] != bf16["losses"]  # it did multiply in float8


def _multiplies_in_float8(module: nn.Module) -> bool:
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return isinstance(module.matmul, Float8Matmul)
    return isinstance(module, nn.Linear) and "linear_forward" in getattr(module.forward, "__qualname__", "")


def _run_layouts(cases: dict) -> dict:
    out = {}
    for name, overrides in cases.items():
        trainer, model, _, _ = build_trainer(tiny_config(*FP8, *overrides))
        summary = trainer.fit()
        out[name] = {"losses": summary.losses, "grad_norms": [row["grad_norm"] for row in trainer.history],
                     "float8_layers": sum(_multiplies_in_float8(m) for m in model.modules())}
    return out


def _check(cases: dict, world: int) -> None:
    got = spawn(_run_layouts, world, cases, timeout=600)
    refs = {}
    for name in cases:
        key = tuple(REFERENCE.get(name, []))
        ref = refs.get(key) or refs.setdefault(key, train_and_collect(tiny_config(*FP8, *key)))
        for rank, result in enumerate(got):
            # every block linear this rank holds multiplied in float8: the reference GPT has 7 a block
            assert result[name]["float8_layers"] == 7 * 2 // (2 if "pp2" in name else 1), (name, rank)
            assert_close(torch.tensor(result[name]["losses"]), torch.tensor(ref["losses"]),
                         msg=lambda m: f"{name} rank {rank}: {m}", **LOSS_TOL)
            assert_close(torch.tensor(result[name]["grad_norms"]), torch.tensor(ref["grad_norms"]),
                         msg=lambda m: f"{name} rank {rank} grad norm: {m}", **NORM_TOL)


def test_world2_fp8_layouts_train_as_one_fp8_process():
    _check(WORLD2, 2)


def test_world4_fp8_layouts_train_as_one_fp8_process():
    _check(WORLD4, 4)


def test_an_fp8_checkpoint_resumes_under_bf16_and_the_reverse(tmp_path):
    """Checkpoints hold the high-precision weights: a run resumes in the other precision, and the steps after
    the resume are those of a run that took the same checkpoint in that precision from the start."""
    for first, then in ((FP8, BF16), (BF16, FP8)):
        tag = first[0].split('"')[1]
        saved = train_and_collect(tiny_config(*first, "checkpoint.every=2", out_dir=str(tmp_path / tag)))
        ckpt = f'checkpoint.resume="{tmp_path / tag}/checkpoints/step_00000002"'
        resumed = train_and_collect(tiny_config(*then, ckpt, out_dir=str(tmp_path / f"{tag}_resumed")))
        again = train_and_collect(tiny_config(*then, ckpt, out_dir=str(tmp_path / f"{tag}_again")))
        assert len(resumed["losses"]) == 2
        # the same precision from the same checkpoint on one process: deterministic, equal
        assert resumed["losses"] == again["losses"]
        # and the resumed steps continue the first run's curve within float8's rounding (see LOSS_TOL)
        assert_close(torch.tensor(resumed["losses"]), torch.tensor(saved["losses"][2:]), **LOSS_TOL)
