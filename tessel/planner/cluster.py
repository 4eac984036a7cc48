"""What the planner knows about the hardware: a cluster spec, presets, and "this machine".

A preset is a device model, every constant of it from a spec sheet, a vendor's
published figure or first principles, cited beside it (PRESETS below); nothing
is fitted to anyone's training throughput. `--set cluster.<field>=value`
overrides any field (cluster.intra.bandwidth, cluster.peak_flops.bf16, ...).
"this" is measured by `probe_this` (tessel.calibrate.profile), which hands the
planner the Cluster it built; its compute is priced from a profile of the
model instead of the device model.

Bandwidths are per device and per direction: what one GPU can push into the
fabric at once (its NVSwitch ports, or its share of the node's NICs); a link's
`efficiency` is the fraction of that rate the collective library reaches.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from functools import lru_cache

from tessel.config import ConfigError, compute_dtype
from tessel.planner.gemm import GemmTable, load_table

GB = 1e9


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s per device, one direction, as the spec sheet gives it
    latency: float  # seconds per message (the alpha of alpha-beta)
    efficiency: float = 1.0  # fraction of `bandwidth` the collective library reaches on large messages

    @property
    def rate(self) -> float:
        """Bytes/s a large transfer achieves."""
        return self.bandwidth * self.efficiency


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    devices_per_node: int
    peak_flops: dict[str, float]  # dtype ("fp32", "bf16") -> FLOP/s per device
    memory: float  # bytes per device
    intra: Link
    inter: Link
    mem_bandwidth: float  # bytes/s per device (HBM): memory-bound ops and the optimizer step
    # a flat fraction of the peak for every FLOP where no device model exists (tests, the fit
    # check's placeholder); 1.0 for presets, whose GEMMs are priced by the model below
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
    # empty for presets, whose collectives are priced by tessel.planner.network
    collectives: dict = field(default_factory=dict)
    # measured on "this": {op: host memory a call adds beyond its buffers, per byte of them}
    # (gloo copies; tessel.calibrate.profile.collective_workspace). It belongs to the device it
    # was measured on: Cluster.workspace() never hands it to a GPU device model.
    collective_workspace: dict = field(default_factory=dict)
    # ---- the device model of a GPU (tessel.planner.compute); sms = 0: no model, flat efficiency
    sms: int = 0  # streaming multiprocessors: the GEMM tiles run in waves of this many
    gemm_efficiency: float = 1.0  # fraction of the peak a large GEMM's main loop sustains
    gemm_tile_feed: float = 0.0  # MACs per operand element an SM needs to stay compute-bound (0: none)
    gemm_k_overhead: float = 0.0  # a tile's prologue and epilogue, in K-steps of its main loop
    # persistent GEMM kernels: each SM loads its next tile while it finishes the last, so the prologue is
    # paid once per SM and kernel instead of once per wave (tessel.planner.gemm)
    gemm_persistent: bool = False
    # GEMMs timed on this GPU (benchmarks/gpu_suite.py's matmul section, tessel/planner/gemm_tables/):
    # they correct the roofline prior (tessel.planner.gemm); None: the prior alone
    gemm_table: GemmTable | None = None
    hbm_efficiency: float = 1.0  # fraction of mem_bandwidth a streaming kernel reaches
    attention_efficiency: tuple[float, float] = (1.0, 1.0)  # fused attention (fwd, bwd), of the peak
    fused_attention: bool = True  # attention through a fused (flash) kernel, as SDPA runs it on GPUs
    # ---- the network between nodes (tessel.planner.network)
    rails: bool = False  # rail-optimised: each GPU's own NIC on its own rail switch
    sharp: bool = False  # in-network all-reduce in the switches (NVIDIA SHARP)
    pxn: bool = False  # NCCL's PXN: all-to-all through NVLink to the rail-aligned GPU, then one rail hop
    # heterogeneous devices: each device's speed relative to the one described above, in rank order
    # (empty: all alike); tessel.planner.hetero prices the even and the speed-proportional splits
    speeds: tuple[float, ...] = ()
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    def flops(self, precision: str) -> float:
        dtype = compute_dtype(precision)
        return self.peak_flops[dtype] * self.efficiency

    def workspace(self) -> dict:
        """The backend's measured host-copy workspace, only on the kind of device it was measured on:
        gloo's copies on a CPU. A GPU preset (a device model) runs NCCL in buffers of its own and never
        takes it, whatever a cached probe of this machine says."""
        return {} if self.sms > 0 else self.collective_workspace

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
        d["attention_efficiency"] = list(self.attention_efficiency)
        d["speeds"] = list(self.speeds)
        d["gemm_table"] = self.gemm_table.to_dict() if self.gemm_table else None
        return d

    @staticmethod
    def from_dict(d: dict) -> "Cluster":
        d = dict(d)
        d["intra"], d["inter"] = Link(**d["intra"]), Link(**d["inter"])
        if "attention_efficiency" in d:
            d["attention_efficiency"] = tuple(d["attention_efficiency"])
        d["speeds"] = tuple(d.get("speeds", ()))
        d["gemm_table"] = GemmTable.from_dict(d["gemm_table"]) if d.get("gemm_table") else None
        return Cluster(**d)


# ---- presets ------------------------------------------------------------------------------
# Each constant's source is beside it. Where a source gives a range, the value taken and why is
# said; none is fitted to a training run's throughput.

def _a100(nodes: int) -> Cluster:
    return Cluster(
        "a100", nodes, 8,
        # NVIDIA A100 Tensor Core GPU datasheet (80GB SXM, 2021): 312 TFLOP/s dense BF16 Tensor Core,
        # 19.5 TFLOP/s FP32 (156 with TF32, which PyTorch uses for matmuls only on request)
        peak_flops={"bf16": 312e12, "fp32": 19.5e12},
        memory=80 * 2**30,  # datasheet: 80 GB HBM2e
        # datasheet: NVLink 600 GB/s = 300 GB/s per direction through NVSwitch. NCCL's all-reduce
        # reaches ~230 GB/s bus bandwidth on a DGX A100 (NVIDIA nccl-tests all_reduce_perf, 8 GPUs):
        # 0.77 of the link. Latency per ring step: a few us inside an NVSwitch node (typical NCCL
        # small-message step, not on a spec sheet).
        intra=Link(300 * GB, 3e-6, efficiency=0.77),
        # NVIDIA DGX A100 datasheet: 8 x single-port ConnectX-6 200 Gb/s HDR InfiniBand for the compute
        # fabric = 25 GB/s per GPU per direction. First principles: 64b/66b coding is below the 200 Gb/s
        # data rate already; RDMA headers on a 4 KiB MTU (~1.5%) and NCCL's protocol leave ~94%
        # (nccl-tests report ~23-24 GB/s per HDR NIC). ~10 us per message across the fabric (typical).
        inter=Link(25 * GB, 10e-6, efficiency=0.94),
        mem_bandwidth=2039 * GB,  # datasheet: 2,039 GB/s HBM2e (80GB SXM)
        # NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020): 108 SMs
        sms=108,
        # FlashAttention-2 (Dao 2023), sec. 1: optimized GEMMs "reach up to 80-90% of the theoretical
        # maximum device throughput" on A100. The lower end: in training every GPU of a node runs at
        # its board power limit, which a single-GEMM benchmark does not reach.
        gemm_efficiency=0.80,
        # first principles from the whitepaper: an SM is compute-bound only if each operand element it
        # loads from L2 feeds enough MACs: peak 312e12 FLOP/s over the L2's 5,120 bytes/clk x 1.41 GHz
        # (whitepaper) = 43 MACs per bf16 element (2 FLOP per MAC and 2 bytes per element cancel). A
        # tile m x n feeds m*n/(m+n) MACs per element: 128x128 64 (compute-bound), 64x64 32 (L2-bound).
        gemm_tile_feed=312e12 / (5120 * 1.41e9),
        # first principles: a tile's cp.async pipeline (3 stages of k=32, NVIDIA's Matrix
        # Multiplication Background User's Guide and CUTLASS's Ampere kernels) is loaded before its
        # first MMA: ~96 K-steps of latency per tile beyond its K
        gemm_k_overhead=96,
        # first principles: DRAM refresh, bank conflicts and read/write turnarounds keep streaming
        # kernels ~10% below the interface rate (STREAM-class copy kernels reach 85-92% on HBM GPUs)
        hbm_efficiency=0.90,
        # FlashAttention-2 (Dao 2023), abstract and fig. 4-7: the forward reaches 50-73% of the A100's
        # peak (the middle for causal head-dim-128 attention at 2k tokens), the backward less (~50%)
        attention_efficiency=(0.60, 0.50),
        # NVIDIA DGX SuperPOD (A100) reference architecture: a rail-optimised, non-blocking HDR fat
        # tree, GPU i of every node on rail switch i, Quantum QM8790 switches with SHARPv2. SHARP is
        # used by NCCL only through its SHARP plugin (opt-in: off here); PXN is NCCL's default since 2.12.
        rails=True, sharp=False, pxn=True, gemm_table=load_table("a100"))


def _h100(nodes: int) -> Cluster:
    return Cluster(
        "h100", nodes, 8,
        # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s dense BF16, 1979 dense FP8, 67 FP32
        peak_flops={"bf16": 989e12, "fp8": 1979e12, "fp32": 67e12},
        memory=80 * 2**30,  # datasheet: 80 GB HBM3
        # datasheet: NVLink 900 GB/s = 450 GB/s per direction. NCCL's ring all-reduce on a DGX H100
        # reaches ~360 GB/s bus bandwidth (nccl-tests all_reduce_perf, 8 GPUs, without NVLink SHARP): 0.8
        intra=Link(450 * GB, 3e-6, efficiency=0.80),
        # NVIDIA DGX H100 datasheet: 8 x ConnectX-7 400 Gb/s NDR InfiniBand = 50 GB/s per GPU; the same
        # header and protocol overheads as HDR (above)
        inter=Link(50 * GB, 8e-6, efficiency=0.94),
        mem_bandwidth=3350 * GB,  # datasheet: 3.35 TB/s HBM3
        sms=132,  # NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022): 132 SMs in H100 SXM5
        gemm_efficiency=0.80,  # as A100 (FlashAttention-2's 80-90% for optimized GEMMs, the lower end)
        # Hopper multicasts operand tiles to the SMs of a thread-block cluster (TMA, whitepaper), and no
        # L2 bytes/clk figure is published: the A100's feed requirement is kept
        gemm_tile_feed=312e12 / (5120 * 1.41e9),
        gemm_k_overhead=96,  # as A100: a tile's load pipeline before its first MMA
        # Hopper's GEMMs are persistent and warp-specialized: a producer warp group's TMA loads fill the next
        # tile's pipeline while the consumers run the last one's epilogue (CUTLASS 3's sm90 "warp-specialized
        # persistent" and "ping-pong" kernel schedules, the ones cuBLAS's Hopper kernels follow), so only the
        # first tile on each SM waits for its pipeline to fill
        gemm_persistent=True,
        hbm_efficiency=0.90,  # as A100 (first principles, above)
        # FlashAttention-3 (Shah et al. 2024), abstract: FlashAttention-2, which PyTorch's SDPA runs,
        # "achieves only 35% utilization on the H100"; its backward less
        attention_efficiency=(0.35, 0.30),
        # NVIDIA DGX SuperPOD (H100) reference architecture: rail-optimised NDR fat tree, Quantum-2
        # switches with SHARPv3 (opt-in through NCCL's plugin); PXN by default
        rails=True, sharp=False, pxn=True, gemm_table=load_table("h100"))


def _h200(nodes: int) -> Cluster:
    """The H100's device model with the H200's memory: the same GH100 chip (132 SMs, the same clocks and
    Tensor Cores: NVIDIA H200 Tensor Core GPU datasheet, SXM: 989 TFLOP/s dense BF16, as H100 SXM) with
    141 GB of HBM3e at 4.8 TB/s (datasheet), in DGX H200 nodes whose NVLink and NICs are DGX H100's."""
    return replace(_h100(nodes), name="h200", memory=141 * 2**30, mem_bandwidth=4800 * GB, gemm_table=load_table("h200"))


PRESETS = {"a100": _a100, "h100": _h100, "h200": _h200}


def get_cluster(name: str, world: int | None = None) -> Cluster:
    """A preset by name, sized to `world` devices.

    "this" is measured, not a preset: tessel.commands.planning gets it from tessel.calibrate.profile.probe_this
    (the planner prices what it is handed and measures nothing)."""
    key = name.lower()
    if key == "this":
        raise ValueError("the cluster 'this' is measured by tessel.calibrate.profile.probe_this, not built here")
    if key not in PRESETS:
        raise ConfigError("--cluster", f"unknown cluster '{name}'; choose one of {sorted(PRESETS) + ['this']}")
    base = PRESETS[key](1)
    return base.resized(world or base.devices_per_node)


# ---- --set cluster.<field>=value ------------------------------------------------------------

FIXED = ("name", "nodes", "devices_per_node", "source", "collectives", "collective_workspace", "extra", "gemm_table")


def cluster_fields() -> list[str]:
    """Every key `--set cluster.<key>=value` accepts."""
    out = []
    for f in fields(Cluster):
        if f.name in FIXED:
            continue
        if f.name in ("intra", "inter"):
            out += [f"{f.name}.{g.name}" for g in fields(Link)]
        elif f.name == "peak_flops":
            out += ["peak_flops.bf16", "peak_flops.fp8", "peak_flops.fp32"]
        elif f.name == "attention_efficiency":
            out += ["attention_efficiency.fwd", "attention_efficiency.bwd"]
        else:
            out.append(f.name)
    return out


def override(cluster: Cluster, key: str, raw: str) -> Cluster:
    """The cluster with one field replaced: `key` as cluster_fields() names it, `raw` its text."""
    if key not in cluster_fields():
        raise ConfigError(f"cluster.{key}", f"unknown cluster field; one of {', '.join(cluster_fields())}")
    head, _, sub = key.partition(".")
    current = getattr(cluster, head)
    if head == "speeds":  # a list: cluster.speeds=1,2,1,2
        return replace(cluster, speeds=tuple(_number(key, x) for x in raw.strip("[]()").split(",") if x.strip()))
    if isinstance(current, Link):
        return replace(cluster, **{head: replace(current, **{sub: _number(key, raw)})})
    if head == "peak_flops":
        return replace(cluster, peak_flops={**current, sub: _number(key, raw)})
    if head == "attention_efficiency":
        fwd, bwd = current
        value = _number(key, raw)
        return replace(cluster, attention_efficiency=(value, bwd) if sub == "fwd" else (fwd, value))
    if isinstance(current, bool):
        return replace(cluster, **{head: _flag(key, raw)})
    value = _number(key, raw)
    return replace(cluster, **{head: int(value) if isinstance(current, int) else value})


def _number(key: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"cluster.{key}", f"'{raw}' is not a number") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and key not in ("intra.latency", "inter.latency",
                                                                          "gemm_k_overhead", "gemm_tile_feed",
                                                                          "baseline_memory")):
        raise ConfigError(f"cluster.{key}", f"'{raw}' is out of range (a positive number)")
    if value > 1 and (key.endswith("efficiency") or key.startswith("attention_efficiency") or
                      key in ("overlap", "usable_memory")):
        raise ConfigError(f"cluster.{key}", f"'{raw}' is out of range (a fraction, at most 1)")
    return value


def _flag(key: str, raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"cluster.{key}", f"'{raw}': expected true/false")


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


@dataclass(frozen=True)
class Geometry:
    """How a process group lies on the nodes: n members, k of them on each node it touches, on N nodes."""
    n: int
    k: int
    nodes: int


def group_geometry(sizes: dict[str, int], order: tuple[str, ...], axes: tuple[str, ...],
                   devices_per_node: int) -> Geometry:
    """The geometry of the group over `axes` that holds rank 0 (every group of an axis set is a
    translate of it, so all share its shape when nodes hold whole blocks, as tessel.mesh lays them)."""
    key = tuple(sorted(sizes.items())), tuple(order), tuple(axes), devices_per_node
    return _geometry(*key)


@lru_cache(maxsize=4096)
def _geometry(sizes: tuple, order: tuple, axes: tuple, devices_per_node: int) -> Geometry:
    sizes_d = dict(sizes)
    strides = axis_strides(sizes_d, order)
    members = [0]
    for a in axes:
        members = [m + c * strides[a] for m in members for c in range(sizes_d[a])]
    per_node: dict[int, int] = {}
    for m in members:
        per_node[m // devices_per_node] = per_node.get(m // devices_per_node, 0) + 1
    return Geometry(len(members), max(per_node.values()), len(per_node))
