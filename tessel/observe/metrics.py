"""Per-step metrics: JSONL file, TensorBoard events, peak memory, and the FLOP/s probe for MFU."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from tessel.config import compute_dtype

# Dense peaks per device from vendor spec sheets (no sparsity), FLOP/s: bf16 (and fp16) on tensor cores; tf32,
# the tensor cores' fp32 matmuls, which torch uses only when allowed (torch.set_float32_matmul_precision);
# plain fp32 on the CUDA cores, torch's default for fp32 matmuls. The first name found in the device's wins.
KNOWN_PEAKS = {
    "H100 PCIe": {"bf16": 756e12, "tf32": 378e12, "fp32": 51e12},
    "H100": {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12},  # SXM
    "H200": {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "L4": {"bf16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "A10": {"bf16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
}


def spec_sheet_peak(name: str, dtype: torch.dtype) -> float | None:
    """The spec-sheet peak of a GPU called `name` for matmuls in dtype, as torch will run them; None if unknown."""
    for key, peaks in KNOWN_PEAKS.items():
        if key in name:
            if dtype in (torch.bfloat16, torch.float16):
                return peaks["bf16"]
            return peaks["tf32"] if torch.get_float32_matmul_precision() != "highest" else peaks["fp32"]
    return None


def synced_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Wall seconds of fn on `device`: on a GPU the queue is drained before and after, so the time is fn's
    kernels', not their launches' (CUDA runs them after the host returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def measure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int | None = None,
                         seconds: float = 0.3) -> float:
    """Sustained matmul FLOP/s of this rank's share of the device.

    On CPU this is measured with the rank's own thread count, while the other
    ranks probe at the same moment, so oversubscribed cores are priced as they
    are. On a known GPU the spec-sheet peak is used (MFU is defined against it).
    """
    if device.type == "cuda":
        peak = spec_sheet_peak(torch.cuda.get_device_name(device), dtype)
        if peak is not None:
            return peak
    n = n or (256 if device.type == "cpu" else 8192)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up: first call pays for thread-pool start and kernel choice
    # best of several short windows: a shared machine steals whole time slices,
    # and the peak is what the rank gets when it is not robbed
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == 0.0:
        iters, start = 0, time.perf_counter()
        while iters < 3 or time.perf_counter() - start < seconds / 8:
            a @ b
            iters += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 2 * n**3 * iters / (time.perf_counter() - start))
    return best


def device_peak_flops(device: torch.device, precision: str) -> float:
    """The peak MFU is measured against, per rank.

    A GPU's is its spec-sheet number for the compute dtype. A CPU has no spec
    sheet here, and many CPUs emulate bf16 matmuls more slowly than fp32 ones:
    its peak is the faster of the two measured rates, so MFU never exceeds 1
    merely because the chosen dtype is the slow one.
    """
    if device.type == "cuda":
        return measure_matmul_flops(device, torch.bfloat16 if compute_dtype(precision) == "bf16" else torch.float32)
    return max(measure_matmul_flops(device, torch.float32), measure_matmul_flops(device, torch.bfloat16))


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated device memory (CUDA) or peak resident set size (CPU), in MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


class MetricsLog:
    """Appends one JSON object per step to metrics.jsonl and mirrors scalars to TensorBoard and the
    experiment trackers (tessel.observe.trackers), which also get the summary when the log closes."""

    def __init__(self, out_dir: str | Path, tensorboard: bool = True, append: bool = False, trackers=()):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.file = self.path.open("a" if append else "w")
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(self.dir / "tensorboard"))
        self.trackers = list(trackers)

    def log(self, step: int, values: dict) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in values.items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.writer is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, step)
        for tracker in self.trackers:
            tracker.log(step, row)

    def close(self, summary: dict | None = None) -> None:
        """summary: the run's, for the trackers; None when the run stopped early."""
        self.file.close()
        if self.writer is not None:
            self.writer.close()
        for tracker in self.trackers:
            tracker.finish(summary)
        self.trackers = []


def _plain(v):
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    return v
