"""Parameter server on torch.distributed point-to-point: BSP, ASP and SSP.

The architecture of DistBelief/PS-Lite (Li et al. 2014, "Scaling distributed
machine learning with the parameter server"). Server ranks own the weights;
worker ranks hold a full copy of the model, pull weights, compute gradients on
their own data and push them; servers apply the optimizer.

Sharding (PS-Lite key ranges): the model's parameters, in registration order,
are one flat key space of N elements; server k owns the contiguous range
[k*N/S, (k+1)*N/S) (balanced by size to within one element; one parameter may
span two servers). A server's shard is a single flat tensor; the optimizer
sees it as one Parameter per model parameter it overlaps (sharing its memory,
each tagged `ps_source_dim`, the dimension of the parameter it came from, so
weight decay can skip vectors as the trainer's AdamW does). Any elementwise
optimizer (SGD, Adam, AdamW, ...) applies unchanged; optimizers that need
whole-tensor norms (LAMB, Shampoo) would not.

A parameter a worker did not use in its step is pushed as "no gradient" (-0.0,
tessel.parallel.data.unused); the server's optimizer skips a piece whose update
has no gradient from any worker it averages (BSP) or from the one pushing
(ASP, SSP), as a torch optimizer skips a parameter whose grad is None: AdamW
neither decays it nor counts its step.

Gradient clipping (`grad_clip`): BSP clips the averaged gradient by its global
norm (the servers sum their squares: what all-reduce DP does); ASP and SSP
apply one worker's gradient at a time, so the worker clips its own before
pushing. `lr_at(step)` sets the learning rate of every update: step = updates
under BSP, updates / workers under ASP and SSP (one pass of all workers).

Modes, as the servers enforce them (clock[w] = pushes received from worker w):
- `bsp`: bulk synchronous. A server averages the step-c gradients of every
  live worker (summed in worker order, so runs are deterministic), applies
  one optimizer step, then answers all of them. Same math as all-reduce DP.
- `asp`: asynchronous. Each push is applied on arrival and answered at once
  (Hogwild-style staleness, no waiting).
- `ssp`: stale synchronous (Ho et al. 2013, "More effective distributed ML via
  a stale synchronous parallel parameter server"). Applied on arrival, but a
  worker may start step c only when c - min_v clock[v] <= s, so it is never
  more than s steps ahead of the slowest live worker.

Fault tolerance: each server reads every worker on its own thread; when a
worker's connection drops (or it is silent past the process group's timeout)
the server logs it, drops it from the barrier and the clock minimum, and goes
on. With `hang_timeout_s` > 0 workers also beat (tessel.heartbeat.Heartbeat,
every `heartbeat_s`) and servers watch the beats: a frozen worker (stopped,
swapping, its host gone quiet) is dropped after hang_timeout_s rather than
after the process group's timeout; a busy one (evaluating, writing a
checkpoint) keeps beating.

Messages: worker->server [kind, worker, step, 0 | gradient slice],
server->worker [version, min_clock, clock, 0 | weight slice], float32.

Snapshots (checkpoints): a worker asks every server for its weights and
optimizer state (`snapshot`: the `state_keys` tensors, elementwise, in key
order, plus the update count); a server answers between two updates, so each
shard is consistent in itself. Under BSP, asked between steps, that is the
state after the asking worker's last step; under ASP and SSP other workers'
pushes keep landing, so servers may be a few pushes apart (a fuzzy snapshot,
as PS systems take them). `restore` puts such a state back on the servers.

    ps = ParameterServer(model, servers=[0], workers=[1, 2, 3], mode="ssp", staleness=2,
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    if ps.is_server:
        stats = ps.serve()
    else:
        for step in range(steps):
            loss = ps.step(lambda m: loss_fn(m(x), y))
        ps.finish()
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.comm.algorithms import offsets_of, split_sizes
from tessel.heartbeat import Heartbeat, watch_beats
from tessel.parallel.adamw import step_count
from tessel.parallel.data.broadcast import broadcast_tensors
from tessel.parallel.data.unused import NO_GRADIENT, no_gradient

log = logging.getLogger("tessel.ps")
MODES = ("bsp", "asp", "ssp")
PUSH, PULL, DONE, DEAD, SAVE, SILENT = 0, 1, 2, 3, 4, 5
HEADER = 4
TAG_UP, TAG_DOWN, TAG_SAVE = 71, 72, 73
WIRE = torch.float32


def shard_ranges(total: int, n_servers: int) -> list[tuple[int, int]]:
    """Contiguous key ranges [lo, hi) of the flat parameter space, balanced by size."""
    sizes = split_sizes(total, n_servers)
    return [(lo, lo + n) for lo, n in zip(offsets_of(sizes), sizes)]


@dataclass
class ServerStats:
    rank: int
    mode: str
    updates: int = 0  # optimizer steps applied
    pushes: dict[int, int] = field(default_factory=dict)  # worker -> gradients received
    done: list[int] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    staleness: list[tuple[int, int, int]] = field(default_factory=list)  # (worker, its clock, min clock) at release
    max_staleness: int = 0


class ParameterServer:
    def __init__(self, model: nn.Module, servers: Sequence[int], workers: Sequence[int], mode: str = "bsp",
                 staleness: int = 0, optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
                 group=None, broadcast: bool = True, grad_clip: float = 0.0,
                 lr_at: Callable[[int], float] | None = None, state_keys: Sequence[str] = (),
                 hang_timeout_s: float = 0.0, heartbeat_s: float = 1.0):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if staleness < 0:
            raise ValueError("staleness must be >= 0")
        # the bound on clock[w] - min clock when answering: none at all under ASP
        bound = {"bsp": 0, "ssp": staleness, "asp": float("inf")}[mode]
        self.model, self.mode, self.s = model, mode, bound
        self.servers, self.workers, self.group = list(servers), list(workers), group
        self.rank = dist.get_rank()
        self.is_server = self.rank in self.servers
        self.params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
        self.device = self.params[0].device
        if broadcast:  # one starting point everywhere (frozen weights, buffers too), whatever each rank's seed was
            broadcast_tensors([*model.parameters(), *model.buffers()], src=self.servers[0], group=group)
        self.total = sum(p.numel() for p in self.params)
        self.ranges = shard_ranges(self.total, len(self.servers))
        self.step_count = 0
        self.last_header: dict[int, list[int]] = {}
        self.grad_clip, self.lr_at = grad_clip, lr_at
        self.state_keys, self.start_updates = tuple(state_keys), 0
        self.hang_timeout_s, self.heartbeat_s = hang_timeout_s, heartbeat_s
        self.heartbeat = None
        if hang_timeout_s > 0 and not self.is_server and self.rank in self.workers:
            self.heartbeat = Heartbeat(self.rank, dist.get_world_size(), heartbeat_s, hang_timeout_s).start(watch=False)
        # BSP clips over all servers' shards: their squared norms are summed in a servers' group
        # (new_group is collective: every rank makes it, in the same order)
        self.server_group = dist.new_group(self.servers) if grad_clip > 0 and len(self.servers) > 1 else None
        if self.is_server:
            lo, hi = self.ranges[self.servers.index(self.rank)]
            self.shard = self.flat_params()[lo:hi].clone()
            self.pieces = self._pieces(lo, hi)
            self.optimizer = (optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.1)))(self.pieces)

    def _pieces(self, lo: int, hi: int) -> list[nn.Parameter]:
        """The shard as one Parameter per model parameter it overlaps, sharing the shard's memory."""
        pieces, off = [], 0
        for p in self.params:
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                piece = nn.Parameter(self.shard[a - lo: b - lo])  # a view: updates land in the shard
                piece.ps_source_dim = p.dim()
                pieces.append(piece)
            off += p.numel()
        return pieces

    # ---- flat views of the model -------------------------------------------
    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).to(WIRE) for p in self.params])

    def flat_grads(self) -> torch.Tensor:
        """The step's gradients, flat; a parameter without one is pushed as "no gradient" (-0.0)."""
        return torch.cat([(p.grad if p.grad is not None else torch.full_like(p, NO_GRADIENT)).reshape(-1).to(WIRE)
                          for p in self.params])

    @torch.no_grad()
    def load_flat(self, flat: torch.Tensor) -> None:
        off = 0
        for p in self.params:
            p.copy_(flat[off: off + p.numel()].view_as(p))
            off += p.numel()

    # ---- worker side -------------------------------------------------------
    def _round_trip(self, kind: int, payload: torch.Tensor | None, answer_tag: int | None = TAG_DOWN,
                    width: int = 1) -> tuple[torch.Tensor | None, dict[int, list[int]]]:
        """Send [header | slice] to every server; with answer_tag, receive [header | width slices] back.

        Returns the answers assembled over the key space, (width, total), and each server's header.
        """
        sends, recvs = [], []
        for k, srv in enumerate(self.servers):
            lo, hi = self.ranges[k]
            body = payload[lo:hi] if payload is not None else torch.zeros(hi - lo, dtype=WIRE, device=self.device)
            head = torch.tensor([kind, self.rank, self.step_count, 0], dtype=WIRE, device=self.device)
            msg = torch.cat([head, body])
            sends.append((dist.isend(msg, srv, self.group, tag=TAG_UP), msg))
            if answer_tag is not None:
                buf = torch.empty(HEADER + width * (hi - lo), dtype=WIRE, device=self.device)
                recvs.append((dist.irecv(buf, srv, self.group, tag=answer_tag), buf, k))
        flat = torch.empty(width, self.total, dtype=WIRE, device=self.device) if recvs else None
        headers = {}
        for work, buf, k in recvs:
            work.wait()
            lo, hi = self.ranges[k]
            flat[:, lo:hi] = buf[HEADER:].view(width, hi - lo)
            headers[self.servers[k]] = [int(v) for v in buf[:HEADER].tolist()]
        for work, _ in sends:
            work.wait()
        return flat, headers

    def _exchange(self, kind: int, payload: torch.Tensor | None) -> None:
        """Send [header | slice] to every server, receive [header | weights slice] back, load them."""
        flat, headers = self._round_trip(kind, payload, None if kind == DONE else TAG_DOWN)
        self.last_header.update(headers)
        if flat is not None:
            self.load_flat(flat[0])

    def pull(self) -> None:
        self._exchange(PULL, None)

    def step(self, compute_loss: Callable[[nn.Module], torch.Tensor]) -> float:
        """One worker step: (first time: pull), loss, backward, push, and pull the answer."""
        self.begin_step()
        loss = compute_loss(self.model)
        loss.backward()
        self.push()
        return float(loss.detach())

    def begin_step(self) -> None:
        """Before a step's backward: the weights of the first pull, and no old gradients."""
        if self.heartbeat is not None:
            self.heartbeat.set(self.step_count, "step")
        if not self.last_header:  # nothing pulled yet (a resumed run starts at step_count > 0)
            self.pull()
        for p in self.params:
            p.grad = None

    def push(self) -> None:
        """Push this step's gradients (in p.grad) and load the weights the servers answer with."""
        if self.grad_clip > 0 and self.mode != "bsp":  # ASP/SSP: the update is this worker's gradient
            torch.nn.utils.clip_grad_norm_([p for p in self.params if p.grad is not None], self.grad_clip)
        self._exchange(PUSH, self.flat_grads())
        self.step_count += 1

    def observed_staleness(self) -> int:
        """How far ahead of the slowest worker the servers let this worker start its next step."""
        return max(clock - min_clock for _, min_clock, clock, _ in self.last_header.values())

    def finish(self) -> None:
        self._exchange(DONE, None)
        if self.heartbeat is not None:
            self.heartbeat.stop()  # "done": a finished worker is not a frozen one

    def snapshot(self) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        """(flat weights, {state key: flat state}, updates) from every server (worker side).

        updates is the smallest count among the servers (they agree under BSP).
        """
        flat, headers = self._round_trip(SAVE, None, TAG_SAVE, width=1 + len(self.state_keys))
        updates = min(head[0] for head in headers.values())
        return flat[0], {key: flat[1 + i] for i, key in enumerate(self.state_keys)}, updates

    @torch.no_grad()
    def restore(self, flat: torch.Tensor, state: dict[str, torch.Tensor], updates: int) -> None:
        """Server side, before serve(): this server's range of a snapshot (or a checkpoint's).

        Optimizers with state_keys (Adam's moments) also get their step counter: `updates`.
        """
        if not self.is_server:
            return
        lo, hi = self.ranges[self.servers.index(self.rank)]
        self.shard.copy_(flat[lo:hi])
        off = lo
        for piece in self.pieces:
            n = piece.numel()
            if self.state_keys:
                st = {key: state[key][off:off + n].to(piece.dtype).clone() for key in self.state_keys}
                self.optimizer.state[piece] = {"step": step_count(self.optimizer, piece, updates), **st}
            off += n
        self.start_updates = updates

    def _state_flat(self, key: str) -> torch.Tensor:
        """One optimizer state tensor over this server's shard (zeros before the first update)."""
        return torch.cat([self.optimizer.state.get(q, {}).get(key, torch.zeros_like(q)).detach().reshape(-1)
                          for q in self.pieces]) if self.pieces else self.shard.new_zeros(0)

    # ---- server side -------------------------------------------------------
    def serve(self) -> ServerStats:
        """Run until every worker is done or dead; returns what happened."""
        return _ServerLoop(self).run()


class _ServerLoop:
    def __init__(self, ps: ParameterServer):
        self.ps = ps
        self.stats = ServerStats(ps.rank, ps.mode, updates=ps.start_updates, pushes={w: 0 for w in ps.workers})
        self.clock = {w: 0 for w in ps.workers}
        self.live = set(ps.workers)  # neither done nor dead
        self.silent: set[int] = set()  # dropped for a stopped heartbeat: may still hold a connection
        self.waiting: set[int] = set()  # workers owed an answer
        self.bsp_grads: dict[int, torch.Tensor] = {}
        self.inbox: queue.Queue = queue.Queue()
        self.sends: dict[int, tuple] = {}
        self.snapshots: dict[int, tuple] = {}
        self.n = ps.shard.numel()

    def _reader(self, w: int) -> None:
        """Blocking receives from one worker; a dropped connection or a timeout means it is dead."""
        while True:
            buf = torch.empty(HEADER + self.n, dtype=WIRE, device=self.ps.device)
            try:
                dist.recv(buf, w, self.ps.group, tag=TAG_UP)
            except Exception as err:  # noqa: BLE001 - any transport failure is a dead worker
                self.inbox.put((DEAD, w, -1, repr(err)[:200]))
                return
            kind, _, step = (int(v) for v in buf[:3].tolist())
            self.inbox.put((kind, w, step, buf[HEADER:]))
            if kind == DONE:
                return

    def run(self) -> ServerStats:
        for w in self.ps.workers:
            threading.Thread(target=self._reader, args=(w,), daemon=True, name=f"ps-read-{w}").start()
        stop = threading.Event()
        if self.ps.hang_timeout_s > 0:
            threading.Thread(target=watch_beats, daemon=True, name="ps-watch",
                             args=(self.ps.workers, self.ps.heartbeat_s, self.ps.hang_timeout_s, self._on_silent,
                                   stop)).start()
        try:
            self._loop()
        finally:
            stop.set()
        for w, (work, _) in [*self.sends.items(), *self.snapshots.items()]:
            if w not in self.silent:  # a frozen worker may never read its last answer
                _quiet_wait(work)
        return self.stats

    def _on_silent(self, w: int, age: float, doc: dict) -> None:
        self.inbox.put((SILENT, w, -1, f"no heartbeat for {age:.1f}s (hang_timeout_s {self.ps.hang_timeout_s:g}); "
                                       f"last at step {doc.get('step')}, phase '{doc.get('phase')}'"))

    def _loop(self) -> None:
        while self.live:
            kind, w, step, body = self.inbox.get()
            if w not in self.live:
                continue
            if kind in (DEAD, SILENT):
                log.warning("ps server %d: worker %d %s (%s); going on without it", self.ps.rank, w,
                            "died" if kind == DEAD else "is frozen", body)
                self.live.discard(w)
                self.waiting.discard(w)
                self.stats.dead.append(w)
                if kind == SILENT:
                    self.silent.add(w)
            elif kind == DONE:
                self.live.discard(w)
                self.stats.done.append(w)
            elif kind == PULL:
                self.waiting.add(w)
            elif kind == SAVE:
                self._snapshot(w)
            else:
                self._on_push(w, body)
            self._release()

    def _snapshot(self, w: int) -> None:
        """Weights, optimizer state and update count, as of now (between two updates), to worker w."""
        ps = self.ps
        parts = [ps.shard.detach()] + [ps._state_flat(key) for key in ps.state_keys]
        self._post(w, self.snapshots, TAG_SAVE, [self.stats.updates, 0, 0, 0], parts, "snapshot")

    def _on_push(self, w: int, grad: torch.Tensor) -> None:
        self.clock[w] += 1
        self.stats.pushes[w] += 1
        self.waiting.add(w)
        if self.ps.mode == "bsp":
            self.bsp_grads[w] = grad
        else:
            self._apply(grad)

    def _apply(self, grad: torch.Tensor, clip: bool = False) -> None:
        ps = self.ps
        grad = grad.to(ps.shard.dtype)
        if clip and ps.grad_clip > 0:  # BSP: the global norm of the averaged gradient
            sq = grad.double().pow(2).sum()
            if ps.server_group is not None:
                dist.all_reduce(sq, group=ps.server_group)
            grad = grad * (ps.grad_clip / (sq.sqrt().float() + 1e-6)).clamp(max=1.0)
        if ps.lr_at is not None:
            step = self.stats.updates if ps.mode == "bsp" else self.stats.updates // len(ps.workers)
            for g in ps.optimizer.param_groups:
                g["lr"] = ps.lr_at(step)
        off = 0
        for piece in ps.pieces:
            piece.grad = grad[off: off + piece.numel()]
            off += piece.numel()
        for piece, unused in zip(ps.pieces, no_gradient([piece.grad for piece in ps.pieces])):
            if unused:  # no worker in this update used it: the optimizer leaves it alone
                piece.grad = None
        ps.optimizer.step()
        for piece in ps.pieces:
            piece.grad = None
        self.stats.updates += 1

    def _min_clock(self) -> int:
        return min((self.clock[w] for w in self.live), default=0)

    def _release(self) -> None:
        if self.ps.mode == "bsp" and self.bsp_grads and all(self.clock[w] >= max(self.clock[v] for v in self.bsp_grads)
                                                           for w in self.live):
            # every live worker has pushed this step: one averaged update, in worker order
            grads = [self.bsp_grads[w] for w in sorted(self.bsp_grads)]
            total = grads[0].clone()
            for g in grads[1:]:
                total += g
            self._apply(total / len(grads), clip=True)
            self.bsp_grads.clear()
        low = self._min_clock()
        if self.ps.mode == "bsp" and self.bsp_grads:
            # a barrier is open: those who pushed wait for it; a worker that only pulled (its first
            # weights, before it pushed this step) gets the weights of this step now, or it would
            # never push and the barrier never close
            target = max(self.clock[v] for v in self.bsp_grads)
            for w in sorted(self.waiting):
                if self.clock[w] < target:
                    self._answer(w, low)
            return
        for w in sorted(self.waiting):
            if self.clock[w] - low <= self.ps.s:
                self._answer(w, low)

    def _answer(self, w: int, low: int) -> None:
        self.waiting.discard(w)
        self.stats.staleness.append((w, self.clock[w], low))
        self.stats.max_staleness = max(self.stats.max_staleness, self.clock[w] - low)
        self._post(w, self.sends, TAG_DOWN, [self.stats.updates, low, self.clock[w], 0], [self.ps.shard.detach()],
                   "answer")

    def _post(self, w: int, slots: dict[int, tuple], tag: int, header: list[int], parts: list[torch.Tensor],
              what: str) -> None:
        """isend [header | parts] to worker w, once its previous message of this kind has gone."""
        ps = self.ps
        msg = torch.cat([torch.tensor(header, dtype=WIRE, device=ps.device)] + [t.to(WIRE) for t in parts])
        if w in slots:
            _quiet_wait(slots[w][0])  # the worker read it before asking again
        try:
            slots[w] = (dist.isend(msg, w, ps.group, tag=tag), msg)
        except Exception as err:  # noqa: BLE001 - its reader thread will report the death
            log.warning("ps server %d: %s to worker %d failed: %r", ps.rank, what, w, err)


def _quiet_wait(work) -> None:
    try:
        work.wait()
    except Exception:  # noqa: BLE001 - a send to a worker that died; its reader reports it
        pass
