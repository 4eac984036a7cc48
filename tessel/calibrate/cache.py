"""Where this machine's measurements are kept: JSON files under the tessel cache directory.

$TESSEL_CACHE, else ~/.cache/tessel; the probe of "this" machine at each world size, and each
model profile, one file each. Readers that must not measure (the memory check before `tessel
train` starts its ranks) read the probe through cached_probe; only tessel.calibrate.profile writes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tessel.planner.cluster import Cluster

PROBE_VERSION = "v3"  # v3: with the collectives' host memory workspace


def cache_path(kind: str, key: str) -> Path:
    root = os.environ.get("TESSEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tessel")
    return Path(root) / "planner" / f"{kind}-{key}.json"


def probe_path(world: int) -> Path:
    """The file tessel.calibrate.profile.probe_this writes for `world` ranks."""
    return cache_path("this", f"{PROBE_VERSION}-w{world}")


def cached_probe(world: int) -> Cluster | None:
    """The cached probe of this machine at `world` ranks; None if none was run (or another version wrote it).

    Never probes: that spawns ranks for a minute."""
    try:
        return Cluster.from_dict(json.loads(probe_path(world).read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None
