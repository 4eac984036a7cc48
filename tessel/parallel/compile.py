"""train.compile: torch.compile of each transformer block ("blocks", regional compilation) or of the whole
model, each pipeline chunk on its own ("model").

The choices, and why:

- Where: tessel.apply runs this step (apply_compile) after TP/SP, CP, EP, the pipeline split and recompute, and
  before DP/ZeRO, as torchtitan orders it. What is compiled is the block as this rank runs it (its shards, its
  checkpoint), and the hooks of ZeRO and DP (stage 3's gather before a block and free after it, the
  bucketed gradient all-reduce) stay eager around the compiled forward: their collectives overlap compute
  as they do without compilation.
- How: the forward is compiled on the instance (`module.forward = ...`, as recompute replaces it). Neither
  `torch.compile(module)`, an OptimizedModule that puts `_orig_mod.` into every parameter and checkpoint
  name, nor `nn.Module.compile()`, which compiles `_call_impl` and so traces the module's own hooks
  (ZeRO-3's storage resizes and parameter class switches) into the graph. Names do not change. For the
  same reason "model" (which traces the hooks of the blocks inside the model) is refused under ZeRO-3
  without a pipeline (tessel.config); a pipeline's ZeRO-3 gathers a whole step at once, outside the graph.
- One graph per kind of block: dynamo keys its cache on the forward's code and lifts a module's
  parameters into graph inputs (it inlines nn.Modules), so every block of one class passes the first
  one's guards and reuses its graph: a stage of L blocks compiles once.
- No recompilation: `dynamic=False`, a training step's shapes being fixed; the tests count that nothing
  compiles after the first step. Without gradients (evaluation, sampling) the eager forward runs:
  sampling's window grows a token at a time, which would compile a graph per length (or a dynamic-shape
  one), and evaluation's graph differs from training's (no autograd), while both are a small part of a run.
- Data-dependent modules run eagerly inside a compiled block (`torch.compiler.disable`): an MoE layer's
  routing (which rows go to which expert, the all-to-all's split sizes) and Mixtral's experts have shapes
  that change with every batch, so compiled they would recompile on each new routing. The block compiles
  as two graphs around the break.
- Hand-written communication: Megatron's f/g (tessel.parallel.tensor.comm), sequence parallelism's
  gathers, the 3D cube's and Ulysses' all-to-all are traced, dynamo turning each c10d call into its
  functional collective inside the graph (tensor/comm.py's f copies and its in-place g sums out of place
  when compiled: dynamo cannot trace mark_dirty, and AOTAutograd drops an identity's backward where a view
  of its output leaves the graph).
  Graph breaks stay where tracing would cost more than it gives: ring attention's P2P exchanges, the
  2D/2.5D grid's SUMMA layers (eager_modules), transformers' output-capturing hooks (a ContextVar;
  Mixtral's router logits). Each break ends one graph and starts the next; none recompiles.
- A zero-bubble pipeline's split backward (tessel.parallel.pipeline.split_plan) sees a compiled block as
  one autograd node that computes its input and weight gradients together: B computes both, W only
  accumulates the block's weight gradients, so under compile those schedules' W holds no block work (the
  weight branches outside blocks, the embedding and head, still wait for W): the bubble those schedules
  remove comes back, to about 1F1B's. Under "model" a chunk is one node: B runs all of it (the first
  stage, which sends no input gradient, in W). B
  retains the graph for W, so those schedules compile without donated buffers (the backward's reuse of
  saved activations' memory, which AOTAutograd allows only for a backward run once).
- Caches: inductor's FX graph cache and AOTAutograd's cache live in TORCHINDUCTOR_CACHE_DIR (default
  /tmp/torchinductor_<user>), which every rank of a machine shares; a relaunched or resumed job, or
  another rank that meets the same graph later, reads its kernels from there instead of compiling them.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tessel.config import ParallelConfig, TrainConfig
from tessel.hf.ep_plan import expert_sites
from tessel.mesh import Mesh
from tessel.models.family import ModelFamily
from tessel.models.moe import moe_layers
from tessel.parallel.pipeline.schedules import splits_backward
from tessel.parallel.plan import Plan
from tessel.parallel.tensor_nd.summa import Linear2D, TiedHead2D


def apply_compile(plan: Plan, mesh: Mesh, parallel: ParallelConfig, train: TrainConfig, family: ModelFamily) -> Plan:
    """tessel.apply's step for train.compile: each block, or the model (each pipeline chunk), compiled where
    ZeRO's and DP's hooks will wrap it."""
    if train.compile != "off":
        compile_for_training(list(plan.model) if mesh.size("pp") > 1 else [plan.model], parallel, train, family)
    return plan


def compile_for_training(stages: list[nn.Module], parallel: ParallelConfig, train: TrainConfig,
                         family: ModelFamily) -> None:
    """Compile the model (a pipeline rank: each of its chunks) as train.compile says: each block's forward,
    or each stage's; some modules eager inside (eager_modules). A Hugging Face model comes without its key/value
    cache, whose updates dynamo cannot trace in a checkpointed layer (tessel.models.hf.build.as_training_model,
    which every one passes through)."""
    for stage in stages:
        run_eagerly(eager_modules(stage, family))
    if parallel.pp > 1 and splits_backward(parallel.schedule):
        # B runs its backward with retain_graph (W reuses the graph), which AOTAutograd refuses for a backward
        # compiled to reuse saved activations' buffers (donated buffers): compile without that reuse
        torch._functorch.config.donated_buffer = False
    blocks = [block for stage in stages for block in family.decoder_layers(stage)]
    compile_forwards(stages if train.compile == "model" else blocks, train.compile_backend)


class TrainingForward:
    """A module's forward compiled for training; the eager one where no gradient is taken (see above)."""

    def __init__(self, forward, backend: str):
        self.eager = forward
        self.compiled = torch.compile(forward, backend=backend, dynamic=False)

    def __call__(self, *args, **kwargs):
        if torch.is_grad_enabled():
            return self.compiled(*args, **kwargs)
        return self.eager(*args, **kwargs)


def compile_forwards(modules: list[nn.Module], backend: str) -> None:
    """Compile each module's forward on the instance (its names and hooks unchanged)."""
    for module in modules:
        if not isinstance(module.forward, TrainingForward):
            module.forward = TrainingForward(module.forward, backend)


def eager_modules(model: nn.Module, family: ModelFamily) -> list[nn.Module]:
    """The modules that stay eager inside a compiled region: those whose shapes follow the routing (the
    reference GPT's MoE layers; a Hugging Face MoE's experts, the modules its ep plan names, with their
    all-to-all under ep), and the 2D/2.5D grid's SUMMA layers, whose rooted broadcasts and reduces dynamo
    cannot trace (each step compiled on its own would recompile for every panel shape)."""
    eager: list[nn.Module] = list(moe_layers(model))
    eager += [m for m in model.modules() if isinstance(m, (Linear2D, TiedHead2D))]
    if family.experts_by_plan:
        eager += [site.module for site in expert_sites(model)]
    return eager


def run_eagerly(modules: list[nn.Module]) -> None:
    """These modules' forwards stay eager inside a compiled region (a graph break around each)."""
    for module in modules:
        module.forward = torch.compiler.disable(module.forward, recursive=True)
