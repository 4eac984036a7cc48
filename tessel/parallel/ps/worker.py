"""A parameter server's worker as a Runner: the trainer's loop drives it like any layout.

One step is a LocalRunner's forward and backward on the worker's shard of the
batch (grad_accum chunks, precision), then a push of the gradients to the
servers and a pull of the weights they answer with
(tessel.parallel.ps.parameter_server): the update happens on the servers, so
the worker brings no optimizer. Under BSP the answer is the averaged update
of every worker's step; under ASP and SSP the servers apply each push on
arrival and answer as the staleness bound allows.

Validation and sampling run on the lead worker's copy of the weights (worker
0, which reports) without any collective, so workers never wait for each
other outside the servers' barrier: the others answer at once with a loss
that is not a number and the prompt itself.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tessel.parallel.ps.parameter_server import ParameterServer
from tessel.parallel.runner import LocalRunner


class WorkerRunner:
    optimizer = None  # the servers apply the update (tessel.parallel.runner.Runner)
    after_update = ()  # nothing after it (no MoE bias balancing: tessel.config.rules.expert)

    def __init__(self, local: LocalRunner, ps: ParameterServer, lead: bool):
        self.local, self.ps, self.lead = local, ps, lead

    def parameters(self) -> list[nn.Parameter]:
        return self.local.parameters()

    def named_checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return self.local.named_checkpoint_tensors()

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This worker's gradients pushed; its weights now the servers' answer. The loss, detached."""
        self.ps.begin_step()  # the first pull; no gradients left from the last step
        loss = self.local.forward_backward(x, y)
        self.ps.push()
        return loss

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.lead:
            return torch.tensor(float("nan"))  # not measured here: worker 0 reports
        return self.local.evaluate(x, y)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new_tokens: int, seed: int) -> torch.Tensor:
        if not self.lead:
            return prompt  # not sampled here: worker 0 reports
        return self.local.generate(prompt, new_tokens, seed)

    def extra_metrics(self) -> dict[str, float]:
        """How far ahead of the slowest worker the servers let this one start its next step."""
        return {"staleness": self.ps.observed_staleness()}

    def write_timeline(self, out_dir: str) -> dict[str, str]:
        return {}

    def timed_modules(self) -> list[nn.Module]:
        return self.local.timed_modules()

    def finish(self) -> None:
        """Tell the servers this worker is done (they serve until every worker is done or dead)."""
        self.ps.finish()
