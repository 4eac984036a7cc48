"""A stage's backward in two parts: B, the gradient of its input (sent upstream at once), and W, the
gradients of its weights (deferred), as zero-bubble pipelines need (Qi et al. 2023, "Zero Bubble
Pipeline Parallelism", sec. 2).

B finds, in the autograd graph of one micro-batch's stage output, the nodes
that lie on a path to the stage's input and also feed a weight (a matmul's
node feeds both x and W; split_plan.py, once per shape of graph). While
autograd computes the input's gradient alone (`torch.autograd.grad(...,
inputs=stage input)`, which runs no weight branch), the same call captures the
gradient flowing into each of those nodes: they are named among its inputs
too, as edges (a captured node still runs for the input's path), so B needs
no hooks. W runs each such node again for its weight edges only (its gradient
into the weight branch, e.g. a matmul's dW; autograd.grad stops at those
edges), the nodes of one depth of the graph in one call (a node only reaches
nodes of smaller depth, so none of them reaches another), then every weight
branch from there in one backward. torch.distributed.pipelining splits a
stage's backward along the same nodes (its `_backward.py`); this is written
for tessel's executor, and W never walks back into the input's path, so no
activation gradient is computed twice: any module's graph (the reference GPT's
blocks, a Hugging Face decoder layer, MoE aux losses, selective recompute)
splits without a change to the model. (A fully recomputed block would be
rebuilt by each of W's calls: tessel.config refuses that pairing.) Parameters
of one dimension (norms' scales, biases) are the exception: B computes their
gradients in its call (split_plan.py says why) and W only accumulates them.

W's last backward starts from the weight branches and accumulates into
`.grad` through autograd, so every post-accumulate hook fires inside one
engine run, as a whole backward's would (data parallelism's bucketed
all-reduce, tessel.parallel.data).

Memory between B and W: the graph is kept (B runs with retain_graph), so
everything the forward saved stays alive until W; the gradients B captured
are held on top (`WeightWork.nbytes`). The runner counts both
as held for backward until W (tessel.parallel.pipeline.saved).

The first stage has no input gradient to send (its input is token ids); the
runner hands B the hidden states entering its first block instead, so B runs
the blocks' input path there too and W the weight branches and the embedding.
Without such a tensor W runs the whole backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node

from tessel.parallel.pipeline.split_plan import SplitPlan, plan_of, walk


def grad_node(t: torch.Tensor) -> Node | None:
    """The node autograd sends t's gradient to: its grad_fn, or a leaf's gradient accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]  # a view's only edge points at the leaf's accumulator


Edge = tuple[Node, int]  # (node, which of its inputs): where a gradient flows in


@dataclass
class WeightGroup:
    """Cut nodes (on the input's path, feeding a weight) whose weight edges lead into shared nodes (usually
    one node), and the gradients B captured flowing into them."""
    nodes: list[Node]
    edges: list[Edge]  # their edges into the weight branches, each once
    grads: dict[Node, tuple] = field(default_factory=dict)  # node -> the gradients flowing into it
    chained: bool = False  # one node may reach another: the captured gradient must replace the arrival

    def branch_grads(self) -> tuple:
        """The gradient flowing along each of `edges`: the nodes run again, for their weight edges only."""
        roots, seeds = [], []
        for node in self.nodes:
            for i, g in enumerate(self.grads.get(node, ())):
                if g is not None:
                    roots.append(GradientEdge(node, i))
                    seeds.append(g)
        if not roots:
            return (None,) * len(self.edges)
        # one node on the path to another of the group would send it a second gradient; the captured one
        # is the whole gradient, so it replaces whatever arrives
        hooks = [n.register_prehook(lambda _, n=n: self.grads[n]) for n in self.nodes if n in self.grads] \
            if self.chained else []
        try:
            return torch.autograd.grad(roots, [GradientEdge(*e) for e in self.edges], seeds, allow_unused=True,
                                       retain_graph=True)
        finally:
            for h in hooks:
                h.remove()


@dataclass
class WeightWork:
    """What a B leaves for its W: the cut nodes and their captured gradients, and the gradients B computed
    for parameters of one dimension; or (a stage without an input gradient) the output and its gradient
    for a whole backward."""
    groups: list[WeightGroup] = field(default_factory=list)
    ready: list[tuple[Edge, torch.Tensor]] = field(default_factory=list)  # edge into a vector's accumulator
    whole: tuple[torch.Tensor, torch.Tensor | None] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of captured gradients held until W (the saved activations are counted apart)."""
        captured = [g for group in self.groups for grads in group.grads.values() for g in grads]
        return sum(g.untyped_storage().nbytes() for g in captured + [g for _, g in self.ready] if g is not None)

    def run(self) -> None:
        """Accumulate this micro-batch's weight gradients into `.grad` (hooks fire as in a backward)."""
        if self.whole is not None:
            out, grad = self.whole
            self.whole = None
            torch.autograd.backward(out, grad)
            return
        edges = [GradientEdge(*edge) for edge, _ in self.ready]
        grads = [g for _, g in self.ready]
        for group in self.groups:
            for edge, g in zip(group.edges, group.branch_grads()):
                if g is not None:
                    edges.append(GradientEdge(*edge))
                    grads.append(g)
        self.groups, self.ready = [], []  # the graph goes with them
        if edges:
            torch.autograd.backward(edges, grads)  # the weight branches alone: they reach no activation


def backward_input(out: torch.Tensor, grad: torch.Tensor | None,
                   inp: torch.Tensor | None) -> tuple[torch.Tensor | None, WeightWork]:
    """B: d(out)/d(inp) seeded with grad (None: out is a scalar loss), and the WeightWork W will run.

    No weight's `.grad` changes here: the weight branches, found in the graph (split_plan.py), wait for W."""
    in_node = grad_node(inp) if inp is not None else None
    graph = walk(out.grad_fn) if out.grad_fn is not None and in_node is not None else None
    plan = plan_of(graph.shape, graph.position.get(in_node), out.output_nr) if graph is not None else None
    if plan is None:  # nothing upstream needs a gradient
        return None, WeightWork(whole=(out, grad))
    nodes = graph.nodes
    # the gradient flowing into each cut node is captured by the same call, as one of its inputs: autograd
    # hands it over as it runs the node for the input's path (no hooks)
    captured = [GradientEdge(nodes[n], i) for n, fed in plan.inputs for i in range(fed)]
    # and the edges into parameters of one dimension are computed here, by the nodes that run anyway
    vectors = [GradientEdge(nodes[c], i) for c, i in plan.vectors]
    dx, *grads = torch.autograd.grad(out, [inp] + captured + vectors, grad, retain_graph=True,  # W needs it
                                     allow_unused=True)  # an input of a node no gradient reached
    if dx is None:
        raise RuntimeError("the stage's input got no gradient although its output depends on it")
    return dx, _weight_work(plan, nodes, grads)


def _weight_work(plan: SplitPlan, nodes: list[Node], grads: list[torch.Tensor | None]) -> WeightWork:
    """The plan's groups on this graph's nodes, each with the gradients B captured for it (`grads` in the
    order B asked for them: each cut node's inputs, then the vectors' edges)."""
    flowing, at = {}, 0
    for n, fed in plan.inputs:
        flowing[nodes[n]] = tuple(grads[at:at + fed])
        at += fed
    groups = [WeightGroup([nodes[n] for n in g.nodes], [(nodes[c], i) for c, i in g.edges],
                          {nodes[n]: flowing[nodes[n]] for n in g.nodes}, g.chained) for g in plan.groups]
    ready = [((nodes[c], i), g) for (c, i), g in zip(plan.vectors, grads[at:]) if g is not None]
    return WeightWork(groups=groups, ready=ready)
