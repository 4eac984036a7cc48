"""Which ranks share a node: read from a topology file, or derived from the launch.

The file is written by `tessel probe` (see tessel.calibrate.topology_probe for the format)
and read here by the data-parallel hierarchical all-reduce, the mesh check
(`mesh.check_topology(topology.nproc_per_node)`) and the planner
(`intra_gbps` / `inter_gbps` / `latency_us` summarize the links).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT_VERSION = 1
ENV_VAR = "TESSEL_TOPOLOGY"  # path of a topology file; wins over everything else


@dataclass
class Topology:
    world_size: int
    nodes: list[list[int]]  # global ranks per node, each list ascending
    bandwidth_gbps: list[list[float]] | None = None  # [src][dst], diagonal 0
    latency_us: list[list[float]] | None = None  # [src][dst] one-way, diagonal 0
    intra_gbps: float | None = None  # median bandwidth between ranks of one node
    inter_gbps: float | None = None  # median bandwidth between ranks of different nodes
    hosts: list[str] = field(default_factory=list)  # what each rank reported as its host
    method: str = "given"
    version: int = FORMAT_VERSION

    def __post_init__(self):
        seen = sorted(r for n in self.nodes for r in n)
        if seen != list(range(self.world_size)):
            raise ValueError(f"topology nodes {self.nodes} must cover ranks 0..{self.world_size - 1} once each")

    def node_of(self, rank: int) -> int:
        return next(k for k, n in enumerate(self.nodes) if rank in n)

    @property
    def nproc_per_node(self) -> int | None:
        """Ranks per node when every node has the same number and holds contiguous ranks."""
        sizes = {len(n) for n in self.nodes}
        contiguous = all(n == list(range(n[0], n[0] + len(n))) for n in self.nodes)
        return sizes.pop() if len(sizes) == 1 and contiguous else None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Topology":
        raw = json.loads(Path(path).read_text())
        if raw.get("version", FORMAT_VERSION) != FORMAT_VERSION:
            raise ValueError(f"{path}: topology format version {raw.get('version')} (expected {FORMAT_VERSION})")
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def nodes_from_nproc(world_size: int, nproc_per_node: int) -> list[list[int]]:
    """torchrun's placement: node k holds ranks k*nproc .. (k+1)*nproc - 1."""
    if world_size % nproc_per_node:
        raise ValueError(f"world size {world_size} is not a multiple of nproc_per_node {nproc_per_node}")
    return [list(range(k, k + nproc_per_node)) for k in range(0, world_size, nproc_per_node)]


def resolve_nodes(world_size: int, topology_path: str | None = None,
                  nproc_per_node: int | None = None) -> list[list[int]]:
    """Node grouping, from the first source that has one:

    $TESSEL_TOPOLOGY or `topology_path` (a probe file), then `nproc_per_node`
    (runtime.nproc_per_node), then torchrun's LOCAL_WORLD_SIZE, else one node.
    """
    path = os.environ.get(ENV_VAR) or topology_path
    if path:
        topo = Topology.load(path)
        if topo.world_size != world_size:
            raise ValueError(f"{path} describes {topo.world_size} ranks, the world has {world_size}")
        return topo.nodes
    if nproc_per_node is None and os.environ.get("TORCHELASTIC_RUN_ID"):
        nproc_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return nodes_from_nproc(world_size, nproc_per_node or world_size)
