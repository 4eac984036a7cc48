"""What this machine offers each rank, and whether a recipe fits it: `tessel train`'s memory check.

The budget is a GPU's whole memory on CUDA, and on CPU the RAM Linux says it
can give (MemAvailable) shared by the node's ranks, or less where each process
is capped (RLIMIT_DATA: `prlimit --data`, `ulimit -d`; the ranks inherit it). A rank's own runtime
footprint is the cached probe's measurement where `tessel plan --cluster this`
ran one at this many ranks (tessel.calibrate.cache; never probed here), else
the allowance below. tessel.planner.fit prices the recipe against it.
"""

from __future__ import annotations

import os
import resource

from tessel.calibrate.cache import cached_probe
from tessel.config import Config, ConfigError
from tessel.planner.fit import Budget, MemoryFit, check_fit, size_text

# An idle CPU rank's own footprint, before it holds a model: measured on this project's machine
# (torch 2.13 CPU, gloo) as the peak RSS of one process after `import torch` (218 MiB), gloo's
# init_process_group (221 MiB), tessel.commands.cli and tessel.train.trainer's imports (282 MiB) and one
# AdamW step of a 1-layer d_model=8 GPT (324 MiB); a rank of recipes/tiny.toml trained on a .bin
# file reported peak_mem_mb 341. Rounded up for the metrics and TensorBoard writers.
CPU_RANK_ALLOWANCE = 400 * 2**20
# A CUDA rank's context and NCCL's buffers, outside torch's allocator. Not measured here (no GPU
# on this project's machine); 0.5-1 GiB is the usual range on A100/H100, the upper end taken.
CUDA_RANK_ALLOWANCE = 1 * 2**30


def check_memory(cfg: Config, ranks_per_node: int, force: bool = False) -> MemoryFit:
    """Refuse (ConfigError on field "memory") a recipe whose layout the planner says cannot fit this machine.

    ranks_per_node: the ranks that will share this machine's RAM (CPU). With
    force the estimate is returned whatever it says.
    """
    return check_fit(cfg, device_budget(cfg, ranks_per_node), force)


def device_budget(cfg: Config, ranks_per_node: int) -> Budget:
    if _uses_cuda(cfg.runtime.device, ranks_per_node):
        import torch
        if not torch.cuda.is_available():
            raise ConfigError("runtime.device", "is 'cuda', but torch sees no GPU")
        total = torch.cuda.get_device_properties(0).total_memory
        return Budget(total, CUDA_RANK_ALLOWANCE, {}, f"each rank's GPU has {size_text(total)}")
    ram, probe = available_ram(), cached_probe(ranks_per_node)
    share = ram / ranks_per_node
    text = (f"{ranks_per_node} ranks share {size_text(ram)} of RAM ({size_text(share)} each)" if ranks_per_node > 1
            else f"the rank has {size_text(ram)} of RAM")
    cap = data_limit()
    if cap is not None and cap < share:  # a rank allocating past it fails, whatever the RAM
        share, text = cap, f"each rank is capped at {size_text(cap)} (RLIMIT_DATA)"
    if probe is None:
        return Budget(share, CPU_RANK_ALLOWANCE, {}, text)
    # the probe's RAM figure is the machine's total; MemAvailable, which also sees the other processes, stays
    return Budget(share, probe.baseline_memory, dict(probe.collective_workspace), text)


def data_limit() -> float | None:
    """The cap on one process's heap and private mappings (RLIMIT_DATA), which torch's CPU allocations count
    against; None when there is none."""
    soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
    return None if soft == resource.RLIM_INFINITY else float(soft)


def _uses_cuda(device: str, ranks_per_node: int) -> bool:
    """tessel.runtime.pick_device's rule. torch is imported only to ask; the launcher has it loaded
    already (tessel.train.data.validate_data runs first)."""
    if device == "cpu":
        return False
    from tessel.runtime import auto_uses_cuda  # deferred: loads torch
    return device == "cuda" or auto_uses_cuda(ranks_per_node)


def available_ram() -> float:
    """Bytes Linux can hand out without swapping (MemAvailable), else the free pages, else all of it."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):  # macOS has no SC_AVPHYS_PAGES
        return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
