"""A stage's backward in two parts: B, the gradient of its input (sent upstream at once), and W, the
gradients of its weights (deferred), as zero-bubble pipelines need (Qi et al. 2023, "Zero Bubble
Pipeline Parallelism", sec. 2).

B walks the autograd graph of one micro-batch's stage output once and finds
the nodes that lie on a path to the stage's input and also feed a weight (a
matmul's node feeds both x and W), and hooks them: while autograd computes the
input's gradient alone (`torch.autograd.grad(..., inputs=stage input)`, which
runs no weight branch), each hooked node hands over the gradient flowing into
it. W runs each hooked node again for its weight edges only (its gradient
into the weight branch, e.g. a matmul's dW; autograd.grad stops at those
edges), the nodes of one depth of the graph in one call (a node only reaches
nodes of smaller depth, so none of them reaches another), then every weight
branch from there in one backward. torch.distributed.pipelining splits a
stage's backward along the same nodes (its `_backward.py`); this is written
for tessel's executor, and W never walks back into the input's path, so no
activation gradient is computed twice: any module's graph (the reference GPT's
blocks, a Hugging Face decoder layer, MoE aux losses, selective recompute)
splits without a change to the model. (A fully recomputed block would be
rebuilt by each of W's calls: tessel.config refuses that pairing.)

W's last backward starts from the weight branches and accumulates into
`.grad` through autograd, so every post-accumulate hook fires inside one
engine run, as a whole backward's would (data parallelism's bucketed
all-reduce, tessel.parallel.data).

Memory between B and W: the graph is kept (B runs with retain_graph), so
everything the forward saved stays alive until W; the gradients the hooked
nodes captured are held on top (`WeightWork.nbytes`). The runner counts both
as held for backward until W (tessel.parallel.pipeline.saved).

The first stage has no input gradient to send (its input is token ids); the
runner hands B the hidden states entering its first block instead, so B runs
the blocks' input path there too and W the weight branches and the embedding.
Without such a tensor W runs the whole backward.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node


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
    """Hooked nodes whose weight edges lead into shared nodes (usually one node), and what they captured."""
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
    """What a B leaves for its W: the hooked nodes and their captured gradients, or (a stage without an
    input gradient) the output and its gradient for a whole backward."""
    groups: list[WeightGroup] = field(default_factory=list)
    whole: tuple[torch.Tensor, torch.Tensor | None] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of captured gradients held until W (the saved activations are counted apart)."""
        return sum(g.untyped_storage().nbytes() for group in self.groups for grads in group.grads.values()
                   for g in grads if g is not None)

    def run(self) -> None:
        """Accumulate this micro-batch's weight gradients into `.grad` (hooks fire as in a backward)."""
        if self.whole is not None:
            out, grad = self.whole
            self.whole = None
            torch.autograd.backward(out, grad)
            return
        edges, grads = [], []
        for group in self.groups:
            for edge, g in zip(group.edges, group.branch_grads()):
                if g is not None:
                    edges.append(GradientEdge(*edge))
                    grads.append(g)
        self.groups = []  # the graph goes with them
        if edges:
            torch.autograd.backward(edges, grads)  # the weight branches alone: they reach no activation


def backward_input(out: torch.Tensor, grad: torch.Tensor | None,
                   inp: torch.Tensor | None) -> tuple[torch.Tensor | None, WeightWork]:
    """B: d(out)/d(inp) seeded with grad (None: out is a scalar loss), and the WeightWork W will run.

    No weight's `.grad` changes here: the weight branches, found in the graph, wait for W."""
    in_node = grad_node(inp) if inp is not None else None
    root = out.grad_fn
    parents = _parents(root)
    if in_node is None or in_node not in parents:  # nothing upstream needs a gradient
        return None, WeightWork(whole=(out, grad))
    on_input_path = _ancestors(in_node, parents)
    groups = _batched(_weight_groups(on_input_path), _depths(in_node, on_input_path, parents))
    hooks = [node.register_prehook(_capture(group, node)) for group in groups for node in group.nodes]
    try:
        (dx,) = torch.autograd.grad(out, inp, grad, retain_graph=True)  # W needs the graph
    finally:
        for h in hooks:
            h.remove()
    if inp.grad_fn is not None:  # a computed input (the first stage's embedding): its node runs in W
        for group in groups:
            if in_node in group.nodes:
                group.grads[in_node] = (None,) * inp.output_nr + (dx,)
    return dx, WeightWork(groups=groups)


def _capture(group: WeightGroup, node: Node):
    def hook(grad_outputs: tuple) -> None:
        group.grads[node] = grad_outputs
    return hook


def _parents(root: Node) -> dict[Node, list[Node]]:
    """Every node of the graph below root -> the nodes that send it gradients (root maps to [])."""
    parents: dict[Node, list[Node]] = collections.defaultdict(list)
    parents[root] = []
    todo = [root]
    while todo:
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                todo.append(child)
            parents[child].append(node)
    return parents


def _ancestors(node: Node, parents: dict[Node, list[Node]]) -> set[Node]:
    """node and every node whose gradient reaches it: the input's path."""
    seen, todo = {node}, [node]
    while todo:
        for up in parents[todo.pop()]:
            if up not in seen:
                seen.add(up)
                todo.append(up)
    return seen


def _depths(in_node: Node, on_input_path: set[Node], parents: dict[Node, list[Node]]) -> dict[Node, int]:
    """The longest path from each input-path node down to the input: a node reaches only nodes of smaller
    depth, so nodes of one depth never reach each other."""
    below = {n: len({c for c, _ in n.next_functions if c in on_input_path}) for n in on_input_path}
    depth = {n: 0 for n in on_input_path if below[n] == 0}
    ready = list(depth)
    while ready:
        node = ready.pop()
        for up in set(parents[node]):
            below[up] -= 1
            if below[up] == 0:
                depth[up] = 1 + max(depth[c] for c, _ in up.next_functions if c in on_input_path)
                ready.append(up)
    return depth


def _batched(groups: list[WeightGroup], depth: dict[Node, int]) -> list[WeightGroup]:
    """Groups whose nodes share one depth run in one autograd call per depth (W's calls: one a level, not
    one a weight): none of their nodes reaches another, so no activation gradient runs twice."""
    by_depth: dict[int, WeightGroup] = {}
    out = []
    for group in groups:
        levels = {depth[n] for n in group.nodes}
        if len(levels) > 1:
            group.chained = True
            out.append(group)
            continue
        level = levels.pop()
        if level in by_depth:
            by_depth[level].nodes += group.nodes
            by_depth[level].edges += group.edges
        else:
            by_depth[level] = group
            out.append(group)
    return out


def _weight_groups(on_input_path: set[Node]) -> list[WeightGroup]:
    """The input path's nodes with edges leaving it (into weight branches), grouped where two of them
    lead into the same node (a weight used twice: its branch must see both gradients at once)."""
    group_of: dict[Node, WeightGroup] = {}  # a weight branch's first node -> its group
    groups: list[WeightGroup] = []
    for node in on_input_path:
        edges = [(c, i) for c, i in node.next_functions if c is not None and c not in on_input_path]
        if not edges:
            continue
        group = WeightGroup([node], list(dict.fromkeys(edges)))
        for other in {id(group_of[c]): group_of[c] for c, _ in edges if c in group_of}.values():
            group.nodes += other.nodes
            group.edges = list(dict.fromkeys(group.edges + other.edges))
            groups.remove(other)
        for c, _ in group.edges:
            group_of[c] = group
        groups.append(group)
    return groups
