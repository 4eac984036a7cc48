"""Process-group set-up and teardown for one rank.

gloo on CPU with a fixed number of threads per rank (oversubscribed cores make
every extra thread a loss); NCCL with one device per local rank on CUDA, whose
caching allocator grows expandable segments (cuda_allocator_env).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist


# the allocator setting CUDA ranks start with: segments that grow in place (CUDA's virtual memory) instead of
# new fixed-size blocks, so a step's changing sizes (a pipeline's micro-batches, MoE's dispatch) leave less
# memory stranded in fragments (PyTorch's "CUDA memory management" notes; torchtitan runs with it)
CUDA_ALLOC_CONF = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch >= 2.9 reads the second first


def cuda_allocator_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What a CUDA rank's environment gets for its allocator: expandable segments, unless the user set either
    variable (theirs wins, untouched). Read when CUDA starts in the rank, so it is set before it starts: by
    the launcher for torchrun's ranks, by tessel.spawn for NCCL's."""
    return {} if any(v in environ for v in ALLOC_CONF_VARS) else dict(CUDA_ALLOC_CONF)


def auto_uses_cuda(ranks_per_node: int) -> bool:
    """What runtime.device = "auto" means: a GPU per rank when this node has one for each of its ranks,
    else the CPU. NCCL refuses two ranks on one GPU, so 2 ranks on a 1-GPU laptop run on its CPU (gloo)
    rather than fail at the rendezvous."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= ranks_per_node


def pick_device(choice: str = "auto") -> torch.device:
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if choice == "cuda" or (choice == "auto" and auto_uses_cuda(local_ranks)):
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def make_deterministic() -> None:
    """train.deterministic: every op's deterministic algorithm, or an error naming the op that has none.

    On CUDA, cuBLAS needs a fixed workspace for reproducible matmuls; it reads
    CUBLAS_WORKSPACE_CONFIG when its handle is made (the first matmul), so it is
    set here, before any, unless the user chose a size."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def pick_backend(device: torch.device, choice: str = "auto") -> str:
    if choice != "auto":
        return choice
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(device: str = "auto", backend: str = "auto", threads: int = 1,
                     timeout_s: float = 300.0) -> torch.device:
    """Join the process group described by torchrun's environment variables."""
    torch.set_num_threads(threads)
    dev = pick_device(device)
    if not dist.is_initialized():
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        kwargs.update(_attempt_store(timeout_s))
        dist.init_process_group(pick_backend(dev, backend), timeout=timedelta(seconds=timeout_s), **kwargs)
    return dev


def _attempt_store(timeout_s: float) -> dict:
    """After a torchrun restart, rendezvous under a prefix of this attempt's own.

    The agent's store outlives a failed attempt, and gloo's connection keys
    from it (the dead ranks' addresses) would otherwise be read by the new
    ranks, which then wait forever to connect to processes that are gone.
    """
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") is None or "MASTER_ADDR" not in os.environ:
        return {}
    return {"store": job_store(timeout_s), "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def job_store(timeout_s: float) -> dist.Store:
    """A connection of this process's own to the store the job's ranks met in (MASTER_ADDR, MASTER_PORT),
    under this torchrun attempt's prefix. The store outlives every process group of the job: torchrun's
    agent hosts it for the whole job (its rendezvous shares it with the workers), tessel.spawn's rank 0
    for as long as that process runs. A new group of the same job meets in it (tessel.elastic.adaptive.regroup)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:  # tessel.spawn: one attempt, its own port
        return store
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    return dist.PrefixStore(f"tessel/{run}/attempt{attempt}", store)


def shutdown_and_exit(code: int = 0) -> None:
    """Tear down and leave without running interpreter finalizers.

    With torch 2.13 and gloo, roughly one exit in six aborts with SIGABRT
    ("terminate called without an active exception") while gloo's threads are
    destroyed during interpreter shutdown, after destroy_process_group() has
    returned. Every piece of work is finished and flushed by then, so we skip
    the finalizers with os._exit: a finished run exits with its real code.
    """
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
