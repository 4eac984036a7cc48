"""Does a recipe's own layout fit a memory budget?

`tessel train` checks this before spawning a rank (tessel.calibrate.device.check_memory
measures the budget: a GPU's memory, or the RAM Linux can give shared by the node's ranks),
so a recipe that would die minutes later taking tens of GB per rank (model.n_layer = 100000,
a huge train.global_batch) fails in well under a second with one line instead.
The estimate is the cost model's (tessel.planner.cost, what `tessel plan`
prints per device: parameters, gradients and AdamW state by ZeRO stage,
activations by tp/sp/pp schedule/recompute/micro-batch, MoE, the collectives'
workspace, the runtime's baseline) for the layout the recipe itself names.
The check is a guard against gross mistakes, not a tuner: it compares with the
whole budget, not the planner's usable fraction, so a recipe that would merely
be tight still starts. Analytic only: nothing is allocated, measured or run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tessel.config import Config, ConfigError
from tessel.planner.cluster import Cluster, Link
from tessel.planner.cost import CostModel
from tessel.planner.layout import config_layout
from tessel.planner.model_spec import ModelSpec, from_config

GiB = 2**30

TERMS = {"params": "parameters", "grads": "gradients", "optimizer": "AdamW state", "activations": "activations",
         "buffers": "communication buffers", "baseline": "runtime"}


@dataclass(frozen=True)
class Budget:
    per_rank: float  # bytes one rank may hold
    baseline: float  # the runtime's own bytes per rank (the allowance, or the probe's measurement)
    workspace: dict  # the collectives' host copies per byte (the probe's; {} unmeasured)
    text: str  # "2 ranks share 23.1 GiB of RAM (11.5 GiB each)"


@dataclass(frozen=True)
class MemoryFit:
    memory: dict[str, float]  # bytes per rank by term (tessel.planner.cost's keys), with "total"
    budget: Budget
    lower_bound: bool = False  # only the parameter state, spread evenly: the rest was not priced
    role: str = ""  # the parameter server's busiest role, "worker" or "server"

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.budget.per_rank

    def need(self) -> str:
        """'the planner estimates 41.3 GiB per rank (its three largest terms)'."""
        terms = sorted(((v, k) for k, v in self.memory.items() if k != "total" and v > 0), reverse=True)[:3]
        parts = ", ".join(f"{TERMS[k]} {size_text(v)}" for v, k in terms)
        return (f"the planner estimates {'at least ' if self.lower_bound else ''}{size_text(self.memory['total'])} "
                f"per {self.role + ' ' if self.role else ''}rank ({parts})")

    def describe(self) -> str:
        return f"{self.need()}; {self.budget.text}"


def check_fit(cfg: Config, budget: Budget, force: bool = False) -> MemoryFit:
    """Refuse (ConfigError on field "memory") a recipe whose layout the planner says cannot fit `budget`.

    With force the estimate is returned whatever it says.
    """
    fit = MemoryFit(state_floor(cfg, budget), budget, lower_bound=True)
    if fit.fits:  # the cost model walks every layer: price it only when the closed form leaves room
        fit = estimate_memory(cfg, budget)
    if not fit.fits and not force:
        raise ConfigError("memory", f"{fit.need()} but {fit.budget.text}; shrink the model or the batch, "
                                    "shard it over more ranks (tp, pp, cp, ZeRO), or pass --force")
    return fit


def size_text(nbytes: float) -> str:
    return f"{nbytes / GiB:,.1f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:,.0f} MiB"


# ---- what the recipe needs ----------------------------------------------------------------

def estimate_memory(cfg: Config, budget: Budget) -> MemoryFit:
    """The cost model's per-rank memory of the recipe's layout (its worst pipeline stage)."""
    cost = CostModel(from_config(cfg.model, cfg.train.seq_len, cfg.train.global_batch), _cluster(budget),
                     cfg.train.precision, bucket_mb=cfg.parallel.bucket_mb, fused_loss=cfg.train.fused_loss)
    if cfg.parallel.dp_arch == "ps":
        return _ps_memory(cfg, cost, budget)
    return MemoryFit(cost.estimate(config_layout(cfg)).memory, budget)


def _cluster(budget: Budget) -> Cluster:
    """A one-node cluster with the budget's memory terms. Only the memory is read: the speeds are
    placeholders (the estimate prices time too, and must not divide by zero)."""
    link = Link(1e10, 1e-5)
    return Cluster("fit", 1, 1, {"fp32": 1e12, "bf16": 1e12}, budget.per_rank, link, link, mem_bandwidth=1e10,
                   baseline_memory=budget.baseline, collective_workspace=budget.workspace)


def _ps_memory(cfg: Config, cost: CostModel, budget: Budget) -> MemoryFit:
    """A parameter server's busiest rank (tessel.parallel.ps.parameter_server; every rank builds the whole model).

    A worker: the model, its gradients, its activations, and the flat gradient
    it pushes and flat weights it is answered with; no optimizer. A server: the
    model, its shard, a received gradient per worker plus their sum and mean,
    AdamW state for the shard, and the flat copy of the model it cut the shard from.
    """
    p = cfg.parallel
    model = 4 * param_count(cost.spec)  # fp32 bytes of the whole model
    shard = model / p.ps_servers
    worker = dict(cost.estimate(replace(config_layout(cfg), dp=1)).memory, optimizer=0.0, buffers=2 * model)
    server = {"params": model + shard, "grads": (p.dp + 2) * shard, "optimizer": 2 * shard, "buffers": model,
              "baseline": budget.baseline}
    for mem in (worker, server):
        mem["total"] = sum(v for k, v in mem.items() if k != "total")
    role, mem = max((("worker", worker), ("server", server)), key=lambda rm: rm[1]["total"])
    return MemoryFit(mem, budget, role=role)


def state_floor(cfg: Config, budget: Budget) -> dict[str, float]:
    """Parameters, gradients and AdamW state spread evenly over every rank, plus the runtime.

    A lower bound of the cost model's busiest rank, in closed form: the check
    stays instant for a model.n_layer the cost model would walk for seconds.
    Parameter-server ranks all hold the whole model, and workers its gradients.
    """
    n = param_count(from_config(cfg.model, cfg.train.seq_len, cfg.train.global_batch))
    if cfg.parallel.dp_arch == "ps":
        mem = {"params": 4.0 * n, "grads": 4.0 * n}
    else:
        world = cfg.parallel.pp * cfg.parallel.dp * cfg.parallel.ep * cfg.parallel.tp
        mem = {"params": 4 * n / world, "grads": 4 * n / world, "optimizer": 8 * n / world}
    mem["baseline"] = budget.baseline
    mem["total"] = sum(mem.values())
    return mem


def param_count(spec: ModelSpec) -> int:
    """spec.total_params in closed form: dense blocks and MoE blocks each repeat one shape (the reference GPT's;
    a Hugging Face model's blocks, read from its config, are summed)."""
    c = spec.cfg
    if c.hf_config is not None:
        return spec.total_params
    n_moe = c.n_layer // c.moe_every if c.n_experts else 0  # ModelSpec.is_moe: every moe_every-th block
    moe = sum(spec.layer_params(c.moe_every - 1)) if n_moe else 0
    dense = sum(spec.layer_params(0)) if c.n_layer > n_moe else 0  # block 0 is dense unless every block is MoE
    return n_moe * moe + (c.n_layer - n_moe) * dense + spec.embedding_params + spec.head_params
