"""2D (SUMMA), 2.5D (Tesseract) and 3D tensor parallelism against one process, through the trainer's step.

Two spawns: 4 ranks (2D on a 2 x 2 grid, with tied embeddings, a Hugging Face Llama and six other transformers
families placed from their own plans) and 8 ranks (2.5D on 2 x 2 x depth 2, 3D on a 2 x 2 x 2 cube and tied,
dp2 x 2D plain and under ZeRO-1/2/3, pp2 x 2D), each
layout 5 steps of the real trainer path (tests.helpers.build_trainer, tessel.parallelize,
Trainer.train_step), the loss of each step, the gradients of the first step, the weights after 3 steps,
gathered whole, and the tokens sampled after the 5, compared with the same run on one process (for the
Hugging Face families: transformers' unmodified model). The last step's collectives are recorded and compared,
call by call, with the planner's list for the layout (CostModel.step_calls, tessel.planner.grid_cost).
"""

import collections
import contextlib
import json

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from tessel.mesh import make_mesh
from tessel.parallel.tensor_nd.apply import full_tensors
from tessel.parallel.tensor_nd.cube import STREAM, Cube, Linear3D
from tessel.parallel.tensor_nd.grid import build_grid
from tessel.parallel.tensor_nd.summa import Linear2D, Summa
from tessel.testing.grid_traffic import CollectiveRecorder
from tessel.planner.cluster import get_cluster
from tessel.planner.cost import CostModel
from tessel.planner.grid_cost import grid_of, layer_activation_bytes
from tessel.planner.layout import config_layout
from tessel.planner.memory import attention_core_bytes
from tessel.planner.model_spec import from_config
from tessel.planner.tp_grid import linear_bytes
from tessel.sharding import placement
from tessel.spawn import spawn
from tessel.train.checkpoint.read import read_model_tensors, read_tensors
from tests.helpers import DERIVED, PLANNED, build_trainer, tiny_config
from tests.planner.recorder import Recorder, record_step

STEPS = 5
COMMON = ("model.vocab_size=128", "model.d_model=32", "model.n_head=4", "model.n_layer=2",
          f"train.steps={STEPS}", "train.lr=1e-3", "train.min_lr=1e-4")
LAYOUTS_4 = {"2d": ["parallel.tp=4", "parallel.tp_mode='2d'"],
             "2d_tied": ["parallel.tp=4", "parallel.tp_mode='2d'", "model.tie_embeddings=true"]}
LAYOUTS_8 = {
    "2.5d": ["parallel.tp=8", "parallel.tp_mode='2.5d'", "parallel.tp_depth=2",  # 2 x 2 x depth 2
             "parallel.recompute='selective'"],
    "3d": ["parallel.tp=8", "parallel.tp_mode='3d'"],  # a 2 x 2 x 2 cube
    "dp2_2d": ["parallel.dp=2", "parallel.tp=4", "parallel.tp_mode='2d'"],
    "pp2_2d": ["parallel.pp=2", "parallel.tp=4", "parallel.tp_mode='2d'", "parallel.micro_batches=2",
               "parallel.recompute='full'"],
    "dp2_2d_zero1": ["parallel.dp=2", "parallel.tp=4", "parallel.tp_mode='2d'", "parallel.zero_stage=1"],
    "dp2_2d_zero2": ["parallel.dp=2", "parallel.tp=4", "parallel.tp_mode='2d'", "parallel.zero_stage=2"],
    "3d_tied": ["parallel.tp=8", "parallel.tp_mode='3d'", "model.tie_embeddings=true"],
    "dp2_2d_zero3": ["parallel.dp=2", "parallel.tp=4", "parallel.tp_mode='2d'", "parallel.zero_stage=3"],
}
TIED = ["model.tie_embeddings=true"]  # the one-process reference of the *_tied layouts
# a tiny Hugging Face Llama, transformers' own model: grouped-query attention (4 heads, 2 kv heads: one a column
# of the 2 x 2 grid) and a padding row (pad_token_id: no gradient); its reference is the unmodified model
HF_LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "pad_token_id": 3, "bos_token_id": 1, "eos_token_id": 2}


# transformers' families on the 2 x 2 grid, placed from their own plans (tests.helpers' tiny configs), each for a
# piece the grid places beyond the Llama's: per-head q/k norms, their gradients summed over the grid (qwen3);
# (1 + w) norms run whole over the hidden split, attention and final-logit soft-caps, sliding windows, a scaled
# and tied embedding (gemma2); fused q|k|v and gate|up whose outputs the plan gathers (phi3); biases split in
# pieces, LayerNorms, attention and MLP in parallel, q|k|v interleaved per head (gpt_neox); a family with no
# table entry, q/k/v biases and a gathered gate|up (glm4); an MoE block computed whole on every rank, on the whole
# micro-batch, with its router loss (qwen3_moe)
HF_FAMILIES = {**{kind: {**PLANNED, **DERIVED}[kind] for kind in ("qwen3", "gemma2", "phi3", "gpt_neox", "glm4")},
               "qwen3_moe": {**DERIVED["qwen3_moe"], "output_router_logits": True, "router_aux_loss_coef": 0.5}}


def _hf(path: str, *overrides: str) -> list[str]:
    return [f'model.hf_config="{path}"', f"train.steps={STEPS}", "train.lr=1e-3", "train.min_lr=1e-4", *overrides]
PROMPT = [[1, 2, 3, 4]]  # sampled from after the 5 steps: 6 tokens, seed 3
# fp32 throughout. SUMMA adds the q partial products of each matmul in its own order and the norm's
# sum of squares and the loss's softmax sums are split over ranks: fp32 rounding only. Measured on
# 2x2: loss <= 4.8e-7, gradients <= 1.5e-8 absolute (the largest ~1e-2), weights after 3 steps <= 9e-8;
# 2.5D and 3D: loss <= 4.8e-7, gradients <= 2.3e-8, weights <= 1.2e-7.
# AdamW's first steps move each weight by ~lr * g / |g|, so an entry
# whose gradient is ~1e-9 may step differently for a rounding difference of 1e-10; WEIGHT_TOL's 5e-5 is
# 1/20 of one step (lr 1e-3). A wrong block, a missing reduction or a doubled one changes the gradients
# by O(1) relative and the weights by ~lr, far outside these tolerances.
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-7)
WEIGHT_TOL = dict(rtol=1e-4, atol=5e-5)
NORM_TOL = dict(rtol=1e-5, atol=0.0)  # a sum of squares in another order: fp32 rounding only
# the share of the model's parameters a rank holds: 1/q^2 (2D), 1/q^2 with every depth layer a copy
# (2.5D, Tesseract), 1/c^3 (3D); the tiny model divides evenly, so the bytes are exact
TRAFFIC = {"batch": 8, "seq": 4, "k": 16, "m": 32}  # one linear layer, X (batch*seq, k) x W (k, m)
# the residual stream's share per rank: batch chunks x hidden chunks = q*q (2D), d*q*q (2.5D), c*c*c (3D)
STREAM_SHARE = {"2d": 4, "2.5d": 8, "3d": 8, "dp2_2d": 4, "dp2_2d_zero1": 4, "dp2_2d_zero2": 4, "2d_tied": 4,
                "3d_tied": 8, "dp2_2d_zero3": 4}
# (pp2: its stages' shares summed)
PARAM_SHARE = {"2d": 4, "2.5d": 4, "3d": 8, "dp2_2d": 4, "pp2_2d": 4, "dp2_2d_zero1": 4, "dp2_2d_zero2": 4,
               "2d_tied": 4, "3d_tied": 8}


def _whole(model, runner, mesh, grads: bool, gathered=contextlib.nullcontext) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient) whole, by name: gathered over tp, then over the pipeline's stages."""
    chunks = runner.chunks if mesh.size("pp") > 1 else [model]
    with gathered():  # ZeRO-3: its shards made whole for the duration
        mine = {name: t for chunk in chunks for name, t in full_tensors(chunk, grads).items()}
    if mesh.size("pp") == 1:
        return mine
    stages = [None] * mesh.size("pp")
    dist.all_gather_object(stages, mine, group=mesh.group("pp"))
    return {name: t for stage in stages for name, t in stage.items()}


def _train(overrides: list[str], common: tuple[str, ...] = COMMON) -> dict:
    """5 trainer steps; the loss of each, the first step's gradients and the weights after 3, whole."""
    cfg = tiny_config(*common, *overrides)
    trainer, model, runner, mesh = build_trainer(cfg)
    grid = cfg.parallel.tp_mode != "1d"
    gathered = runner.model.gathered if cfg.parallel.zero_stage == 3 else contextlib.nullcontext
    whole = (lambda grads=False: _whole(model, runner, mesh, grads, gathered)) if grid else \
        (lambda grads=False: {n: (p.grad if grads else p).detach().clone() for n, p in model.named_parameters()})
    param_bytes = torch.tensor(sum(p.numel() * p.element_size() for p in runner.parameters()))
    if mesh.size("pp") > 1:  # the stages' shares together
        dist.all_reduce(param_bytes, group=mesh.group("pp"))
    out: dict = {"losses": [], "norms": [], "param_bytes": param_bytes.item()}
    forward_backward = runner.forward_backward

    def capture(x, y):  # the gradients before clipping and the update zero them
        loss = forward_backward(x, y)
        if cfg.parallel.zero_stage < 2 and "grads" not in out:  # ZeRO-2 keeps its gradients in flat shards
            out["grads"] = whole(grads=True)
        return loss

    runner.forward_backward = capture
    # (ZeRO-3's gathered blocks are the planner's buffers, not a block's activations: not measured)
    if grid and mesh.size("pp") == 1 and cfg.model.hf_config is None and cfg.parallel.zero_stage < 3:
        _measure_saved(model, out)
    if mesh.size("pp") == 1:  # the residual stream each block reads: this rank's share of it
        for block in model.layers if cfg.model.hf_config is None else model.base_model.layers:
            block.register_forward_pre_hook(lambda m, args: out.__setitem__(
                "stream_bytes", max(out.get("stream_bytes", 0), args[0].numel() * args[0].element_size())))
    for step in range(STEPS):
        if step == STEPS - 1:  # every collective of the last step, for the planner's call list (RECORDED)
            with Recorder(mesh) as rec:
                row = trainer.train_step(step)
            out["calls"] = rec.calls
            out["stage"] = mesh.local_rank_in("pp") if mesh.size("pp") > 1 else 0
        else:
            row = trainer.train_step(step)
        out["losses"].append(row["loss"])
        out["norms"].append(row["grad_norm"])
        trainer.state.step = step + 1
        if step == 2:
            out["weights"] = whole()
            if grid and mesh.size("pp") == 1 and cfg.parallel.zero_stage < 3:
                out["misplaced"] = _misplaced(model, out["weights"])
    # sampling: the grid's logits gathered (a pipeline's last stage: split by batch and vocabulary)
    out["sample"] = runner.generate(torch.tensor(PROMPT), 6, seed=3).tolist()
    return out


def _misplaced(model, whole: dict[str, torch.Tensor]) -> list[str]:
    """The grid blocks that their placement does not cut from the whole tensor exactly as this rank holds them
    (GridPlacement.local_slice: what a load under ZeRO, which reads whole tensors, cuts): none."""
    return [name for name, p in model.named_parameters()
            if placement(p) is not None and not torch.equal(placement(p).local_slice(whole[name]), p.detach())]


def _measure_saved(model, out: dict) -> None:
    """Bytes of the storages the first block's first forward saves for backward (each once; parameters and
    the rotary tables left out, as the planner counts them apart): out["saved_bytes"]."""
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), model.rope_cos, model.rope_sin]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    block = model.layers[0]

    def enter(module, args):
        if "saved_bytes" not in out:
            hooks.__enter__()

    def leave(module, args, output):
        if "saved_bytes" not in out:
            hooks.__exit__(None, None, None)
            out["saved_bytes"] = sum(seen.values())

    block.register_forward_pre_hook(enter)
    block.register_forward_hook(leave)


def _planned_saved(overrides: list[str]) -> float:
    """What the planner says block 0 keeps on one rank (tessel.planner.grid_cost.layer_activation_bytes)."""
    cfg = tiny_config(*COMMON, *overrides)
    p, spec = cfg.parallel, from_config(cfg.model, cfg.train.seq_len, cfg.train.global_batch)
    tokens = cfg.train.global_batch // p.dp * cfg.train.seq_len
    grid = grid_of(p.tp_mode, p.tp, p.tp_depth)
    kept = layer_activation_bytes(spec, tokens, grid, cfg.train.precision)
    if p.recompute == "selective":  # the attention core's tensors give way to its inputs
        kept -= attention_core_bytes(spec, tokens, p.tp, cfg.train.precision)
    return kept


def _fit(root: str, name: str, *overrides: str) -> list[float]:
    cfg = tiny_config(*COMMON, "checkpoint.every=3", "fault.heartbeat_s=0", *overrides, out_dir=f"{root}/{name}")
    return build_trainer(cfg)[0].fit().losses


# bf16 autocast: the grid's linear layers cast their panels before they communicate them (recorded calls only)
BF16 = {"2d_bf16": [*LAYOUTS_4["2d"], "train.precision='bf16'"], "3d_bf16": ["parallel.tp=8", "parallel.tp_mode='3d'",
                                                                           "train.precision='bf16'"]}


def _world4(root: str, hf_config: str, families: dict[str, str]) -> dict:
    out = {name: _train(o) for name, o in LAYOUTS_4.items()}
    out["hf_llama_2d"] = _train(_hf(hf_config, *LAYOUTS_4["2d"]), common=())
    out.update({f"hf_{kind}_2d": _train(_hf(path, *LAYOUTS_4["2d"]), common=()) for kind, path in families.items()})
    out["2d_bf16"] = record_step([*COMMON, *BF16["2d_bf16"]])
    out["traffic"] = {"2d": _traffic("2d", (2, 2))}
    # saved in 2D at step 3, resumed in 1D (tp4): the logical tensors, whatever the layout
    out["root"] = root
    out["saved_2d"] = _fit(root, "saved_2d", *LAYOUTS_4["2d"])
    out["resumed_1d"] = _fit(root, "resumed_1d", "parallel.tp=4",
                             f'checkpoint.resume="{root}/saved_2d/checkpoints/step_00000003"')
    # and the reverse: saved in 1D (tp4), resumed on the 2 x 2 grid
    out["saved_1d"] = _fit(root, "saved_1d", "parallel.tp=4")
    out["resumed_2d"] = _fit(root, "resumed_2d", *LAYOUTS_4["2d"],
                             f'checkpoint.resume="{root}/saved_1d/checkpoints/step_00000003"')
    return out


def _traffic(mode: str, shape: tuple[int, ...]) -> float:
    """Bytes this rank sends in one linear layer's forward and backward on a grid of `shape` (recorded)."""
    mesh = make_mesh({"tp": dist.get_world_size()})
    grid = build_grid(mesh, shape)
    torch.manual_seed(0)
    linear = torch.nn.Linear(TRAFFIC["k"], TRAFFIC["m"], bias=False)
    b, t, k = TRAFFIC["batch"], TRAFFIC["seq"], TRAFFIC["k"]
    if mode == "3d":
        layer, rows, width = Linear3D(linear, Cube(grid), STREAM), shape[0] ** 2, shape[0]
    else:
        layer, rows, width = Linear2D(linear, Summa(grid)), grid.size // shape[-1], shape[-1]
    x = torch.randn(b // rows, t, k // width, requires_grad=True)
    with CollectiveRecorder().recording() as rec:
        layer(x).sum().backward()
    return rec.sent


def _world8(root: str) -> dict:
    out = {name: _train(o) for name, o in LAYOUTS_8.items()}
    out["3d_bf16"] = record_step([*COMMON, *BF16["3d_bf16"]])
    out["traffic"] = {"2.5d": _traffic("2.5d", (2, 2, 2)), "3d": _traffic("3d", (2, 2, 2))}
    # saved on the 3D cube at step 3, resumed as dp2 x 2D
    out["root"] = root
    out["saved_3d"] = _fit(root, "saved_3d", *LAYOUTS_8["3d"])
    out["resumed_2d"] = _fit(root, "resumed_2d", *LAYOUTS_8["dp2_2d"],
                             f'checkpoint.resume="{root}/saved_3d/checkpoints/step_00000003"')
    # saved as dp2 x 2D under ZeRO-1 (its flat AdamW state, whole: tessel.parallel.zero.checkpoint), resumed on
    # the cube (2D -> 3D) and in 1D (dp2 x tp4); and the cube's checkpoint loaded under ZeRO-2 on the grid
    out["saved_2d_zero1"] = _fit(root, "saved_2d_zero1", *LAYOUTS_8["dp2_2d_zero1"])
    from_zero = f'checkpoint.resume="{root}/saved_2d_zero1/checkpoints/step_00000003"'
    out["resumed_3d"] = _fit(root, "resumed_3d", *LAYOUTS_8["3d"], from_zero)
    out["resumed_1d"] = _fit(root, "resumed_1d", "parallel.dp=2", "parallel.tp=4", from_zero)
    out["resumed_2d_zero2"] = _fit(root, "resumed_2d_zero2", *LAYOUTS_8["dp2_2d_zero2"],
                                   f'checkpoint.resume="{root}/saved_3d/checkpoints/step_00000003"')
    # ZeRO-3 (flat shards of the grid's blocks): the cube's checkpoint loaded, and its own resumed on the cube
    out["resumed_2d_zero3"] = _fit(root, "resumed_2d_zero3", *LAYOUTS_8["dp2_2d_zero3"],
                                   f'checkpoint.resume="{root}/saved_3d/checkpoints/step_00000003"')
    out["saved_2d_zero3"] = _fit(root, "saved_2d_zero3", *LAYOUTS_8["dp2_2d_zero3"])
    out["resumed_3d_from_zero3"] = _fit(root, "resumed_3d_from_zero3", *LAYOUTS_8["3d"],
                                        f'checkpoint.resume="{root}/saved_2d_zero3/checkpoints/step_00000003"')
    return out


@pytest.fixture(scope="module")
def world8(tmp_path_factory):
    return spawn(_world8, 8, str(tmp_path_factory.mktemp("cube")), timeout=300)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("hf") / "config.json"
    path.write_text(json.dumps(HF_LLAMA))
    return str(path)


@pytest.fixture(scope="module")
def hf_families(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf_families")
    for kind, doc in HF_FAMILIES.items():
        (root / f"{kind}.json").write_text(json.dumps(doc))
    return {kind: str(root / f"{kind}.json") for kind in HF_FAMILIES}


@pytest.fixture(scope="module")
def world4(tmp_path_factory, hf_llama, hf_families):
    return spawn(_world4, 4, str(tmp_path_factory.mktemp("grid")), hf_llama, hf_families, timeout=360)


@pytest.fixture(scope="module")
def reference():
    return _train([])


@pytest.fixture(scope="module")
def reference_tied():
    return _train(TIED)


@pytest.fixture(scope="module")
def reference_hf(hf_llama):
    return _train(_hf(hf_llama), common=())  # transformers' model as it built it, on one process


@pytest.fixture(scope="module")
def reference_families(hf_families):
    return {kind: _train(_hf(path), common=()) for kind, path in hf_families.items()}  # transformers' own, 1 process


def _check_stream(got: dict, ref: dict, layout: str) -> None:
    """Activation bytes: a block's input on one rank is the one-process batch's / (dp x the grid's share)."""
    if layout in STREAM_SHARE:
        dp = 2 if layout.startswith("dp2") else 1
        assert got["stream_bytes"] * dp * STREAM_SHARE[layout] == ref["stream_bytes"], layout


def _compare(got: dict, ref: dict) -> None:
    assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **LOSS_TOL)
    # the norm counts each block once: 2.5D's depth copies are replicas (a doubled count would be O(1) off)
    assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), **NORM_TOL)
    assert got["weights"].keys() == ref["weights"].keys()
    assert got["sample"] == ref["sample"]
    for name in ref["grads"]:
        if "grads" in got:
            assert_close(got["grads"][name], ref["grads"][name], **GRAD_TOL, msg=lambda m, n=name: f"grad {n}: {m}")
        assert_close(got["weights"][name], ref["weights"][name], **WEIGHT_TOL, msg=lambda m, n=name: f"weight {n}: {m}")


def _check_ranks(results: list[dict], reference: dict, layout: str) -> None:
    """Every rank's run of `layout` against one process: values, the residual stream's shard, parameter bytes."""
    for rank, result in enumerate(results):
        _compare(result[layout], reference)
        _check_stream(result[layout], reference, layout)
        if "misplaced" in result[layout]:  # each block its placement cuts from the whole (loads under ZeRO)
            assert result[layout]["misplaced"] == [], (layout, rank)
        if "saved_bytes" in result[layout]:  # what a block keeps for backward, as the planner counts it
            assert result[layout]["saved_bytes"] == _planned_saved({**LAYOUTS_4, **LAYOUTS_8}[layout]), layout
        if layout in PARAM_SHARE:  # not ZeRO-3, whose ranks hold flat shards of the grid's blocks
            assert result[layout]["param_bytes"] * PARAM_SHARE[layout] == reference["param_bytes"], rank


@pytest.mark.parametrize("layout", list(LAYOUTS_4))
def test_parity_world4(world4, reference, reference_tied, layout):
    _check_ranks(world4, reference_tied if layout.endswith("_tied") else reference, layout)


@pytest.mark.parametrize("layout", list(LAYOUTS_8))
def test_parity_world8(world8, reference, reference_tied, layout):
    _check_ranks(world8, reference_tied if layout.endswith("_tied") else reference, layout)


def test_hugging_face_llama_on_a_2x2_grid(world4, reference_hf):
    """transformers' Llama, unmodified but for its linear layers, norms, embedding and head made grid layers from
    its own tensor-parallel plan (tessel.models.hf.tp_plan): losses, gradients, weights and sampled tokens of
    the unmodified model trained on one process; its parameters and residual stream split 4 ways."""
    for result in world4:
        got = result["hf_llama_2d"]
        _compare(got, reference_hf)
        assert got["stream_bytes"] * 4 == reference_hf["stream_bytes"]
        assert got["param_bytes"] * 4 == reference_hf["param_bytes"]


@pytest.mark.parametrize("kind", list(HF_FAMILIES))
def test_hugging_face_families_on_a_2x2_grid(world4, reference_families, kind):
    """Each family's transformers model, unmodified but for the modules its plan splits made grid layers and the
    rest run whole over the hidden split (tessel.parallel.tensor_nd.whole): losses, gradients, weights and sampled
    tokens of the unmodified model on one process (the tolerances above: the grid's sums in another order, and
    the whole norms computed as the model computes them); the residual stream split 4 ways."""
    for result in world4:
        got = result[f"hf_{kind}_2d"]
        _compare(got, reference_families[kind])
        assert got["stream_bytes"] * 4 == reference_families[kind]["stream_bytes"]


def test_bytes_sent_per_layer_match_theory(world4, world8):
    """Every rank of each grid sends what the planner's tessel.planner.tp_grid.linear_bytes says, to the byte."""
    n, k, m = TRAFFIC["batch"] * TRAFFIC["seq"], TRAFFIC["k"], TRAFFIC["m"]
    theory = {"2d": linear_bytes("2d", n, k, m, 2), "2.5d": linear_bytes("2.5d", n, k, m, 2, depth=2),
              "3d": linear_bytes("3d", n, k, m, 2)}
    for world in (world4, world8):
        for rank, result in enumerate(world):
            for mode, sent in result["traffic"].items():
                assert sent == pytest.approx(theory[mode], rel=1e-12), (mode, rank, sent, theory[mode])


def test_saved_in_2d_resumes_in_1d_and_back(world4, reference):
    """Checkpoints hold logical tensors (weights and AdamW moments): the 2D run's step-3 checkpoint holds the
    one-process run's weights after 3 steps, whole, and the 1D run resumed from it takes steps 4 and 5 like
    the 2D run itself, within the parity tolerance; a 1D checkpoint resumes on the grid likewise."""
    saved = read_model_tensors(f"{world4[0]['root']}/saved_2d/checkpoints/step_00000003")
    assert saved.keys() == reference["weights"].keys()
    for name, weight in reference["weights"].items():
        assert_close(saved[name], weight, **WEIGHT_TOL, msg=lambda m, n=name: f"saved {n}: {m}")
    for result in world4:
        assert len(result["resumed_1d"]) == len(result["resumed_2d"]) == 2
        assert_close(torch.tensor(result["resumed_2d"]), torch.tensor(result["saved_1d"][3:]), **LOSS_TOL)
        assert_close(torch.tensor(result["resumed_1d"]), torch.tensor(result["saved_2d"][3:]), **LOSS_TOL)


def test_saved_in_3d_resumes_in_2d(world8):
    """The cube's step-3 checkpoint resumed under dp2 x 2D, plain and under ZeRO-2 and ZeRO-3 (whose flat shards are cut
    from the whole tensors by each block's placement): steps 4 and 5 as the 3D run took them."""
    for result in world8:
        for resumed in ("resumed_2d", "resumed_2d_zero2", "resumed_2d_zero3"):
            assert len(result[resumed]) == 2
            assert_close(torch.tensor(result[resumed]), torch.tensor(result["saved_3d"][3:]), **LOSS_TOL)


# AdamW's moments after 3 steps, saved by two layouts: each is a sum of the 3 steps' gradients (squared for
# exp_avg_sq), which both layouts compute within GRAD_TOL of one process (rtol 1e-4: 2e-4 for a square); the atol
# covers the entries whose gradient is ~0 (|exp_avg| <= GRAD_TOL's 1e-7; exp_avg_sq's squares far below it)
MOMENT_TOL = dict(rtol=4e-4, atol=1e-7)


def test_saved_in_2d_under_zero_resumes_on_the_cube_and_in_1d(world8, reference):
    """A ZeRO-1 dp2 x 2D checkpoint holds logical tensors: the one-process weights after 3 steps, whole, and AdamW's
    state as the cube's own checkpoint holds it (every parameter's step and moments, whole); resumed on the 2 x 2 x 2
    cube and in 1D (dp2 x tp4), steps 4 and 5 are the ZeRO run's own."""
    root = world8[0]["root"]
    zero, cube = (f"{root}/{run}/checkpoints/step_00000003" for run in ("saved_2d_zero1", "saved_3d"))
    saved = read_model_tensors(zero)
    assert saved.keys() == reference["weights"].keys()
    for name, weight in reference["weights"].items():
        assert_close(saved[name], weight, **WEIGHT_TOL, msg=lambda m, n=name: f"saved {n}: {m}")
    moments, cube_moments = read_tensors(zero, "optim/"), read_tensors(cube, "optim/")
    assert moments.keys() == cube_moments.keys() and len(moments) == 3 * len(saved)  # step, exp_avg, exp_avg_sq
    for key, value in moments.items():
        assert_close(value, cube_moments[key], **MOMENT_TOL, msg=lambda m, k=key: f"{k}: {m}")
    for result in world8:
        for resumed in ("resumed_3d", "resumed_1d"):
            assert len(result[resumed]) == 2
            assert_close(torch.tensor(result[resumed]), torch.tensor(result["saved_2d_zero1"][3:]), **LOSS_TOL)
        assert len(result["resumed_3d_from_zero3"]) == 2  # and a ZeRO-3 grid's checkpoint, on the cube
        assert_close(torch.tensor(result["resumed_3d_from_zero3"]), torch.tensor(result["saved_2d_zero3"][3:]),
                     **LOSS_TOL)


def _planned(overrides: list[str], stage: int, common: tuple[str, ...] = COMMON) -> collections.Counter:
    """The planner's calls of one step (CostModel.step_calls) for one rank of the layout, keyed as the
    recorder keys the runtime's: a grid dimension's groups are no mesh axis, so both sides name them by size."""
    cfg = tiny_config(*common, *overrides)
    lay = config_layout(cfg)
    cost = CostModel(from_config(cfg.model, cfg.train.seq_len, cfg.train.global_batch), get_cluster("a100"),
                     cfg.train.precision, bucket_mb=cfg.parallel.bucket_mb)
    dims = cost.grid.groups(lay)
    out = collections.Counter()
    for group, calls in cost.step_calls(lay, stage).items():
        label = f"group{dims[int(group[3:])].n}" if group.startswith("tp.") else group
        for c in calls:
            assert c.count == int(c.count) and c.nbytes == int(c.nbytes), c
            out[c.op, label, int(c.nbytes)] += int(c.count)
    # the gradient norm's partial sum: listed once per sharding axis (traffic.bookkeeping_calls), summed by the
    # runtime once over their joint group (4 bytes, latency either way)
    axes = [a for a, on in (("pp", lay.pp > 1), ("dp", lay.zero_stage >= 1), ("tp", True)) if on]
    if len(axes) > 1:
        out.subtract({("all_reduce", a, 4): 1 for a in axes})
        out["all_reduce", "+".join(axes), 4] += 1
    return +out


@pytest.mark.parametrize("layout", ["2d", "2.5d", "3d", "dp2_2d", "pp2_2d", "dp2_2d_zero2", "2d_bf16", "3d_bf16",
                                    "2d_tied", "3d_tied", "dp2_2d_zero3", "hf_llama_2d"])
def test_planner_lists_every_collective_of_a_step(world4, world8, hf_llama, layout):
    """tessel plan prices a grid call by call (tessel.planner.grid_cost): the collectives of a real step, each
    (op, group, bytes) as often as the runtime issues it: SUMMA's broadcasts and reductions along rows and
    columns, Tesseract's depth all-reduce, the cube's gathers and reduce-scatters, the norms, the embedding,
    the head and loss, recomputation, the pipeline's messages (the grid's shard) and the gradient traffic."""
    overrides = {**LAYOUTS_4, **LAYOUTS_8, **BF16, "hf_llama_2d": _hf(hf_llama, *LAYOUTS_4["2d"])}[layout]
    world = world4 if layout in ("2d", "2d_bf16", "2d_tied", "hf_llama_2d") else world8
    for rank, result in enumerate(world):
        got = collections.Counter(tuple(c) for c in result[layout]["calls"])
        want = _planned(overrides, result[layout]["stage"], () if layout.startswith("hf") else COMMON)
        assert got == want, f"{layout}, rank {rank}: runtime only {dict(got - want)}, planner only {dict(want - got)}"
