"""What a pipeline step measured: its bubble, its saved-activation peak, and its timeline drawn.

The executor stamps every action on the step's clock (clock.py) and counts the
activations autograd saves (saved.py); this turns one step's records into the
metrics row (bubble, act_peak_mb) and the Chrome trace and Gantt chart of the
step. The bubble of GPipe (Huang et al. 2019) and 1F1B (Narayanan et al. 2019,
2021) is (p-1)/(m+p-1) on equal stages, of interleaved 1F1B (Narayanan et al.
2021) (p-1)/(v*m+p-1), of ZB-H1 and ZB-H2 (p-1)/(3m+p-1) and of ZBV
(p-1)/(6m+p-1) (Qi et al. 2023, B = W = F), of an asynchronous pipeline's
steady step 0; docs/pipelines.md compares the measured one with those. W counts
as compute, as F and B do.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from tessel.mesh import Mesh
from tessel.observe.timeline import chrome_trace, gantt_png
from tessel.parallel.pipeline.clock import StepClock
from tessel.parallel.pipeline.saved import SavedBytes
from tessel.parallel.pipeline.schedules import COMPUTE


class StepRecorder:
    """One pipeline rank's record of its last step, and the metrics worked out from all ranks' records."""

    def __init__(self, mesh: Mesh, saved: SavedBytes, title: str):
        self.mesh, self.saved, self.title = mesh, saved, title
        self.p, self.group, self.device = mesh.size("pp"), mesh.group("pp"), mesh.device
        self.clock = StepClock(mesh.device)  # the last step's events (kind, mb, chunk, start_s, end_s)
        self.metrics: dict[str, float] = {}
        self._pending = False  # the last step's metrics are not worked out yet
        self.shared_clock = self._same_host()

    def start_step(self) -> None:
        self.clock.start()
        self.saved.start_step()

    def step_done(self) -> None:
        """The metrics are worked out when asked for (step_metrics), so a step costs no extra collective."""
        self._pending = True

    @property
    def events(self) -> list[tuple]:
        """The last step's (kind, micro-batch, chunk, start_s, end_s), seconds from its start."""
        return self.clock.events()

    def step_metrics(self) -> dict[str, float]:
        """bubble = 1 - (compute time summed over the pipeline) / (p * step span); collective over pp.

        The span is from the earliest step start to the latest end of a compute
        on any stage (perf_counter is one system-wide monotonic clock on a host).
        Across hosts each rank counts from its own start, which is close: the
        previous step ended in collectives over all ranks (gradient norm, loss).
        """
        if not self._pending:
            return self.metrics
        self._pending = False
        compute = [(s, e) for k, _, _, s, e in self.events if k in COMPUTE]
        busy, end, saved_peak = sum(e - s for s, e in compute), max(e for _, e in compute), self.saved.peak
        busy_sum = torch.tensor([busy], dtype=torch.float64, device=self.device)
        t0 = self.clock.t0 if self.shared_clock else 0.0
        peaks = torch.tensor([end + t0, -t0, saved_peak / 2**20], dtype=torch.float64, device=self.device)
        if self.group is not None:
            dist.all_reduce(busy_sum, group=self.group)
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=self.group)
        span = peaks[0].item() + peaks[1].item()
        self.metrics = {"bubble": 1 - busy_sum.item() / (self.p * span),
                        "act_peak_mb": peaks[2].item(),  # saved activations, the most on any stage
                        "act_peak_mb_rank": saved_peak / 2**20}
        return self.metrics

    def write_timeline(self, out_dir: str) -> dict[str, str]:
        """Collective: the last step's events of one pipeline -> trace.json and gantt.png (rank 0 writes)."""
        bubble = self.step_metrics().get("bubble", 0.0)  # collective too: the title quotes it
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.clock.t0 if self.shared_clock else 0.0, self.events))
        if self.mesh.rank != 0:
            return {}
        mine = [gathered[r] for r in self.mesh.group_ranks(("pp",))]
        first = min(t0 for t0, _ in mine)  # put every rank on the clock of the earliest start
        per_rank = [[(k, mb, c, s + t0 - first, e + t0 - first) for k, mb, c, s, e in events]
                    for t0, events in mine]
        title = f"{self.title}, bubble {bubble:.0%}"
        trace = chrome_trace(per_rank, f"{out_dir}/pipeline_trace.json", title)
        png = gantt_png(per_rank, f"{out_dir}/pipeline_gantt.png", title)
        return {"pipeline trace": str(trace), "pipeline gantt": str(png)}

    def _same_host(self) -> bool:
        """Whether the pipeline's ranks share one host, and so one perf_counter; collective over pp."""
        if self.group is None:
            return True
        hosts: list = [None] * self.p
        dist.all_gather_object(hosts, socket.gethostname(), group=self.group)
        return len(set(hosts)) == 1
