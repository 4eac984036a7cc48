"""train.compile (tessel.parallel.compile) on every layout: compiled against eager, and nothing compiled after the
first step.

Each case trains one layout twice in the same processes, eagerly and compiled, from the same seed and batches:
5 steps, comparing every step's loss and global gradient norm, this rank's gradients after the first step,
its weights after 3 steps, the evaluation loss and the sampled text. Both runs have the same layout, so each
rank compares its own shards. The compiled run reads dynamo's counters after its first step and at its end
(after evaluation and sampling): it must have compiled something by the first (a silent fall-back to eager
would pass the parity trivially) and nothing after it. One spawn per world size loops over its cases.

Most layouts compile with the aot_eager backend: graph capture and the autograd partition are what a layout
can break, and both happen there without inductor's code generation (a cold inductor compile of the tiny
block costs ~25 s on this machine, a warm one from the shared FX graph cache ~2 s). The single-process run
and tp2 with sequence parallelism (its collectives inside the graph) compile with inductor.
"""

import json
import subprocess

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.testing import assert_close

import tessel.parallel.tensor.comm as comm
from tessel.config import ConfigError, ModelConfig
from tessel.models.family import model_family
from tessel.models.gpt import GPT, cross_entropy
from tessel.parallel.compile import TrainingForward, compile_for_training
from tessel.parallel.pipeline.split_backward import backward_input
from tessel.parallel.pipeline.split_plan import is_compiled
from tessel.parallel.ps.worker import WorkerRunner
from tessel.parallel.zero.engine import ZeroDataParallel
from tessel.spawn import spawn
from tessel.train.ps.trainer import train_rank_ps
from tests.helpers import build_runner, build_trainer, cli_env, metrics_rows, tiny_config, train_command, write_recipe

STEPS = ["train.steps=5", "train.eval_every=5", "train.sample_tokens=6"]
MOE = ["model.n_experts=4", "model.moe_every=2", "model.moe_top_k=2"]
PP2 = ["parallel.pp=2", "parallel.micro_batches=2"]
LLAMA = {"model_type": "llama", "vocab_size": 251, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": 3,
         "bos_token_id": 1, "eos_token_id": 2}
MIXTRAL = {"model_type": "mixtral", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2, "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2,
           "output_router_logits": True, "router_aux_loss_coef": 0.1}
INDUCTOR = ['train.compile_backend="inductor"']

# name -> overrides; {hf} is the folder of the Hugging Face configs above. Compiled with aot_eager unless named.
WORLD1 = {
    "plain_inductor": INDUCTOR,
    "recompute_full": ['parallel.recompute="full"'],  # torch.utils.checkpoint inside the compiled block
    "recompute_selective_moe": ['parallel.recompute="selective"', *MOE],  # the core's checkpoint, MoE eager
    # packed documents (tessel.models.documents): the (B, 1, T, T) mask an input of each compiled block and of
    # the core's checkpoint; id 21 is ~6% of the synthetic tokens, and the prompt's bytes fit 32 ids
    "documents_selective": ["model.vocab_size=32", "model.document_separator=21", "model.sliding_window=6",
                            'parallel.recompute="selective"', r'train.sample_prompt="\u0001\u0015\u0002"'],
}
WORLD2 = {
    "dp2": ["parallel.dp=2"],
    "dp2_zero3": ["parallel.dp=2", "parallel.zero_stage=3"],  # gathers and frees eager around each compiled block
    # Megatron's f/g and SP's gathers traced as functional collectives, lowered by inductor
    "tp2_sp_inductor": ["parallel.tp=2", "parallel.sequence_parallel=true", *INDUCTOR],
    "pp2_1f1b": [*PP2, "model.tie_embeddings=true"],
    # the split backward: B computes a compiled block's weight gradients too (split_plan._vectors)
    "pp2_zbv": [*PP2, 'parallel.schedule="zbv"', "parallel.virtual_stages=2", "model.n_layer=4"],
    "ep2_moe": [*MOE, "parallel.ep=2"],
    "cp2_ring": ["parallel.cp=2"],
    "llama_tp2_sp_recompute": ['model.hf_config="{hf}/llama.json"', "parallel.tp=2", "parallel.sequence_parallel=true",
                               'parallel.recompute="full"', "train.lr=1e-3"],
    "mixtral_ep2": ['model.hf_config="{hf}/mixtral.json"', "parallel.ep=2", "train.lr=1e-3"],
    "dp2_model": ["parallel.dp=2", 'train.compile="model"'],
    "pp2_model": [*PP2, 'train.compile="model"'],
    "pp2_zbv_model": [*PP2, 'parallel.schedule="zbv"', "parallel.virtual_stages=2", "model.n_layer=4",
                      'train.compile="model"'],  # a chunk is one node: W runs its whole backward
}
WORLD4 = {"grid2d_tp4": ["parallel.tp=4", 'parallel.tp_mode="2d"']}
PS = ["parallel.dp=2", 'parallel.dp_arch="ps"', "parallel.ps_servers=2"]  # world 4: two workers, two servers
WORLD8 = {"dp2_tp2_pp2": ["parallel.dp=2", "parallel.tp=2", *PP2]}
# dense reference-GPT layouts without a graph break: every block (every chunk under "model") of a rank is one
# graph, compiled once (dynamo lifts a block's parameters into inputs, so the blocks of one class share it)
ONE_GRAPH = {"plain_inductor", "recompute_full", "dp2", "dp2_zero3", "tp2_sp_inductor", "pp2_1f1b", "pp2_zbv",
             "dp2_model", "pp2_model", "dp2_tp2_pp2"}

# fp32. aot_eager runs the eager kernels on the captured graph, so most layouts agree bit for bit; where
# functionalization reorders an op (TP's copies, the grid's partial sums, Mixtral's routing) or inductor fuses
# and reorders reductions, results differ by fp32 rounding. Measured after 5 AdamW steps (lr 1e-2; 1e-3 for
# the Hugging Face models): aot_eager losses equal, gradient norms within 1e-7 relative, weights within 4e-7;
# inductor (tp2+SP, ZeRO-3, ZBV, MoE, Ulysses) losses within 5e-7, gradient norms within 7e-7 relative,
# weights within 1.6e-5 (AdamW's division by sqrt(v) magnifies a near-zero gradient's rounding). The
# tolerances are tests/parallel/test_hybrid.py's. A wrong compiled layout is far outside them: a lost
# all-reduce of the 2.5D grid's weights under compile (found by this comparison, fixed in
# tessel.parallel.tensor.comm.CopyToTP) moved the loss by 1e-2 and weights by 5e-2.
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
WEIGHT_TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("hf")
    for name, doc in {"llama": LLAMA, "mixtral": MIXTRAL}.items():
        (folder / f"{name}.json").write_text(json.dumps(doc))
    return str(folder)


def _compiled() -> tuple[int, int]:
    """Graphs dynamo compiled and frames it tried to compile in this process, since the last reset."""
    return counters["stats"]["unique_graphs"], counters["frames"]["total"]


def _named(model: nn.Module, runner) -> dict[str, torch.Tensor]:
    return dict(runner.named_parameters()) if hasattr(runner, "named_parameters") else dict(model.named_parameters())


def _weights(model: nn.Module, runner) -> dict[str, torch.Tensor]:
    """This rank's weights (a pipeline: its stage's; ZeRO-3: gathered, a collective every rank calls)."""
    if hasattr(runner, "gathered"):
        with runner.gathered():
            return {n: p.detach().clone() for n, p in runner.named_parameters().items()}
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _observe(runner, model: nn.Module | None, seen: dict) -> None:
    """Wrap the runner's step: gradients after the first, weights before the fourth, counters after each."""
    step = runner.forward_backward

    def observed(x, y):
        if len(seen["graphs"]) == 3 and model is not None:
            seen["weights"] = _weights(model, runner)
        loss = step(x, y)
        if not seen["graphs"] and model is not None:
            seen["grads"] = {n: p.grad.clone() for n, p in _named(model, runner).items() if p.grad is not None}
        seen["graphs"].append(_compiled())
        return loss

    runner.forward_backward = observed


def _record_zero3(runner, seen: dict) -> None:
    """ZeRO-3's communication in the first step, in order: each unit's gather issued, waited on and freed,
    each reduce-scatter launched (unit -1: the root). Equal sequences eager and compiled: the same overlap."""
    engine = getattr(runner, "model", None)
    if not isinstance(engine, ZeroDataParallel) or engine.stage != 3:
        return
    seen["zero3"] = []
    placement, reduction = engine.placement, engine.reduction
    for owner, method, what in [(placement, "_gather_async", "gather"), (placement, "_wait_gathered", "wait"),
                                (placement, "_reshard", "free"), (reduction, "_launch", "reduce")]:
        def recorded(groups, call=getattr(owner, method), what=what):
            if not seen["graphs"]:  # the first step only
                seen["zero3"].append((what, [g.index for g in groups] if isinstance(groups, list) else groups.index))
            return call(groups)
        setattr(owner, method, recorded)


def _train(cfg) -> dict:
    torch._dynamo.reset()  # another case's graphs are neither reused nor counted against the recompile limit
    counters.clear()
    trainer, model, runner, _ = build_trainer(cfg)
    seen = {"graphs": [], "grads": {}, "weights": {}}
    _observe(runner, model, seen)
    _record_zero3(runner, seen)
    summary = trainer.fit()
    return {"losses": summary.losses, "grad_norms": [row["grad_norm"] for row in trainer.history],
            "val_loss": summary.val_loss, "sample": summary.sample, **seen, "end": _compiled()}


def _train_ps(cfg) -> dict | None:
    """A parameter-server rank (tessel.train.ps.trainer): a worker's losses and counters; a server's None."""
    torch._dynamo.reset()
    counters.clear()
    seen = {"graphs": [], "grads": {}, "weights": {}}
    build = WorkerRunner.__init__

    def observed_init(self, *args, **kwargs):
        build(self, *args, **kwargs)
        _observe(self, None, seen)

    WorkerRunner.__init__ = observed_init
    try:
        summary = train_rank_ps(cfg, torch.device("cpu"))
    finally:
        WorkerRunner.__init__ = build
    if summary is None:
        return None
    return {"losses": summary.losses, "grad_norms": [], "val_loss": summary.val_loss, "sample": summary.sample,
            **seen, "end": _compiled()}


def _both(cases: dict, hf: str, ps: bool = False) -> dict:
    """Every case eager, then compiled (its own compile mode, or "blocks"), on the current process group."""
    out = {}
    for name, overrides in cases.items():
        run = [o.format(hf=hf) for o in [*STEPS, *overrides]]
        compiled = run if any(o.startswith("train.compile=") for o in run) else [*run, 'train.compile="blocks"']
        if not any(o.startswith("train.compile_backend") for o in run):
            compiled = [*compiled, 'train.compile_backend="aot_eager"']
        eager = [o for o in run if not o.startswith("train.compile")]
        train = _train_ps if ps else _train
        out[name] = {"eager": train(tiny_config(*eager)), "compiled": train(tiny_config(*compiled))}
    return out


def _check(name: str, rank: int, eager: dict | None, compiled: dict | None) -> None:
    if eager is None:  # a parameter server: it trains nothing itself
        assert compiled is None
        return
    where = f"{name} rank {rank}"
    assert len(eager["losses"]) == 5 and eager["losses"][-1] < eager["losses"][0]  # it learns
    assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), msg=lambda m: f"{where}: {m}",
                 **LOSS_TOL)
    assert_close(torch.tensor(compiled["grad_norms"]), torch.tensor(eager["grad_norms"]),
                 msg=lambda m: f"{where} grad norm: {m}", **GRAD_TOL)
    assert compiled["grads"].keys() == eager["grads"].keys()
    for n, g in eager["grads"].items():
        assert_close(compiled["grads"][n], g, msg=lambda m: f"{where} gradient {n}: {m}", **GRAD_TOL)
    assert compiled["weights"].keys() == eager["weights"].keys()
    for n, w in eager["weights"].items():
        assert_close(compiled["weights"][n], w, msg=lambda m: f"{where} weight {n}: {m}", **WEIGHT_TOL)
    # evaluation runs eagerly in both (a parameter server's other workers report NaN: worker 0 measures)
    if "zero3" in name:  # gathers prefetched, frees and reduce-scatters as eagerly, around compiled blocks
        assert compiled["zero3"] == eager["zero3"] and len(eager["zero3"]) > 10, where
    assert_close(compiled["val_loss"], eager["val_loss"], equal_nan=True, **LOSS_TOL)
    assert compiled["sample"] == eager["sample"], f"{where}: sample differs"
    # compiled by the end of the first step, and nothing after it: not in steps 2-5, evaluation or sampling
    first, end = compiled["graphs"][0], compiled["end"]
    assert first[0] >= 1, f"{where}: nothing was compiled"
    assert compiled["graphs"] == [first] * 5 and end == first, f"{where}: compiled after the first step: " \
        f"{compiled['graphs']} then {end} (graphs, frames)"
    if name in ONE_GRAPH:
        assert first[0] == 1, f"{where}: {first[0]} graphs where one block (or chunk) compiles once"
    assert eager["end"] == (0, 0)


def _check_all(got: list[dict], cases) -> None:
    for name in cases:
        for rank, result in enumerate(got):
            _check(name, rank, result[name]["eager"], result[name]["compiled"])


def test_single_process_compiled_matches_eager(hf):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got = _both(WORLD1, hf)
    finally:
        torch.set_num_threads(threads)
    _check_all([got], WORLD1)


def test_world2_layouts_compiled_match_eager(hf):
    _check_all(spawn(_both, 2, WORLD2, hf, timeout=600), WORLD2)


def _world4(hf: str) -> dict:
    return {**_both(WORLD4, hf), **_both({"ps_dp2": PS}, hf, ps=True)}


def test_world4_grid_and_parameter_server_compiled_match_eager(hf):
    _check_all(spawn(_world4, 4, hf, timeout=600), [*WORLD4, "ps_dp2"])


def test_world8_dp_tp_pp_compiled_matches_eager(hf):
    _check_all(spawn(_both, 8, WORLD8, hf, timeout=600), WORLD8)


# ---- no processes -------------------------------------------------------------------------------------

def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=64, n_layer=2, n_head=4, d_model=32, max_seq_len=16, **kw))


def test_compiled_blocks_keep_names_and_run_eagerly_without_gradients():
    cfg = tiny_config('train.compile="blocks"', 'train.compile_backend="aot_eager"')
    model, runner, _ = build_runner(cfg, init_seed=0)
    assert all(isinstance(block.forward, TrainingForward) for block in model.layers)
    assert set(runner.named_checkpoint_tensors()) == set(build_runner(tiny_config())[1].named_checkpoint_tensors())
    assert not any("_orig_mod" in n for n in model.state_dict())  # no OptimizedModule in any name
    torch._dynamo.reset()
    counters.clear()
    x = torch.randint(0, cfg.model.vocab_size, (2, 8))
    with torch.no_grad():
        runner.evaluate(x, x)
        runner.generate(x[:, :3], 4, seed=0)
    assert _compiled() == (0, 0)  # evaluation and sampling: the eager forward, nothing compiled


def test_copy_to_tp_keeps_its_backward_across_a_graph_break(monkeypatch):
    """Megatron's f on a weight whose transposed view leaves the graph (the 2.5D grid's weights before SUMMA's
    eager step): AOTAutograd rebuilds such a view from the input, dropping an identity forward's backward,
    so CopyToTP copies when compiled (tessel.parallel.tensor.comm). The all-reduce is stood in for by x2."""
    monkeypatch.setattr(comm, "all_reduce", lambda t, group: t * 2)

    @torch.compiler.disable
    def eager_matmul(a, b):
        return a @ b

    def f(x, w):
        return eager_matmul(x, comm.copy_to_tp(w, group=object()).t())

    x = torch.randn(2, 3)
    w = torch.randn(3, 3, requires_grad=True)
    f(x, w).sum().backward()
    want, w.grad = w.grad, None
    torch._dynamo.reset()
    torch.compile(f, backend="aot_eager")(x, w).sum().backward()
    assert_close(w.grad, want, rtol=0, atol=0)


def test_split_backward_runs_a_compiled_block_once():
    """A zero-bubble stage of compiled blocks: B and W give one whole backward's gradients, and W runs no
    compiled node again (B computed their weight gradients; W only accumulates them)."""
    model = _gpt()
    cfg = tiny_config(*PP2, 'parallel.schedule="zb-h1"', 'train.compile="blocks"', 'train.compile_backend="aot_eager"')
    # a stage's blocks, compiled as under that pipeline
    compile_for_training([model], cfg.parallel, cfg.train, model_family(cfg.model))
    torch._dynamo.reset()
    x, y = torch.randn(2, 16, 32), torch.randint(0, 64, (2, 16))

    def stage(h):
        for layer in model.layers:
            h = layer(h, model.rope_cos, model.rope_sin)
        return cross_entropy(model.lm_head(model.norm(h)), y)

    inp = x.clone().requires_grad_(True)
    stage(inp).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}  # all but the embedding
    want_dx = inp.grad
    model.zero_grad(set_to_none=True)
    inp = x.clone().requires_grad_(True)
    dx, work = backward_input(stage(inp), None, inp)
    assert all(p.grad is None for p in model.parameters())  # B leaves .grad alone
    assert not any(is_compiled(type(node)) for group in work.groups for node in group.nodes)
    assert any(True for _ in work.ready)  # the blocks' weight gradients, held for W
    work.run()
    # the same compiled kernels either way: equal, not close
    assert_close(dx, want_dx, rtol=0, atol=0)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for n, g in want.items():
        assert_close(got[n], g, rtol=0, atol=0, msg=n)


def test_tessel_train_cli_with_compiled_blocks(tmp_path):
    recipe = write_recipe(tmp_path / "tiny.toml", "train.steps=4")
    out = tmp_path / "run"
    done = subprocess.run(train_command(recipe, out, "--set", 'train.compile="blocks"', "--set",
                                        'train.compile_backend="aot_eager"'),
                          env=cli_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    losses = [row["loss"] for row in metrics_rows(out)]
    assert len(losses) == 4 and losses[-1] < losses[0]


def test_model_compile_under_zero3_is_refused_by_name():
    with pytest.raises(ConfigError) as err:
        tiny_config("parallel.dp=2", "parallel.zero_stage=3", 'train.compile="model"')
    assert err.value.field == "train.compile" and "blocks" in str(err.value)
    tiny_config("parallel.dp=2", "parallel.zero_stage=3", 'train.compile="blocks"')  # each block inside the hooks
    tiny_config("parallel.dp=2", *PP2, "parallel.zero_stage=3", 'train.compile="model"')  # gathered a whole step
