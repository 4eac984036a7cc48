"""What the planner knows about the hardware: a cluster spec, presets, and "this machine".

Presets come from vendor spec sheets (dense, no sparsity). Latencies are not on
spec sheets; the preset values are typical small-message collective latencies
(a few microseconds inside an NVSwitch node, ~10 us across InfiniBand) and are
labelled as such. "this" is measured by `probe_this` (tessel.calibrate.profile),
which hands the planner the Cluster it built.

Bandwidths are per device and per direction: what one GPU can push into the
fabric at once (an NVSwitch port, or its share of the node's NICs).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from tessel.config import ConfigError

GB = 1e9


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s per device, one direction
    latency: float  # seconds per message (the alpha of alpha-beta)


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    devices_per_node: int
    peak_flops: dict[str, float]  # dtype ("fp32", "bf16") -> FLOP/s per device
    memory: float  # bytes per device
    intra: Link
    inter: Link
    mem_bandwidth: float  # bytes/s per device, prices the (memory-bound) optimizer step
    # fraction of the peak that large matmuls reach; 1.0 for presets (nothing
    # measured), measured on "this" machine
    efficiency: float = 1.0
    # memory every rank spends before it holds a tensor (CUDA context, or the
    # Python/torch/gloo runtime on CPU), measured on "this"
    baseline_memory: float = 0.0
    # fraction of data-parallel communication that can hide behind backward;
    # GPUs have copy engines (1.0); gloo on CPU reduces on the same cores
    overlap: float = 1.0
    usable_memory: float = 0.9  # allocator fragmentation and workspace keep the rest
    source: str = "preset"
    # measured on "this": {"op/group size": [alpha s, beta s/byte]} (tessel.planner.traffic);
    # empty for presets, whose collectives are priced by the alpha-beta formulas
    collectives: dict = field(default_factory=dict)
    # measured on "this": {op: host memory a call adds beyond its buffers, per byte of them}
    # (gloo copies; tessel.calibrate.profile.collective_workspace); empty for presets
    collective_workspace: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    def flops(self, precision: str) -> float:
        dtype = "bf16" if precision == "bf16" else "fp32"
        return self.peak_flops[dtype] * self.efficiency

    def resized(self, world: int) -> "Cluster":
        """The same hardware with enough nodes for `world` devices."""
        if world < 1:
            raise ConfigError("--world", "must be at least 1")
        if world <= self.devices_per_node:
            return replace(self, nodes=1, devices_per_node=world)
        if world % self.devices_per_node:
            raise ConfigError("--world", f"({world}) is not a whole number of {self.devices_per_node}-device nodes")
        return replace(self, nodes=world // self.devices_per_node)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["intra"], d["inter"] = asdict(self.intra), asdict(self.inter)
        return d

    @staticmethod
    def from_dict(d: dict) -> "Cluster":
        d = dict(d)
        d["intra"], d["inter"] = Link(**d["intra"]), Link(**d["inter"])
        return Cluster(**d)


def _a100(nodes: int) -> Cluster:
    # NVIDIA A100 80GB SXM datasheet: 312 TFLOP/s bf16 dense, 19.5 TFLOP/s fp32
    # (156 with TF32, which PyTorch enables for matmuls on request only),
    # 2,039 GB/s HBM2e, NVLink 600 GB/s total = 300 GB/s per direction via
    # NVSwitch. DGX A100 networking: 8 x 200 Gb/s HDR InfiniBand = 25 GB/s per GPU.
    return Cluster("a100", nodes, 8, {"bf16": 312e12, "fp32": 19.5e12}, 80 * 2**30,
                   Link(300 * GB, 3e-6), Link(25 * GB, 10e-6), mem_bandwidth=2039 * GB)


def _h100(nodes: int) -> Cluster:
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s bf16 dense, 67 TFLOP/s fp32,
    # 3.35 TB/s HBM3, NVLink 900 GB/s total = 450 GB/s per direction.
    # DGX H100: 8 x 400 Gb/s NDR InfiniBand = 50 GB/s per GPU.
    return Cluster("h100", nodes, 8, {"bf16": 989e12, "fp32": 67e12}, 80 * 2**30,
                   Link(450 * GB, 3e-6), Link(50 * GB, 8e-6), mem_bandwidth=3350 * GB)


PRESETS = {"a100": _a100, "h100": _h100}


def get_cluster(name: str, world: int | None = None) -> Cluster:
    """A preset by name, sized to `world` devices.

    "this" is measured, not a preset: tessel.planning gets it from tessel.calibrate.profile.probe_this
    (the planner prices what it is handed and measures nothing)."""
    key = name.lower()
    if key == "this":
        raise ValueError("the cluster 'this' is measured by tessel.calibrate.profile.probe_this, not built here")
    if key not in PRESETS:
        raise ConfigError("--cluster", f"unknown cluster '{name}'; choose one of {sorted(PRESETS) + ['this']}")
    base = PRESETS[key](1)
    return base.resized(world or base.devices_per_node)


# ---- placement --------------------------------------------------------------

def axis_strides(sizes: dict[str, int], order: tuple[str, ...]) -> dict[str, int]:
    """Rank stride of each axis: the rank order lists axes outermost first (tp last = innermost)."""
    strides, s = {}, 1
    for a in reversed(order):
        strides[a] = s
        s *= sizes[a]
    return strides


def spans_nodes(sizes: dict[str, int], strides: dict[str, int], axes: tuple[str, ...],
                devices_per_node: int) -> bool:
    """Does a group over `axes` cross a node boundary?

    Members are base + sum_k c_k * stride_k. The group's aligned block (the
    largest stride*size among its axes) tiles the rank space; the group stays
    inside a node exactly when that block fits in a node and nodes hold whole
    blocks.
    """
    axes = tuple(a for a in axes if sizes[a] > 1)
    if not axes:
        return False
    block = max(strides[a] * sizes[a] for a in axes)
    return not (block <= devices_per_node and devices_per_node % block == 0)


def link_for(cluster: Cluster, sizes: dict[str, int], order: tuple[str, ...], axes: tuple[str, ...]) -> Link:
    """The link class a group over `axes` uses: inter-node if any member sits on another node."""
    strides = axis_strides(sizes, order)
    return cluster.inter if spans_nodes(sizes, strides, axes, cluster.devices_per_node) else cluster.intra
