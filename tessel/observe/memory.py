"""Peak memory a piece of work allocates, measured: CUDA's allocator statistics, or on CPU the profiler's
record of every allocation and free (torch.profiler with profile_memory: each event carries the bytes
allocated so far), so a CPU run can be measured op by op, without the process's resident set (libraries,
the interpreter) in the number."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Callable

import torch


def allocated_peak(fn: Callable[[], object], device: torch.device) -> int:
    """Bytes above what was allocated when fn started, at the moment of fn's peak."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    from torch.profiler import ProfilerActivity, profile  # deferred: the profiler loads kineto
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    # "Total Allocated" counts from zero at the profiler's start: allocations net of frees since then
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max([0, *totals])
