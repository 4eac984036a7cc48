"""What a Hugging Face causal LM's forward does to its head's output: read from the class's own source.

Under train.fused_loss (tessel.parallel.fused_loss) the head hands out its input, and the model's forward
goes on to do to it what it did to the logits; the loss then does the head's matmul. That is right when
what the forward does after `logits = self.lm_head(...)` is one of:

- nothing, or a change of dtype or layout (`.float()`, `.to(...)`, `.contiguous()`);
- a linear scaling by something that is not the logits (Granite's `logits / logits_scaling`, Cohere's
  `logits * logit_scale`, Falcon-H1's `lm_head(...) * lm_head_multiplier`): it commutes with the matmul,
  s * (h W^T) = (s h) W^T, so applied to the hidden states it gives the same logits and gradients;
- the final logit soft-capping under `if ...final_logit_softcapping...` (Gemma 2, 3, 4): the fused loss
  applies it to each chunk itself and switches the model's off (fused_loss.apply.take_softcap).

Anything else (a bias added to the logits, logits of some tokens masked, a loss of its own on them) is
refused, naming the statement. The class is the one AutoModelForCausalLM builds for the config.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

SOFTCAP_KEY = "final_logit_softcapping"


def hf_fused_loss_refusal(doc: dict) -> str | None:
    """Why the fused loss cannot take the head of the causal LM the config.json `doc` builds, or None."""
    # deferred: transformers loads torch; only a Hugging Face recipe with train.fused_loss pays for it
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    kind = doc["model_type"]
    if kind not in CONFIG_MAPPING or CONFIG_MAPPING[kind] not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return None  # transformers' own check names a type without a causal LM (tessel.hf.check)
    return head_refusal(MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[kind]])


@functools.cache
def head_refusal(model_class: type) -> str | None:
    """The first statement of model_class.forward after its head that the fused loss would miss, or None."""
    body = ast.parse(textwrap.dedent(inspect.getsource(model_class.forward))).body[0].body
    name, after = _after_head(body)
    if after is None:
        return (f"{model_class.__name__}.forward calls no `self.lm_head(...)` the fused loss can take the place of; "
                "set train.fused_loss = false")
    for statement in after:
        if not _harmless(statement, name):
            line = " ".join(ast.unparse(statement).split())[:120]
            return (f"{model_class.__name__}.forward changes its head's output by `{line}`, which the fused loss "
                    "does not apply (it applies a scaling and the final soft-cap); set train.fused_loss = false")
    return None


def _after_head(body: list[ast.stmt]) -> tuple[str, list[ast.stmt] | None]:
    """The name the head's output is bound to (`logits`, `lm_logits`) and the statements after the one that
    calls self.lm_head (that one itself where it does more than scale it); None where none calls it."""
    for index, statement in enumerate(body):
        if _calls_head(statement):
            if not _head_assignment_is_linear(statement):
                return "logits", [statement]
            return statement.targets[0].id, body[index + 1:]
    return "logits", None


def _calls_head(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "lm_head"
               for n in ast.walk(node))


def _head_assignment_is_linear(statement: ast.stmt) -> bool:
    """`logits = self.lm_head(h)`, `... .float()`, or `self.lm_head(h) * s` (Falcon-H1's multiplier)."""
    return isinstance(statement, ast.Assign) and len(statement.targets) == 1 \
        and isinstance(statement.targets[0], ast.Name) and _linear_in(statement.value, _is_head_call)


def _is_head_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "lm_head"


def _linear_in(node: ast.AST, is_base) -> bool:
    """Whether `node` is the base (logits, or the head's call) times/divided by things free of it, or cast."""
    if is_base(node):
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("float", "to", "contiguous") \
            and not node.args[1:]:
        return _linear_in(node.func.value, is_base)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
        left, right = _linear_in(node.left, is_base), _linear_in(node.right, is_base)
        free = not any(is_base(n) for n in ast.walk(node.right if left else node.left))
        return (left or (right and isinstance(node.op, ast.Mult))) and free
    return False


def _harmless(statement: ast.stmt, name: str) -> bool:
    """A statement after the head that leaves the fused loss right: it does not write the head's output (bound
    to `name`), scales it, or is the final soft-cap's `if`."""
    def is_logits(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id == name

    if isinstance(statement, ast.If) and SOFTCAP_KEY in ast.unparse(statement.test):
        return True  # the cap: taken over by the loss (fused_loss.apply.take_softcap)
    targets = [t for n in ast.walk(statement) if isinstance(n, (ast.Assign, ast.AugAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
    if not any(is_logits(t) or (isinstance(t, ast.Subscript) and is_logits(t.value)) for t in targets):
        return True
    return isinstance(statement, ast.Assign) and len(statement.targets) == 1 and is_logits(statement.targets[0]) \
        and _linear_in(statement.value, is_logits)
