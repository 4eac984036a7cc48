"""Which modules of a tensor-parallel region run before its split: read from the region's forward source.

Under tensor parallelism a region (an attention whose projections the plan splits by heads) is entered once
(Megatron's f, or the sequence all-gather): every rank holds its whole input, and each column-parallel layer
turns it into this rank's heads. A module with weights that the plan does not name is right computed whole on
every rank exactly when it runs before any split: on the region's own inputs, or on what such modules made of
them (multi-head latent attention's low-rank down projections, q_a_proj and kv_a_proj_with_mqa, and their
norms). Each rank's heads send back their own share of its output's gradient, so its weights' gradients are
summed over tp (as transformers' replicated_with_grad_allreduce). After a split it would see this rank's heads
only, and a weight spanning every head would be wrong there: that one is refused.

The region's forward is read with ast, flow-insensitively: a value is split when it is computed from a call of
a submodule the plan splits, of any method of the region (a helper whose body is not read), or from a split
value (a tensor a split value is copied into, too); the forward's own arguments (hidden states, position
embeddings, mask, cache) are whole on every rank. A module is before the split when every call of it in forward
takes whole values only, and the region returns nothing computed from such modules alone (a gate on the
whole input multiplying the output: every rank would hold its whole gradient, which summing would count tp
times); one forward never calls itself (a helper method does) is not proven so.

Duck-typed like tessel.hf.layout (no torch, no tessel.models): it reads classes and their source only.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap


def before_split(region, split: frozenset[str], rows: frozenset[str]) -> frozenset[str]:
    """The names of the region's child modules that its forward calls on whole values only (every call), where
    `split` names the children the plan splits by columns and `rows` those it splits by rows (whose outputs are
    whole again, all-reduced)."""
    children = frozenset(name for name, _ in region.named_children())
    return _before_split(type(region), children, split, rows)


@functools.cache
def _before_split(cls: type, children: frozenset[str], split: frozenset[str],
                  rows: frozenset[str]) -> frozenset[str]:
    forward = _forward_tree(cls)
    if forward is None or not split & children:
        return frozenset()  # nothing read, or nothing this region's forward splits
    reader = _Reader(children, split, rows)
    reader.block(forward.body, definite=True)
    if reader.escapes:
        return frozenset()  # a whole module's output leaves the region whole: its gradient is not split
    return frozenset(name for name, whole in reader.calls.items() if all(whole))


class _Reader:
    """Walks forward's statements in order, keeping three sets of local names: "maybe" (may hold a split value:
    a split layer's output, or an unread method's), "sure" (computed from a split layer's output, so each rank's
    heads hold their share of its gradient) and "derived" (computed from a whole-run child's output). At each
    call of a child module that may run whole it records whether its arguments are whole there; at each return,
    whether a value derived from such a child leaves the region without meeting a split one (`escapes`: every
    rank would then hold its whole gradient, and summing over tp would count it tp times)."""

    def __init__(self, children: frozenset[str], split: frozenset[str], rows: frozenset[str]):
        self.split, self.rows, self.whole_calls = split, rows, children - split - rows
        self.sets: dict[str, set[str]] = {"maybe": set(), "sure": set(), "derived": set()}
        self.calls: dict[str, list[bool]] = {}
        self.escapes = False

    def block(self, statements: list[ast.stmt], definite: bool) -> None:
        """definite: the statements surely run, in order (a write replaces what a name held); inside a branch or a
        loop a write only adds (the name may hold either)."""
        for _ in range(1 if definite else 2):  # a loop's second pass sees what its first wrote
            for statement in statements:
                self.statement(statement, definite)

    def statement(self, node: ast.stmt, definite: bool) -> None:
        own = _own_expressions(node)
        for expr in own:
            self.record_calls(expr)
        if isinstance(node, ast.Return) and node.value is not None:
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            self.escapes |= any(self.has("derived", v) and not self.has("sure", v) for v in values)
        for target, value in (w for expr in [node, *own] for w in _writes(expr)):
            for kind, names in self.sets.items():
                if self.has(kind, value):
                    names |= _names(target)
                elif definite and not isinstance(node, ast.AugAssign):
                    names -= _names(target)
        for field in ("body", "orelse", "finalbody"):
            if getattr(node, field, None):
                self.block(getattr(node, field), definite=False)
        for handler in getattr(node, "handlers", []):
            self.block(handler.body, definite=False)

    def record_calls(self, expr: ast.AST) -> None:
        for node in ast.walk(expr):
            if _self_call(node) in self.whole_calls:
                self.calls.setdefault(_self_call(node), []).append(not any(self.has("maybe", a) for a in _args(node)))

    def has(self, kind: str, expr: ast.AST) -> bool:
        """Whether the expression's value is of the kind ("maybe", "sure" or "derived")."""
        if isinstance(expr, ast.Name):
            return expr.id in self.sets[kind]
        name = _self_call(expr)
        if name in self.whole_calls:
            return kind == "derived" or any(self.has(kind, a) for a in _args(expr))
        if name in self.split:  # a column-parallel layer: this rank's heads
            return kind != "derived"
        if name in self.rows:  # a row-parallel layer: its output all-reduced, whole and fresh
            return False
        if name is not None:  # a method of the region, not read: it may split, and passes on what it is given
            return kind == "maybe" or any(self.has(kind, a) for a in _args(expr))
        return any(self.has(kind, child) for child in ast.iter_child_nodes(expr))


def _args(call: ast.Call) -> list[ast.AST]:
    return [*call.args, *(kw.value for kw in call.keywords)]


def _own_expressions(node: ast.stmt) -> list[ast.AST]:
    """The expressions of a statement outside its nested bodies (an if's test, an assignment's value, ...)."""
    out = []
    for field, value in ast.iter_fields(node):
        if field not in ("body", "orelse", "finalbody", "handlers"):
            out += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, ast.AST)]
    return out


def _writes(node: ast.AST) -> list[tuple[ast.AST, ast.AST]]:
    """(target, value) pairs a statement or call writes: assignments, and torch's in-place methods (x.copy_(y)
    makes x split where y is; their names end in an underscore)."""
    if isinstance(node, ast.Assign):
        return [(t, node.value) for t in node.targets]
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
        return [(node.target, node.value)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.endswith("_") \
            and isinstance(node.func.value, ast.Name):
        return [(node.func.value, arg) for arg in (*node.args, *(kw.value for kw in node.keywords))]
    return []


def _self_call(node: ast.AST) -> str | None:
    """X for a call self.X(...), else None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
        return node.func.attr
    return None


def _names(target: ast.AST) -> set[str]:
    """The local names an assignment target binds (a tuple's, x of x[...] = and of x.attr =)."""
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name) and n.id != "self"}


def _forward_tree(cls: type) -> ast.FunctionDef | None:
    """The class's forward (its own or inherited) as an ast function, or None where its source is not readable."""
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
    except (AttributeError, OSError, TypeError):
        return None
    tree = ast.parse(source).body[0]
    return tree if isinstance(tree, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
