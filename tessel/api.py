"""Library use: tessel's layouts on a user's own transformers model, driven by the user's own loop.

    dist.init_process_group("gloo")                       # under torchrun
    mesh = tessel.make_mesh({"dp": 2, "tp": 2})           # one mesh, named axes
    job = tessel.parallelize(model, mesh, "zero=1,sp=1")  # the model as the user built it
    opt = job.optimizer(lr=3e-4, weight_decay=0.1)
    for input_ids, targets in batches:                    # every rank the same global batch
        loss = job.step(job.shard(input_ids), job.shard(targets))
        job.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    state = job.full_state_dict()                         # whole tensors under the model's own names

`parallelize` writes down what `tessel train` would have been given: a Config
from the model's own config (tessel.hf.shape reads it, as for model.hf_config)
and the layout (tessel.planner.layout's `dp=2,tp=2,zero=1`), checked by the
recipe's rules (tessel.config.check_layout) before anything is cut. Then
tessel.apply's steps (TP/SP -> CP -> EP -> PP -> fused loss -> recompute -> compile -> DP/ZeRO)
cut the model in place and return a Runner; a ParallelJob drives it as the
trainer does, minus the loop: the data, the optimizer's steps, the learning-rate
schedule and logging stay the user's.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tessel.axes import AXES
from tessel.config import Config, ConfigError, build_config
from tessel.hf.shape import model_shape
from tessel.mesh import Mesh
from tessel.models.hf.build import as_training_model
from tessel.observe.attention import check_attention
from tessel.parallel.adamw import adamw
from tessel.parallel.norms import clip_grad_norm_
from tessel.parallel.runner import Runner
from tessel.parallel.weight_decay import param_groups
from tessel.apply import parallelize as apply_layout
from tessel.planner.layout import Layout, parse_fix, parse_layout
from tessel.sharding import block_sizes, packed_dims
from tessel.train.checkpoint.logical import LogicalView, as_logical
from tessel.train.checkpoint.manager import CheckpointManager, step_dir, verify
from tessel.train.checkpoint.optimizer_state import OptimizerState, OwnState, PerParameterState
from tessel.train.checkpoint.tensors import LocalTensors
from tessel.train.data import cache_dir
from tessel.train.mesh_cohort import mean_over
from tessel.train.optim import optimizer_params

LayoutSpec = str | dict | Layout | None


def parallelize(model: nn.Module, mesh: Mesh, layout: LayoutSpec = None, *, precision: str = "fp32",
                compile: str = "off", fused_loss: bool = False) -> "ParallelJob":
    """Cut a transformers causal LM over `mesh` by `layout`; the job a training loop drives.

    layout: 'zero_stage=1,sequence_parallel=true' (the keys of `tessel plan --layout`, the recipe's parallel
    names, or their short aliases: 'zero=1,sp=true'), a dict of them, or a Layout; an axis it
    leaves out takes the mesh's size, one it names must equal it. `model` is used as it is (no copy, no
    rebuild): its layers are replaced by their shards, and its forward answers with the logits tensor
    (B, T, V) instead of a ModelOutput, as everywhere in tessel (under fused_loss, with what enters its head:
    the hidden states (B, T, C), which `step` scores; a Gemma soft-capping moves into that loss, the model's
    config says None). Bad input raises ConfigError naming it,
    before any collective. precision, compile and fused_loss are the recipe's train.precision, train.compile
    ('off', 'blocks': each decoder layer compiled, 'model') and train.fused_loss.
    """
    check_model(model)
    if not isinstance(mesh, Mesh):
        raise ConfigError("mesh", f"expected a tessel.Mesh (tessel.make_mesh({{'dp': 2, ...}})), got {type(mesh).__name__}")
    cfg = job_config(model, resolve_layout(layout, mesh), mesh,
                     {"precision": precision, "compile": compile, "fused_loss": fused_loss})
    check_world(mesh)
    as_training_model(model)  # answers with logits, builds no key/value cache
    runner = apply_layout(model.to(mesh.device), mesh, cfg)
    if mesh.rank == 0:  # on a GPU: one line if attention falls back to the math kernel (nothing on the CPU)
        check_attention(cfg, mesh.device)
    return ParallelJob(model, mesh, cfg, runner)


def check_model(model: nn.Module) -> None:
    # deferred: transformers takes seconds to import; only a caller handing in a model pays for it
    from transformers import PreTrainedModel
    if not isinstance(model, PreTrainedModel):
        raise ConfigError("model", f"expected a transformers PreTrainedModel (AutoModelForCausalLM.from_config or "
                                   f"from_pretrained), got {type(model).__name__}")
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError("model", "its parameters are on the meta device: build it with weights (or load them) "
                                   "on every rank before parallelize")


def check_world(mesh: Mesh) -> None:
    """A mesh of several ranks needs the process group it was made on (make_mesh builds its groups)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mesh.world_size != world:
        raise ConfigError("mesh", f"holds {mesh.world_size} ranks but the process group has {world} "
                                  "(call torch.distributed.init_process_group first, under torchrun)")


def resolve_layout(layout: LayoutSpec, mesh: Mesh) -> Layout:
    """The layout with every axis the mesh's: an axis the text or dict leaves out takes the mesh's size."""
    if not isinstance(layout, (str, dict, Layout, type(None))):
        raise ConfigError("layout", f"expected a string such as 'dp=2,zero=1', a dict or a Layout, "
                                    f"got {type(layout).__name__}")
    if isinstance(layout, Layout):
        given, named = layout, set(AXES)
    else:
        text = layout if isinstance(layout, str) else ",".join(f"{k}={v}" for k, v in (layout or {}).items())
        try:
            given, named = parse_layout(text), set(parse_fix(text))
        except ConfigError as err:
            raise ConfigError("layout", err.message) from None
        if "micro_batch" in named:
            raise ConfigError("layout", "micro_batch: step() is given this rank's rows, split into "
                                        "grad_accum*micro_batches micro-batches; leave micro_batch out")
        if "micro_batches" not in named and mesh.size("pp") > 1:
            given = replace(given, micro_batches=mesh.size("pp"))  # a micro-batch per stage: every stage busy at once
    if mesh.size("cp") > 1:  # step() is handed whole rows; cp ranks would each need their chunks of them
        raise ConfigError("layout", "cp > 1 trains through `tessel train` (its sampler hands each cp rank its "
                                    "chunks); tessel.parallelize takes meshes without a cp axis so far")
    mesh_sizes, asked = {a: mesh.size(a) for a in AXES}, given.to_dict()
    for axis in AXES:
        if axis in named and asked[axis] != mesh_sizes[axis]:
            raise ConfigError("layout", f"{axis}={asked[axis]} but the mesh has {axis}={mesh_sizes[axis]} "
                                        f"({', '.join(f'{a}={n}' for a, n in mesh_sizes.items())})")
    return replace(given, **mesh_sizes)


def job_config(model: nn.Module, layout: Layout, mesh: Mesh, train: dict) -> Config:
    """The recipe `tessel train` would run: the model's config as model.hf_config, the layout's parallel
    fields, `train`'s fields (precision, compile, fused_loss); the other train fields are placeholders that
    pass the batch rules (the batch comes with each step)."""
    hf_config = hf_config_file(model)
    max_seq_len = model_shape(hf_config)["max_seq_len"]
    raw = {"model": {"hf_config": str(hf_config)},
           "parallel": {**layout.parallel_fields(), "rank_order": list(mesh.order)},
           "train": {"global_batch": layout.batch_shards * layout.chunks, "grad_accum": layout.grad_accum,
                     "seq_len": max_seq_len - max_seq_len % layout.tp, **train,
                     "eval_every": 0, "sample_tokens": 0},
           "data": {"source": "synthetic"}}
    return build_config(raw)


def hf_config_file(model: nn.Module) -> Path:
    """The model's config as a config.json (what tessel.config reads a Hugging Face shape from), under the
    cache named by its contents: every rank writes the same bytes, and a rename makes each write whole."""
    text = model.config.to_json_string(use_diff=False)
    file = cache_dir() / "hf-configs" / hashlib.sha256(text.encode()).hexdigest()[:16] / "config.json"
    if not file.is_file():
        file.parent.mkdir(parents=True, exist_ok=True)
        scratch = file.with_name(f"config.json.tmp{os.getpid()}")
        scratch.write_text(text, encoding="utf-8")
        os.replace(scratch, file)
    return file


@dataclass
class ParallelJob:
    """A model cut over a mesh, for a training loop that is the user's.

    Every rank calls each method (they are collective). `step` takes this rank's rows: those of its data
    shard (`shard` cuts them from a global batch; a tp or pp peer takes the same rows).
    """
    model: nn.Module  # the user's model, cut in place (under pp, the runner holds this rank's stages)
    mesh: Mesh
    config: Config  # the recipe this layout is (`tessel train` would run it)
    runner: Runner
    _optimizer: torch.optim.Optimizer | None = None
    _manager: CheckpointManager | None = None

    @property
    def data_rank(self) -> int:
        """This rank's data shard, 0 .. data_shards - 1 (a DistributedSampler's `rank`)."""
        return self.mesh.local_rank_in("dp", "ep")

    @property
    def data_shards(self) -> int:
        """How many ranks see different rows (dp x ep; a DistributedSampler's `num_replicas`)."""
        return self.mesh.size("dp", "ep")

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch (B, ...): the data_rank-th of data_shards equal runs."""
        if batch.size(0) % self.data_shards:
            raise ValueError(f"a global batch of {batch.size(0)} rows does not split over {self.data_shards} "
                             "data shards (dp x ep)")
        rows = batch.size(0) // self.data_shards
        return batch[self.data_rank * rows:(self.data_rank + 1) * rows]

    def step(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this rank's rows (B, T): targets[b, t] is the token after input_ids[b, t].
        Gradients of the global batch's mean loss land in the parameters the optimizer steps (reduced over
        the data shards, through the pipeline's schedule); returns that mean loss, the same on every rank."""
        self._check_batch(input_ids, targets)
        return mean_over(self.runner.forward_backward(input_ids, targets).float(), self.mesh, "dp", "ep")

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The global batch's mean loss without gradients (this rank's rows given, as to step)."""
        return mean_over(self.runner.evaluate(input_ids, targets).float(), self.mesh, "dp", "ep")

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (tp shards, its pipeline stages' own), each once. Under ZeRO the optimizer
        steps flat shards of them instead: use `optimizer()`."""
        return self.runner.parameters()

    def optimizer(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                  weight_decay: float = 0.01) -> torch.optim.Optimizer:
        """AdamW (torch's defaults) over what this rank steps; weight decay on matrices only (norms' gains and
        biases get none: tessel.train.optim). Under ZeRO, the sharded AdamW the layout built, set to these
        options; otherwise a torch.optim.AdamW (any torch optimizer over parameters() works as well). Either
        steps in one fused kernel on CUDA, foreach kernels elsewhere (tessel.parallel.adamw)."""
        own = self.runner.optimizer
        if own is None:
            self._optimizer = adamw(param_groups(self.parameters(), weight_decay), lr=lr, betas=betas, eps=eps)
            return self._optimizer
        decayed, plain = own.param_groups  # tessel.parallel.weight_decay.param_groups' order: matrices, then the rest
        for group, decay in ((decayed, weight_decay), (plain, 0.0)):
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=decay)
        self._optimizer = own
        return own

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their norm over the whole model (every shard once) is at most max_norm;
        returns the norm before clipping, the same on every rank."""
        stepped = self.runner.optimizer if self.runner.optimizer is not None else self._optimizer
        params = optimizer_params(stepped) if stepped is not None else self.parameters()
        return clip_grad_norm_(params, max_norm, self.mesh)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and persistent buffer as its whole tensor (on the CPU), under the names of the model
        as transformers built it, on every rank: what `model.load_state_dict` of an uncut copy takes."""
        view = LogicalView(self.mesh)
        named = dict(self.runner.named_checkpoint_tensors())
        live = {f"model/{k}": v for k, v in named.items()}
        if self.runner.optimizer is not None:  # ZeRO hands over what it owns (stage 3 frees the module's own)
            live.update({k: t for k, t in self.runner.optimizer.checkpoint_tensors().items()
                         if k.startswith("model/")})
        local = {k[len("model/"):]: self._whole(view, named, k, t) for k, t in sorted(live.items())}
        if self.mesh.size("pp") == 1:
            return local
        stages: list[dict] = [{} for _ in range(self.mesh.size("pp"))]
        dist.all_gather_object(stages, local, group=self.mesh.group("pp"))  # each stage holds its own names
        return {k: v for stage in stages for k, v in stage.items()}

    def save(self, root: str | Path, step: int, keep: int = 3) -> Path:
        """The model and the optimizer's state after `step` steps, as tessel's checkpoint <root>/step_<step>
        (collective; root on a file system every rank sees): `tessel export` turns it into a folder that
        from_pretrained loads, `load` resumes it under any layout. The `keep` newest under root are kept."""
        manager = self._checkpoints(root, keep)
        optimizer = self._optimizer_state("save")
        cfg = self.config
        info = {"model": cfg.model.model_dump(mode="json"), "world_size": self.mesh.world_size,
                "layout": {**cfg.parallel.model_dump(mode="json"), "grad_accum": cfg.train.grad_accum}}
        manager.save(step, LocalTensors(self.runner, optimizer), info)
        return step_dir(Path(root), step)

    def load(self, path: str | Path) -> int:
        """Read a checkpoint that `save` (or `tessel train`, of the same model) wrote, under any layout, into the
        model and the optimizer (`optimizer()` first); returns its step. CheckpointError, before anything is
        read, for one that is damaged or holds other shapes."""
        path = Path(path)
        verify(path)
        manifest = self._checkpoints(path.parent, None).load(path, LocalTensors(self.runner,
                                                                                self._optimizer_state("load")))
        return int(manifest["step"])

    def _checkpoints(self, root: str | Path, keep: int | None) -> CheckpointManager:
        """The checkpoint writer (made once: it makes process groups of its own, collectively)."""
        if self._manager is None or self._manager.root != Path(root):
            self._manager = CheckpointManager(root, self.mesh, keep=keep or 3)
        if keep is not None:
            self._manager.keep = keep
        return self._manager

    def _optimizer_state(self, verb: str) -> OptimizerState:
        if self.runner.optimizer is not None:
            return OwnState(self.runner.optimizer)
        if self._optimizer is None:
            raise ValueError(f"{verb} needs the optimizer whose state it holds: call job.optimizer() first")
        return PerParameterState(self._optimizer)

    def _whole(self, view: LogicalView, named: dict[str, torch.Tensor], key: str, t: torch.Tensor) -> torch.Tensor:
        """The whole tensor of `key` from this rank's piece `t` (collective over the axes that split it)."""
        like = named.get(key[len("model/"):])
        packed = packed_dims(like).get("tp") if like is not None and like.shape == t.shape else None
        if packed is not None:  # a fused q|k|v: each rank holds its heads' piece of every block
            return _unpack(t.detach(), *packed, self.mesh)
        whole = as_logical(view, named, key, t)
        return (whole.full_tensor() if isinstance(whole, DTensor) else whole).detach().cpu().clone()

    def _check_batch(self, input_ids: torch.Tensor, targets: torch.Tensor) -> None:
        if input_ids.dim() != 2 or input_ids.shape != targets.shape:
            raise ValueError(f"step takes input_ids and targets of one shape (B, T); got {tuple(input_ids.shape)} "
                             f"and {tuple(targets.shape)}")
        chunks = self.config.train.grad_accum * self.config.parallel.micro_batches
        if input_ids.size(0) % chunks:
            raise ValueError(f"this rank's {input_ids.size(0)} rows do not split into ga*m = {chunks} micro-batches")
        p = self.config.parallel
        if p.sequence_parallel and input_ids.size(1) % p.tp:
            raise ValueError(f"sequence parallelism splits the {input_ids.size(1)} positions over tp={p.tp}: "
                             "they must divide")


def _unpack(piece: torch.Tensor, dim: int, blocks: tuple[int, ...], mesh: Mesh) -> torch.Tensor:
    """A packed tp shard (tessel.sharding.mark_packed: rank r holds the r-th chunk of each block along dim)
    -> the whole tensor: each block's chunks in rank order, the blocks side by side."""
    pieces = [torch.empty_like(piece) for _ in range(mesh.size("tp"))]
    dist.all_gather(pieces, piece.contiguous(), group=mesh.group("tp"))  # in tp rank order: global ranks rise with it
    sizes = block_sizes(blocks, piece.size(dim))
    whole = [torch.cat([p.split(sizes, dim)[b] for p in pieces], dim) for b in range(len(blocks))]
    return torch.cat(whole, dim).cpu()

