"""PipelineRunner: executes a schedule's action lists on this rank's model chunks.

It has the methods of tessel.parallel.runner.LocalRunner, so the trainer does not
know a pipeline is there: parameters(), forward_backward(x, y) -> the step's
mean loss on every rank, evaluate(), generate(). After the flush it finishes
what spans stages: data-parallel reduction (one DataParallel per chunk, synced
on that chunk's last backward, so it overlaps the pipeline's drain) and the
sum of the tied embedding's gradients between the first and last stage.
Under ZeRO one engine covers all chunks and reduces after the rank's last
backward instead (or after the flush, once the tied embedding's gradients are
summed); under ZeRO-3 the chunks' parameters are whole for the whole step
(pipeline/zero3.py). Under TP the chunks are already tensor-parallel (each rank
pipelines with the ranks of its own dp/ep/tp coordinates) and the loss is the
vocab-parallel one; MoE router losses are back-propagated on their own stage
(pipeline/aux.py) and added to the reported loss over the pipeline.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.mesh import Mesh
from tessel.parallel.data.data_parallel import DataParallel
from tessel.parallel.pipeline.aux import AttachAuxLoss, StageAux
from tessel.parallel.pipeline.clock import StepClock
from tessel.parallel.pipeline.comm import StageLinks
from tessel.parallel.pipeline.partition import PipelineStage
from tessel.parallel.pipeline.schedules import COMPUTE, RECVS, Action, batches, build_schedule
from tessel.parallel.runner import autocast_for, generate_tokens, strip_wrappers
from tessel.sharding import mark_replica

RECV_LOOKAHEAD = 2  # receives posted ahead of need under gloo (each holds one activation buffer)


class SavedBytes:
    """Bytes of activations autograd saves for backward, live on this rank, and their peak.

    A saved-tensor hook sees each tensor a forward stores for its backward;
    parameters are left out (they are not activations), and a storage is
    counted once per micro-batch however many ops save views of it. The hook
    is a Python call per saved tensor (about a hundred per block forward and
    as many unpacks), a few percent of a step on small stages, so it runs only
    where the answer can change: a dense chunk saves the same bytes for every
    micro-batch of one input shape, and is measured once per (chunk, shape)
    and counted from that cache afterwards. Chunks whose saved bytes depend on
    the data (MoE dispatch) are measured on every forward.
    """

    def __init__(self, params: list[nn.Parameter], dynamic: list[bool]):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.dynamic = dynamic  # per chunk: measure every forward
        self.live = self.peak = 0
        self._cache: dict[tuple, int] = {}
        self._seen: set[int] = set()
        self._bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.param_ptrs and ptr not in self._seen:
            self._seen.add(ptr)
            self._bytes += t.untyped_storage().nbytes()
        return t

    def hooks(self, key: tuple):
        """The context of one forward of chunk key[0]: the hook, or nothing when the bytes are known."""
        if key in self._cache and not self.dynamic[key[0]]:
            return contextlib.nullcontext()
        self._seen, self._bytes = set(), 0
        return torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack)

    def forwarded(self, key: tuple) -> int:
        if key not in self._cache or self.dynamic[key[0]]:
            self._cache[key] = self._bytes
        nbytes = self._cache[key]
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        return nbytes

    def released(self, nbytes: int) -> None:
        self.live -= nbytes


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class PipelineRunner:
    def __init__(self, chunks: list[PipelineStage], mesh: Mesh, schedule: str, micro_batches: int,
                 loss_fn: Callable, d_model: int, precision: str = "fp32", vocab_size: int | None = None,
                 max_seq_len: int | None = None, bucket_mb: float = 25.0, tied: bool = False,
                 reducer=None, gather_vocab: Callable | None = None,
                 extra_metrics: Callable[[], dict] | None = None, zero=None, optimizer=None,
                 seq_shards: int = 1):
        self.chunks, self.mesh, self.loss_fn = chunks, mesh, loss_fn
        # sequence parallelism: stages exchange (B, T/tp, C), each tp rank its own tokens
        self.seq_shards = seq_shards
        self.p, self.v, self.m = mesh.size("pp"), len(chunks), micro_batches
        self.rank = mesh.coord("pp")
        self.device, self.precision, self.d_model = mesh.device, precision, d_model
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        self.schedule_name = schedule
        self.gather_vocab = gather_vocab  # under TP the last stage's logits are vocab shards
        self.aux = [StageAux(c) for c in chunks]  # MoE aux losses: each stage back-propagates its own
        self.has_aux = any(a.layers for a in self.aux)
        self._extra = extra_metrics  # e.g. MoE routing stats of this rank's blocks
        self.actions = build_schedule(schedule, self.p, micro_batches, self.v)[self.rank]
        self.items = batches(self.actions)
        self.links = StageLinks(mesh)
        # gloo moves a message only once its receive is posted (the sender waits for the
        # receiver's ready note), so a receive posted just before it is needed costs a round
        # trip of wake-ups. There, receives are posted RECV_LOOKAHEAD ahead of need, in the
        # schedule's order (the order messages on each link are matched in), and a stage
        # finds its input already there. Under NCCL a posted receive would hold up the sends
        # queued behind it on the same stream, so receives stay in the schedule's batches.
        self.prepost = self.links.group is not None and dist.get_backend(self.links.group) == "gloo"
        # under gloo the loss comes from the last rank as a message posted at the step's start and
        # sent when that rank is done, so no rank ends its step in a synchronous broadcast (torch
        # keeps the loss on the last stage only; the trainer wants it everywhere). MoE losses have
        # parts on every stage and are summed over the pipeline instead.
        self.loss_by_message = self.prepost and not self.has_aux
        self.recv_order = [a for a in self.actions if a.kind in RECVS]
        self.recv_pos = {(a.kind, a.mb, a.chunk): i for i, a in enumerate(self.recv_order)}
        self._posted = 0
        self._shape: tuple[int, ...] = ()
        self.act_dtype = next(chunks[0].parameters()).dtype  # the residual stream's dtype
        dp_kwargs = {"reducer": reducer} if reducer is not None else {}  # dp_algorithm's reducer
        # ZeRO 1/2 (one engine over all chunks, reducing on this rank's last backward) or plain DP
        self.zero, self.optimizer = zero, optimizer  # the trainer steps this optimizer (None: AdamW)
        self.dp = [DataParallel(c, mesh, ("dp", "ep"), bucket_mb, **dp_kwargs)
                   if mesh.size("dp", "ep") > 1 and zero is None else None for c in chunks]
        last_b = {a.chunk: a for a in self.actions if a.kind == "B"}
        self.last_backward = set(last_b.values())  # where each chunk's DP reduction fires
        self.final_backward = [a for a in self.actions if a.kind == "B"][-1]
        self.tied_group, self.tied_param = self._setup_tied(tied)
        # ZeRO-2/3 on a rank with a tied copy: reduce-scatter after the flush, once the copies
        # are summed. Stage 1 need not wait: its gradients stay whole, and summing the two
        # stages' dp-averaged copies afterwards gives the average of the sums.
        self.zero_after_flush = zero is not None and zero.stage > 1 and self.tied_param is not None
        self.clock = StepClock(self.device)  # the last step's events (kind, mb, chunk, start_s, end_s)
        self.saved = SavedBytes(self.parameters(), [bool(a.layers) for a in self.aux])
        self.metrics: dict[str, float] = {}
        self._pending_metrics = False  # the last step's bubble is not worked out yet
        self.timeline = True  # write_timeline draws the last step (tests switch it off for speed)
        self.shared_clock = self._same_host()

    # ---- LocalRunner's interface ------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        return list(dict.fromkeys(p for c in self.chunks for p in c.parameters()))

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters under their names in the full model."""
        return {n: p for c in self.chunks for n, p in c.named_parameters(remove_duplicate=False)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: t for c in self.chunks for n, t in c.state_dict().items()}

    def named_checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters and persistent buffers (live tensors) under the full model's names, for checkpoints."""
        return {strip_wrappers(name): t for chunk in self.chunks
                for name, t in chunk.state_dict(keep_vars=True).items()}

    def timed_modules(self) -> list[nn.Module]:
        return list(self.chunks)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.gathered():
            return self._forward_backward(x, y)

    @contextlib.contextmanager
    def gathered(self):
        """Every chunk's parameters whole for the duration: a step, an evaluation, a weight check.

        Only ZeRO-3 shards them at rest (pipeline/zero3.py); otherwise a no-op."""
        whole = getattr(self.zero, "step_gathered", None)
        if whole is None:
            yield
            return
        with whole():
            # gathered storages are new: keep them out of the saved-activation count
            self.saved.param_ptrs = {p.untyped_storage().data_ptr() for p in self.parameters()}
            yield

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.clock.start()
        xs, ys = x.to(self.device).chunk(self.m), y.to(self.device).chunk(self.m)
        if len(xs) != self.m or len({t.size(0) for t in xs}) != 1:
            raise ValueError(f"batch of {x.size(0)} does not split into {self.m} equal micro-batches")
        # known ahead: no shape messages; under sequence parallelism each rank's tokens
        self._shape = (xs[0].size(0), x.size(1) // self.seq_shards, self.d_model)
        total = torch.zeros((), device=self.device)
        state: dict = {"inputs": {}, "outputs": {}, "recv": {}, "saved": {},
                       "aux": torch.zeros((), device=self.device)}
        self.saved.peak = self.saved.live = 0
        self._posted = 0
        loss_in = self.links.expect_from_last() if self.loss_by_message else None
        if self.prepost:
            self._post_receives(RECV_LOOKAHEAD, state)
        for item in self.items:
            a = item[0]
            if a.kind not in COMPUTE:
                self._communicate(item, state)
                continue
            self._await_input(a, state)
            start = self.clock.stamp()
            if a.kind == "F":
                loss = self._forward(a, xs, ys, state)
                if loss is not None:
                    total += loss
            else:
                self._backward(a, state, sync=a in self.last_backward)
            self.clock.add(a.kind, a.mb, a.chunk, start, self.clock.stamp())
        if self.loss_by_message and self.rank == self.p - 1:
            self.links.send_to_all(total)
        self.links.wait_sends()
        self._reduce_tied()
        if self.zero_after_flush:
            self.zero.reduce_gradients()
        # the bubble is worked out when asked for (extra_metrics), so a step costs no extra collective
        self._pending_metrics = True
        if self.has_aux:  # every stage adds its aux losses to the loss it reports
            return self.links.sum_over_pipeline(total + state["aux"])
        if loss_in is not None:
            buf, work = loss_in
            work.wait()
            return buf
        return total if self.loss_by_message else self.links.broadcast_from_last(total)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.gathered():
            out = self._forward_only(x.to(self.device))
        loss = torch.zeros((), device=self.device)
        if out is not None:
            with autocast_for(self.device, self.precision):
                loss = self.loss_fn(out, y.to(self.device)).detach().float()
        return self.links.broadcast_from_last(loss)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new_tokens: int, seed: int, temperature: float = 0.8,
                 top_k: int | None = 40) -> torch.Tensor:
        """Every pipeline rank runs this loop; the last samples and broadcasts each token."""
        def last_logits(window: torch.Tensor) -> torch.Tensor | None:
            window, last = self._split_window(window)
            logits = self._forward_only(window)
            if logits is None:
                return None
            logits = logits[:, last: last + 1].contiguous()
            if self.gather_vocab is not None:
                logits = self.gather_vocab(logits)  # (B, 1, V_padded), collective over tp
            return logits[:, -1, : self.vocab_size]
        with self.gathered():
            return generate_tokens(prompt.to(self.device), new_tokens, seed, self.max_seq_len, last_logits,
                                   share=self.links.broadcast_from_last, temperature=temperature, top_k=top_k)

    def _split_window(self, idx: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A window whose length sequence parallelism can split, and the position of its last token.

        Padded on the right (causal attention: the padding cannot change earlier
        logits), or trimmed on the left where padding would pass max_seq_len."""
        T, n = idx.size(1), self.seq_shards
        if n == 1 or T % n == 0:
            return idx, T - 1
        if self.max_seq_len is None or T + n - T % n <= self.max_seq_len:
            return torch.nn.functional.pad(idx, (0, n - T % n)), T - 1
        return idx[:, T % n:], T - T % n - 1

    def extra_metrics(self) -> dict[str, float]:
        """The last step's bubble fraction and saved-activation peaks; collective over the pipeline."""
        if self._pending_metrics:
            self._step_metrics()
            self._pending_metrics = False
        return {**self.metrics, **(self._extra() if self._extra is not None else {})}

    # ---- one action ---------------------------------------------------------------
    def _stage(self, chunk: int) -> int:
        return chunk * self.p + self.rank

    def _is_last(self, chunk: int) -> bool:
        return self._stage(chunk) == self.p * self.v - 1

    def _await_input(self, a: Action, state) -> None:
        """Wait for the activation (F) or gradient (B) this compute needs; the wait is a recv event."""
        kind = "RF" if a.kind == "F" else "RB"
        pos = self.recv_pos.get((kind, a.mb, a.chunk))
        if pos is None:
            return  # first stage's forward, last stage's backward: nothing to receive
        if self.prepost:  # keep the next receives posted while this one is waited on
            self._post_receives(pos + 1 + RECV_LOOKAHEAD, state)
        buf, work = state["recv"][(kind, a.mb, a.chunk)]
        start = self.clock.stamp()  # the event is the time blocked, not the time since posting
        work.wait()
        state["recv"][(kind, a.mb, a.chunk)] = buf
        self.clock.add(kind, a.mb, a.chunk, start, self.clock.stamp())

    def _post_receives(self, upto: int, state) -> None:
        """Post this step's receives up to position `upto` of the rank's receive order."""
        upto = min(upto, len(self.recv_order))
        if self._posted >= upto:
            return
        todo = self.recv_order[self._posted:upto]
        handles = self.links.exchange([], [(a.peer, self._shape, self.act_dtype) for a in todo])
        for a, handle in zip(todo, handles):
            state["recv"][(a.kind, a.mb, a.chunk)] = handle
        self._posted = upto

    def _forward(self, a: Action, xs, ys, state) -> torch.Tensor | None:
        key = (a.mb, a.chunk)
        if self._stage(a.chunk) == 0:
            inp = xs[a.mb]
        else:
            inp = state["recv"].pop(("RF", a.mb, a.chunk)).requires_grad_(True)
        shape_key = (a.chunk, tuple(inp.shape), inp.dtype)
        with self.saved.hooks(shape_key), autocast_for(self.device, self.precision):
            out = self.chunks[a.chunk](inp)
            aux = self.aux[a.chunk]()  # this micro-batch's router losses on this chunk
            if self._is_last(a.chunk):
                # mean over micro-batches: each contributes 1/m of the step's loss
                out = self.loss_fn(out, ys[a.mb]) / self.m
                if aux is not None:
                    out = out + aux / self.m
            elif aux is not None:
                out = AttachAuxLoss.apply(out, aux, 1.0 / self.m)
                state["aux"] += aux.detach() / self.m
        state["saved"][key] = self.saved.forwarded(shape_key)
        state["inputs"][key], state["outputs"][key] = inp, out
        return out.detach() if self._is_last(a.chunk) else None

    def _backward(self, a: Action, state, sync: bool) -> None:
        key = (a.mb, a.chunk)
        out = state["outputs"].pop(key)
        dp = self.dp[a.chunk]
        if dp is not None:
            dp.sync_gradients = sync  # reduce over dp once, on this chunk's last backward
        if self.zero is not None:  # ZeRO reduces every chunk at once, after the rank's last backward
            self.zero.sync_gradients = a is self.final_backward and not self.zero_after_flush
        if self._is_last(a.chunk):
            torch.autograd.backward(out)
        else:
            torch.autograd.backward(out, state["recv"].pop(("RB", a.mb, a.chunk)))
        if self._stage(a.chunk) == 0:
            state["inputs"].pop(key)  # token ids: nothing to send back
        self.saved.released(state["saved"].pop(key))

    def _communicate(self, item: list[Action], state) -> None:
        sends, recvs = [], []
        for a in item:
            key = (a.mb, a.chunk)
            if a.kind == "SF":
                sends.append((a.peer, state["outputs"][key].detach()))
            elif a.kind == "SB":
                sends.append((a.peer, state["inputs"].pop(key).grad))
            elif not self.prepost:
                recvs.append((a.peer, self._shape, self.act_dtype))
        start = self.clock.stamp()
        handles = self.links.exchange(sends, recvs)
        for a, (buf, work) in zip([a for a in item if a.kind in RECVS and not self.prepost], handles):
            state["recv"][(a.kind, a.mb, a.chunk)] = (buf, work)
        end = self.clock.stamp()
        for a in item:
            if a.kind not in RECVS:  # a receive's event closes when its wait does
                self.clock.add(a.kind, a.mb, a.chunk, start, end)

    # ---- what spans stages -------------------------------------------------------------
    def _setup_tied(self, tied: bool):
        if not tied or self.p == 1:
            return None, None
        group = None
        for ranks in self.mesh.all_groups(("pp",)):  # collective: every rank creates every group
            g = dist.new_group([ranks[0], ranks[-1]])
            if self.mesh.rank in (ranks[0], ranks[-1]):
                group = g
        param = None
        for c in self.chunks:
            if c.is_first:
                param = c.tok_emb.weight
            if c.is_last:
                param = c.lm_head.weight
                mark_replica(param)  # the first stage's copy is the one the norm counts
        return group, param

    def _same_host(self) -> bool:
        import socket
        hosts: list = [None] * self.p
        if self.links.group is None:
            return True
        dist.all_gather_object(hosts, socket.gethostname(), group=self.links.group)
        return len(set(hosts)) == 1

    def _reduce_tied(self) -> None:
        """Embedding and head are one weight: each of the two stages gets the sum of both gradients."""
        if self.tied_group is not None and self.tied_param is not None:
            if self.tied_param.grad is None:
                self.tied_param.grad = torch.zeros_like(self.tied_param)
            dist.all_reduce(self.tied_param.grad, group=self.tied_group)

    @property
    def events(self) -> list[tuple]:
        """The last step's (kind, micro-batch, chunk, start_s, end_s), seconds from its start."""
        return self.clock.events()

    @property
    def step_start(self) -> float:
        return self.clock.t0

    def _step_metrics(self) -> None:
        """bubble = 1 - (compute time summed over the pipeline) / (p * step span).

        The span is from the earliest step start to the latest end of a compute
        on any stage (perf_counter is one system-wide monotonic clock on a host).
        Across hosts each rank counts from its own start, which is close: the
        previous step ended in collectives over all ranks (gradient norm, loss).
        """
        compute = [(s, e) for k, _, _, s, e in self.events if k in COMPUTE]
        busy, end, saved_peak = sum(e - s for s, e in compute), max(e for _, e in compute), self.saved.peak
        busy_sum = torch.tensor([busy], dtype=torch.float64, device=self.device)
        # with one clock for all ranks (one host) the span runs from the earliest start to the
        # latest end; otherwise each rank counts from its own start
        t0 = self.step_start if self.shared_clock else 0.0
        peaks = torch.tensor([end + t0, -t0, saved_peak / 2**20], dtype=torch.float64, device=self.device)
        if self.links.group is not None:
            dist.all_reduce(busy_sum, group=self.links.group)
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=self.links.group)
        span = peaks[0].item() + peaks[1].item()
        self.metrics = {"bubble": 1 - busy_sum.item() / (self.p * span),
                        "act_peak_mb": peaks[2].item(),  # saved activations, the most on any stage
                        "act_peak_mb_rank": saved_peak / 2**20}

    def write_timeline(self, out_dir: str) -> dict[str, str]:
        """Collective: the last step's events of one pipeline -> trace.json and gantt.png (rank 0 writes)."""
        from tessel.observe.timeline import chrome_trace, gantt_png
        if not self.timeline:
            return {}
        self.extra_metrics()  # collective too: the title quotes the step's bubble
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.step_start if self.shared_clock else 0.0, self.events))
        if self.mesh.rank != 0:
            return {}
        mine = [gathered[r] for r in self.mesh.group_ranks(("pp",))]
        first = min(t0 for t0, _ in mine)  # put every rank on the clock of the earliest start
        per_rank = [[(k, mb, c, s + t0 - first, e + t0 - first) for k, mb, c, s, e in events]
                    for t0, events in mine]
        title = (f"{self.schedule_name}: pp={self.p}, micro-batches={self.m}"
                 + (f", virtual stages={self.v}" if self.v > 1 else "")
                 + f", bubble {self.metrics.get('bubble', 0):.0%}")
        trace = chrome_trace(per_rank, f"{out_dir}/pipeline_trace.json", title)
        png = gantt_png(per_rank, f"{out_dir}/pipeline_gantt.png", title)
        return {"pipeline trace": str(trace), "pipeline gantt": str(png)}

    def _forward_only(self, idx: torch.Tensor) -> torch.Tensor | None:
        """One micro-batch down every virtual stage; the last stage's output (None elsewhere)."""
        shape = (idx.size(0), idx.size(1) // self.seq_shards, self.d_model)
        out = None
        for c, chunk in enumerate(self.chunks):
            s = self._stage(c)
            inp = idx
            if s > 0:
                ((inp, work),) = self.links.exchange([], [((self.rank - 1) % self.p, shape, self.act_dtype)])
                work.wait()
            with autocast_for(self.device, self.precision):
                out = chunk(inp)
            if not self._is_last(c):
                self.links.exchange([((self.rank + 1) % self.p, out)], [])
                out = None
        self.links.wait_sends()
        return out
