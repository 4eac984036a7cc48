"""A stage's backward in two parts: B, the gradient of its input (sent upstream at once), and W, the
gradients of its weights (deferred), as zero-bubble pipelines need (Qi et al. 2023, "Zero Bubble
Pipeline Parallelism", sec. 2).

B walks the autograd graph of one micro-batch's stage output once, finds the
nodes that lie on a path to the stage's input and also feed a weight (a
matmul's node feeds both x and W), and hooks them: while autograd computes the
input's gradient alone (`torch.autograd.grad(..., inputs=stage input)`, which
runs no weight branch), each hooked node hands over the gradient flowing into
it. W later runs only the weight branches, from those nodes and the gradients
they captured, one weight group at a time (weights whose branches share a
node), so no activation gradient is computed twice. torch.distributed.pipelining
splits a stage's backward the same way (its `_backward.py`); this is written
for tessel's executor: any module's graph (the reference GPT's blocks, a
Hugging Face decoder layer, checkpointed blocks, MoE aux losses) splits
without a change to the model.

W ends with one backward on the weights themselves, each seeded with its
gradient, so gradients accumulate into `.grad` through autograd and every
post-accumulate hook fires inside one engine run, as a whole backward's would
(data parallelism's bucketed all-reduce, tessel.parallel.data).

Memory between B and W: the graph is kept (B runs with retain_graph), so
everything the forward saved stays alive until W; the gradients the hooked
nodes captured are held on top (`WeightWork.nbytes`). The runner counts both
as held for backward until W (tessel.parallel.pipeline.saved).

A stage without an input gradient to send (the first: token ids) has no B
work: its W runs the whole backward.
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


@dataclass
class WeightGroup:
    """Weights whose gradient branches start at the same hooked nodes, and what those nodes captured."""
    params: list[torch.Tensor]
    nodes: list[Node]
    grads: dict[Node, tuple] = field(default_factory=dict)  # node -> the gradients flowing into it

    def weight_grads(self) -> tuple:
        edges, seeds = [], []
        for node in self.nodes:
            for i, g in enumerate(self.grads.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    seeds.append(g)
        if not edges:
            return (None,) * len(self.params)
        # a node on the path to another of the group's nodes would send it a second gradient;
        # the captured one is the whole gradient, so it replaces whatever arrives
        hooks = [n.register_prehook(lambda _, n=n: self.grads[n]) for n in self.nodes if n in self.grads] \
            if len(self.nodes) > 1 else []
        try:
            return torch.autograd.grad(edges, self.params, seeds, allow_unused=True)
        finally:
            for h in hooks:
                h.remove()


@dataclass
class WeightWork:
    """What a B leaves for its W: the weight groups and their captured gradients, or (a stage without
    an input gradient) the output and its gradient for a whole backward."""
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
            torch.autograd.backward(out, grad)
            return
        params, grads = [], []
        for group in self.groups:
            for p, g in zip(group.params, group.weight_grads()):
                if g is not None:
                    params.append(p)
                    grads.append(g)
        self.groups = []  # the graph goes with them
        if params:
            torch.autograd.backward(params, grads)  # a leaf seeded with g: .grad += g, then its hooks


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor | None,
                   params: list[torch.Tensor]) -> tuple[torch.Tensor | None, WeightWork]:
    """B: d(out)/d(inp) seeded with grad (None: out is a scalar loss), and the WeightWork W will run.

    No weight's `.grad` changes here."""
    in_node = grad_node(inp) if inp is not None else None
    root = out.grad_fn
    parents = _parents(root)
    if in_node is None or in_node not in parents:  # nothing upstream needs a gradient
        return None, WeightWork(whole=(out, grad))
    on_input_path = _ancestors(in_node, parents)
    groups = _weight_groups(params, parents, on_input_path)
    hooks = [node.register_prehook(_capture(group, node)) for group in groups for node in group.nodes]
    try:
        (dx,) = torch.autograd.grad(out, inp, grad, retain_graph=True)  # W needs the graph
    finally:
        for h in hooks:
            h.remove()
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
    """node and every node whose gradient reaches it."""
    seen, todo = {node}, [node]
    while todo:
        for up in parents[todo.pop()]:
            if up not in seen:
                seen.add(up)
                todo.append(up)
    return seen


def _weight_groups(params: list[torch.Tensor], parents: dict[Node, list[Node]],
                   on_input_path: set[Node]) -> list[WeightGroup]:
    """Weights grouped by the input-path nodes their branches hang from (a union of overlapping sets)."""
    group_of: dict[Node, WeightGroup] = {}
    for p in params:
        node = grad_node(p)
        if node is None or node not in parents:
            continue  # not used by this micro-batch
        hangs_from = _branch_roots(node, parents, on_input_path)
        group = WeightGroup([p], list(hangs_from))
        for other in {id(group_of[n]): group_of[n] for n in hangs_from if n in group_of}.values():
            group.params += other.params
            group.nodes += [n for n in other.nodes if n not in hangs_from]
        for n in group.nodes:
            group_of[n] = group
    return list({id(g): g for g in group_of.values()}.values())


def _branch_roots(node: Node, parents: dict[Node, list[Node]], on_input_path: set[Node]) -> set[Node]:
    """The input-path nodes the weight branch above `node` starts at."""
    roots, seen, todo = set(), {node}, [node]
    while todo:
        for up in parents[todo.pop()]:
            if up in on_input_path:
                roots.add(up)
            elif up not in seen:
                seen.add(up)
                todo.append(up)
    return roots
