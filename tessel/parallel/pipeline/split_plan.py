"""Where B cuts one micro-batch's autograd graph (split_backward.py), found once per shape of graph.

B cuts at the nodes that lie on the input's path and also feed a weight (a matmul's node feeds both x
and W), grouped where they lead into one weight branch and batched by depth for W's calls. The gradient
of a parameter of one dimension (a norm's scale, a bias) is not deferred: where input-path nodes alone
feed such a parameter's accumulator, B computes those edges in its own call. That gradient is a
reduction over the tokens, as cheap as an activation gradient, while in W it would cost an autograd call
of its own (a norm's node sits at a depth of its own: two of a GPT block's six); it is held, a vector,
until W accumulates it with the rest.

Finding all this takes several passes over the graph in Python. Every micro-batch of a chunk builds a
graph of the same shape, and the answer depends on that shape alone, so it is found once per shape,
written in positions of a breadth-first walk from the root, and read back on the next graph after the
walk alone. The walk records every node's kind (its class: one per backward formula, MmBackward0,
AccumulateGrad, a custom Function's; an accumulator's with its parameter's number of dimensions) and
edges (the positions they lead to and which input of that node they feed). Two graphs with equal
records have the same nodes in the same places, so a plan found on one is exact on the other; a graph
whose record differs (another stage, a model changed between steps, an MoE layer that skips an expert no
token chose) misses and is analysed afresh, and its plan is kept beside the others.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.autograd.graph import Node

Edges = tuple[tuple[int, int], ...]  # a node's edges: (position of the node it leads to, or -1; its input)
Shape = tuple[tuple[type | tuple[type, int], Edges], ...]  # every node in walk order: its kind, its edges

PLANS_KEPT = 32  # shapes remembered: a few per chunk (its stages, an MoE routing that skips an expert)


def _accumulator_class() -> type:
    leaf = torch.empty(0, requires_grad=True)
    return type(leaf.view_as(leaf).grad_fn.next_functions[0][0])  # a view's only edge: the leaf's accumulator


ACCUMULATOR = _accumulator_class()  # AccumulateGrad: where a parameter's gradient is added to its .grad


@dataclass
class GraphWalk:
    """A graph's nodes breadth-first from its root, each once, and the record of its shape."""
    nodes: list[Node]
    position: dict[Node, int]
    shape: Shape


def walk(root: Node) -> GraphWalk:
    """Every node below root, breadth-first in the order of each node's edges, and the record of its shape."""
    position = {root: 0}
    nodes = [root]
    shape = []
    for node in nodes:  # the list grows while it is walked: breadth-first, the same order for equal graphs
        edges = []
        for child, nr in node.next_functions:
            if child is None:  # an input that needs no gradient
                edges.append((-1, nr))
                continue
            pos = position.get(child)
            if pos is None:
                pos = position[child] = len(nodes)
                nodes.append(child)
            edges.append((pos, nr))
        # the class, not name(): name() demangles a C++ type name on every call (a sixth of the walk)
        kind = type(node)
        if kind is ACCUMULATOR:  # whether B computes its gradient (a parameter of one dimension)
            kind = (kind, node.variable.dim())
        shape.append((kind, tuple(edges)))
    return GraphWalk(nodes, position, tuple(shape))


@dataclass(frozen=True)
class GroupPlan:
    """Cut nodes whose weight edges lead into shared nodes (usually one node), in positions."""
    nodes: tuple[int, ...]
    edges: Edges  # their edges into the weight branches, each once
    chained: bool  # one node may reach another (nodes of several depths)


@dataclass(frozen=True)
class SplitPlan:
    """Where B cuts graphs of one shape: the groups W runs, the gradients B captures for them, and the
    edges into parameters of one dimension B computes itself."""
    groups: tuple[GroupPlan, ...]
    inputs: tuple[tuple[int, int], ...]  # each cut node's position, how many of its inputs take a gradient
    vectors: Edges  # input-path edges straight into the accumulator of a parameter of one dimension


@functools.lru_cache(maxsize=PLANS_KEPT)
def plan_of(shape: Shape, in_pos: int | None, root_input: int) -> SplitPlan | None:
    """The cut of a graph of this shape whose input's node sits at in_pos (None: not in the graph, so
    nothing upstream needs a gradient and there is no cut); root_input: which input of the root the
    seed gradient enters. A pure function of its arguments, hence kept per shape."""
    if in_pos is None:
        return None
    children = [edges for _, edges in shape]
    parents = _parents(children)
    on_input_path = _ancestors(in_pos, parents)
    vectors = _vectors(shape, on_input_path, parents)
    groups = _weight_groups(on_input_path, children, vectors)
    groups = _batched(groups, _depths(in_pos, on_input_path, parents, children))
    fed = _inputs_fed(children, root_input)
    cut = sorted({n for g in groups for n in g.nodes})
    into_vectors = dict.fromkeys((c, i) for n in sorted(on_input_path) for c, i in children[n] if c in vectors)
    return SplitPlan(tuple(GroupPlan(tuple(g.nodes), tuple(g.edges), g.chained) for g in groups),
                     tuple((n, fed[n]) for n in cut), tuple(into_vectors))


def _vectors(shape: Shape, on_input_path: set[int], parents: list[list[int]]) -> set[int]:
    """The nodes B computes the gradient flowing into (W only runs them): accumulators of parameters of one
    dimension whose every gradient comes straight from an input-path node, and every weight-branch node fed
    by compiled nodes alone. Only nodes B runs anyway feed either. One also reached through a weight branch
    stays W's: capturing it would pull that branch into B, and W would run the branch again (its gradient
    counted twice).

    A compiled region (train.compile, tessel.parallel.compile) is one node whose backward computes its input
    and weight gradients together: run again in W for its weight edges alone it would compute the whole
    region's backward a second time. So B keeps what its one run computes, and the region's weights get
    no deferred W of their own (what that costs a zero-bubble schedule: tessel.parallel.compile)."""
    def fed_by_b(c: int) -> bool:
        return c not in on_input_path and bool(parents[c]) and set(parents[c]) <= on_input_path

    return {c for c, (kind, _) in enumerate(shape)
            if fed_by_b(c) and (kind == (ACCUMULATOR, 1) or all(is_compiled(shape[p][0]) for p in parents[c]))}


def is_compiled(kind: type | tuple) -> bool:
    """A node of a compiled region's backward (AOTAutograd's CompiledFunction): it computes every gradient
    of the region in one call."""
    return isinstance(kind, type) and kind.__name__ == "CompiledFunctionBackward"


def _parents(children: list[Edges]) -> list[list[int]]:
    """Each node -> the nodes that send it gradients (the root: none)."""
    parents: list[list[int]] = [[] for _ in children]
    for node, edges in enumerate(children):
        for child, _ in edges:
            if child >= 0:
                parents[child].append(node)
    return parents


def _inputs_fed(children: list[Edges], root_input: int) -> list[int]:
    """How many of each node's inputs (its forward's outputs) can receive a gradient: one past the highest
    input any edge feeds (the root's: the seed's)."""
    fed = [0] * len(children)
    fed[0] = root_input + 1
    for edges in children:
        for child, nr in edges:
            if child >= 0:
                fed[child] = max(fed[child], nr + 1)
    return fed


def _ancestors(node: int, parents: list[list[int]]) -> set[int]:
    """node and every node whose gradient reaches it: the input's path."""
    seen, todo = {node}, [node]
    while todo:
        for up in parents[todo.pop()]:
            if up not in seen:
                seen.add(up)
                todo.append(up)
    return seen


def _depths(in_pos: int, on_input_path: set[int], parents: list[list[int]], children: list[Edges]) -> dict[int, int]:
    """The longest path from each input-path node down to the input: a node reaches only nodes of smaller
    depth, so nodes of one depth never reach each other."""
    below = {n: len({c for c, _ in children[n] if c in on_input_path}) for n in on_input_path}
    depth = {n: 0 for n in on_input_path if below[n] == 0}
    ready = list(depth)
    while ready:
        node = ready.pop()
        for up in set(parents[node]):
            below[up] -= 1
            if below[up] == 0:
                depth[up] = 1 + max(depth[c] for c, _ in children[up] if c in on_input_path)
                ready.append(up)
    return depth


@dataclass
class _Group:
    nodes: list[int]
    edges: list[tuple[int, int]]
    chained: bool = False


def _batched(groups: list[_Group], depth: dict[int, int]) -> list[_Group]:
    """Groups whose nodes share one depth run in one autograd call per depth (W's calls: one a level, not
    one a weight): none of their nodes reaches another, so no activation gradient runs twice."""
    by_depth: dict[int, _Group] = {}
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


def _weight_groups(on_input_path: set[int], children: list[Edges], vectors: set[int]) -> list[_Group]:
    """The input path's nodes with edges leaving it (into weight branches), but not straight into a
    vector's accumulator (B's), grouped where two of them lead into the same node (a weight used twice:
    its branch must see both gradients at once). Walk order, so equal shapes give equal plans."""
    group_of: dict[int, _Group] = {}  # a weight branch's first node -> its group
    groups: list[_Group] = []
    for node in sorted(on_input_path):
        edges = [(c, i) for c, i in children[node] if c >= 0 and c not in on_input_path and c not in vectors]
        if not edges:
            continue
        group = _Group([node], list(dict.fromkeys(edges)))
        for other in {id(group_of[c]): group_of[c] for c, _ in edges if c in group_of}.values():
            group.nodes += other.nodes
            group.edges = list(dict.fromkeys(group.edges + other.edges))
            groups.remove(other)
        for c, _ in group.edges:
            group_of[c] = group
        groups.append(group)
    return groups
