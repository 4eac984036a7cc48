"""Run a function on N local ranks in fresh processes: the helper for tests and benchmarks.

Free port, gloo (or NCCL when asked), one thread per rank, a deadline, and a
teardown that kills every rank when one fails or the deadline passes, so a
crashed rank never leaves the others hanging. Results travel back through
files (torch.save of plain data), not pipes, so a rank may leave with os._exit.
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tessel.runtime import cuda_allocator_env


class SpawnError(RuntimeError):
    pass


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: between this check and the rendezvous binding
    it, the port is free for anyone, and gloo's own connections (and every other outgoing socket) take
    theirs from the ephemeral range, so a port from that range can be gone by then (EADDRINUSE)."""
    low = _ephemeral_low()
    below = range(max(1024, low - 12000), low)
    for port in random.Random().sample(below, min(64, len(below))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every try taken: an ephemeral one, as before
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the IANA dynamic range
        return 49152


def _rank_main(fn, rank, world, port, outdir, args, threads, backend, timeout_s, env, cwd):
    # a rank forked from the fork server starts in its environment and folder: take the caller's, whole, as a
    # spawned interpreter would have inherited them when spawn() was called
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    code = 0
    try:
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)
        # the job's store, hosted by rank 0 while this frame lives: it outlives the process group, so that
        # ranks that leave it can meet again in it (tessel.runtime.job_store, tessel.elastic.adaptive.regroup)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s), **kwargs)
        result = fn(*args)
        torch.save(result, Path(outdir) / f"result{rank}.pt")
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        (Path(outdir) / f"error{rank}.txt").write_text(traceback.format_exc())
        code = 1
    # see tessel.runtime.shutdown_and_exit for why finalizers are skipped
    os._exit(code)


def spawn(fn: Callable[..., Any], world_size: int, *args, timeout: float = 180.0, threads: int = 1,
          backend: str = "gloo", env: dict[str, str] | None = None, may_die: tuple[int, ...] = ()) -> list[Any]:
    """Run fn(*args) on `world_size` ranks; returns each rank's return value, by rank.

    Ranks in `may_die` are allowed to die (fault tests); their result is None.
    """
    ctx = start_context()
    env = {**os.environ, **rank_env(backend, threads, env)}
    with tempfile.TemporaryDirectory(prefix="tessel-spawn-") as outdir:
        port = free_port()
        procs = [ctx.Process(target=_rank_main, daemon=False,
                             args=(fn, r, world_size, port, outdir, args, threads, backend, timeout, env,
                                   os.getcwd()))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed = _wait_all(procs, deadline, set(may_die))
        if failed is not None:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(5)
            raise SpawnError(_failure_report(outdir, procs, failed, timeout))
        return [torch.load(Path(outdir) / f"result{r}.pt", weights_only=False)
                if (Path(outdir) / f"result{r}.pt").exists() or r not in may_die else None
                for r in range(world_size)]


# What the fork server imports once, so that each rank forked from it starts with them loaded (torch, the
# strategies and the trainer: about 2 s of imports a rank otherwise, on every spawn). Also torch._dynamo and
# transformers' model classes where installed (the fork server skips a module it cannot import): a rank that
# builds a Hugging Face model or compiles otherwise imports them itself, 1.5 s of CPU a rank on every spawn, 12 s
# for a world of 8. Importing them starts no thread (the server stays safe to fork).
PRELOAD = ["torch", "torch.distributed", "tessel.apply", "tessel.train.trainer", "tessel.spawn", "torch._dynamo",
           "transformers", "transformers.modeling_utils", "transformers.models.auto.modeling_auto"]


def start_context():
    """How ranks start: forked from a fork server (multiprocessing's forkserver) where the platform has one, else
    spawned. The server is a fresh interpreter that imports PRELOAD once and never computes (no autograd or
    OpenMP threads, no CUDA context to inherit: what makes a fork of a working process unsafe), so a rank forked
    from it starts in milliseconds with torch loaded, as a spawned one would after its imports."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def rank_env(backend: str, threads: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """What each rank adds to this process's environment: its threads, under NCCL the CUDA allocator's
    default (tessel.runtime.cuda_allocator_env, unless set here already), then the caller's `env`."""
    cuda = cuda_allocator_env({**os.environ, **(env or {})}) if backend == "nccl" else {}
    return {"OMP_NUM_THREADS": str(threads), **cuda, **(env or {})}


def _wait_all(procs, deadline, may_die: set[int] = frozenset()) -> str | None:
    while True:
        codes = [p.exitcode for p in procs]
        if any(c not in (None, 0) for r, c in enumerate(codes) if r not in may_die):
            return "a rank failed"
        if all(c is not None and (c == 0 or r in may_die) for r, c in enumerate(codes)):
            return None
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(0.02)


def _failure_report(outdir, procs, why, timeout) -> str:
    lines = [f"distributed run failed ({why}; timeout {timeout:.0f}s)"]
    for r, p in enumerate(procs):
        err = Path(outdir) / f"error{r}.txt"
        state = f"exit code {p.exitcode}" if p.exitcode is not None else "still running (killed)"
        lines.append(f"--- rank {r}: {state}")
        if err.exists():
            lines.append(err.read_text())
    return "\n".join(lines)
