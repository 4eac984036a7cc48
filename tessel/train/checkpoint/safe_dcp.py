"""torch.distributed.checkpoint storage that never unpickles.

DCP's stock FileSystemWriter pickles its global metadata into `.metadata`, and
its reader unpickles it: whoever can write a checkpoint could then run code in
every process that loads it. Here the metadata is written as JSON instead
(`dcp_metadata.json`, no `.metadata` file at all), and the reader accepts only
tensor entries: values that DCP would store as pickled bytes (BYTE_IO items:
ints, dicts, arbitrary objects) are refused on both sides. Tensor payloads are
read by DCP itself with torch.load(weights_only=True), which admits tensors
and plain containers only; everything else a checkpoint holds (step, data
position, schedules) goes into the JSON manifest of tessel.train.checkpoint.manager.

check_coverage() checks, before anything is read, that the metadata covers
every tensor exactly (chunks in bounds, disjoint, adding up to the tensor).
The writer reports a full disk as the OSError it is (disk_full_errno), not as
the zip writer's enforce failure that DCP would otherwise pass on.
"""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType

METADATA_FILE = "dcp_metadata.json"


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint asked for something that safe loading does not do (unpickle, unknown entries)."""


# ---- Metadata <-> JSON -------------------------------------------------------
_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                                torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
                                torch.complex64, torch.complex128)}


def _index_to_json(idx: MetadataIndex) -> dict:
    return {"fqn": idx.fqn, "offset": None if idx.offset is None else list(idx.offset), "index": idx.index}


def metadata_to_json(md: Metadata) -> dict:
    tensors = {}
    for fqn, entry in md.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise UnsafeCheckpointError(f"'{fqn}' is not a tensor; tessel checkpoints hold tensors only "
                                        "(put plain values in the JSON manifest)")
        p = entry.properties
        tensors[fqn] = {"dtype": str(p.dtype), "size": list(entry.size),
                        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in entry.chunks]}
    storage = [{"index": _index_to_json(idx), "path": info.relative_path, "offset": info.offset,
                "length": info.length, "transforms": list(info.transform_descriptors or [])}
               for idx, info in (md.storage_data or {}).items()]
    return {"version": md.version, "tensors": tensors, "storage": storage}


def metadata_from_json(doc: dict) -> Metadata:
    """Rebuild DCP's Metadata from plain JSON; anything unexpected is refused."""
    try:
        entries = {}
        for fqn, t in doc["tensors"].items():
            if t["dtype"] not in _DTYPES:
                raise UnsafeCheckpointError(f"'{fqn}' has an unknown dtype {t['dtype']!r}")
            chunks = [ChunkStorageMetadata(torch.Size(map(int, c["offsets"])), torch.Size(map(int, c["sizes"])))
                      for c in t["chunks"]]
            entries[str(fqn)] = TensorStorageMetadata(TensorProperties(dtype=_DTYPES[t["dtype"]]),
                                                      torch.Size(map(int, t["size"])), chunks)
        storage = {}
        for s in doc["storage"]:
            i = s["index"]
            idx = MetadataIndex(str(i["fqn"]), None if i["offset"] is None else [int(v) for v in i["offset"]],
                                None if i["index"] is None else int(i["index"]))
            path = str(s["path"])
            if os.path.isabs(path) or ".." in Path(path).parts:
                raise UnsafeCheckpointError(f"storage path {path!r} leaves the checkpoint directory")
            if s["transforms"]:
                raise UnsafeCheckpointError(f"storage transforms {s['transforms']} are not supported")
            storage[idx] = _StorageInfo(path, int(s["offset"]), int(s["length"]))
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise UnsafeCheckpointError(f"malformed {METADATA_FILE}: {err!r}") from None
    return Metadata(state_dict_metadata=entries, storage_data=storage, storage_meta=StorageMeta(),
                    version=doc.get("version"))


def read_metadata(path: str | Path) -> Metadata:
    return metadata_from_json(json.loads((Path(path) / METADATA_FILE).read_text()))


# ---- every tensor covered exactly ---------------------------------------------
def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    return all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def _check_chunks(fqn: str, entry: TensorStorageMetadata) -> None:
    size = list(entry.size)
    for c in entry.chunks:
        if len(c.offsets) != len(size) or len(c.sizes) != len(size) or any(
                o < 0 or s < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, size)):
            raise UnsafeCheckpointError(f"'{fqn}': chunk at {list(c.offsets)} of size {list(c.sizes)} lies "
                                        f"outside the tensor's size {size}")
    for i, a in enumerate(entry.chunks):
        for b in entry.chunks[i + 1:]:
            if _overlap(a, b) and math.prod(a.sizes) and math.prod(b.sizes):
                raise UnsafeCheckpointError(f"'{fqn}': chunks at {list(a.offsets)} and {list(b.offsets)} overlap")
    # in bounds and disjoint: they cover the tensor iff their volumes add up to it
    covered = sum(math.prod(c.sizes) for c in entry.chunks)
    if covered != math.prod(size):
        raise UnsafeCheckpointError(f"'{fqn}': its chunks hold {covered} of its {math.prod(size)} elements")


def check_coverage(md: Metadata) -> None:
    """Every tensor is covered by its chunks exactly (in bounds, no overlap, no gap), and every chunk
    has a storage entry; UnsafeCheckpointError naming the first tensor that is not."""
    stored = {(idx.fqn, tuple(idx.offset or ())) for idx in md.storage_data}
    for fqn, entry in md.state_dict_metadata.items():
        _check_chunks(fqn, entry)
        for c in entry.chunks:
            if (fqn, tuple(c.offsets)) not in stored:
                raise UnsafeCheckpointError(f"'{fqn}': its chunk at {list(c.offsets)} has no storage entry")


# ---- a full disk, however deep DCP wraps it --------------------------------------
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full_errno(err: BaseException | None) -> int | None:
    """ENOSPC or EDQUOT if that is what `err` comes down to: the error itself, what caused it, or any
    rank's failure inside a CheckpointException; None otherwise."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return e.errno
        if isinstance(e, CheckpointException):
            todo += [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        todo += [e.__cause__, e.__context__]
    return None


# ---- storage writer / reader ------------------------------------------------
class JsonMetadataWriter(FileSystemWriter):
    """FileSystemWriter whose global metadata is JSON; refuses non-tensor values."""

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except Exception as err:
            # torch's zip writer reports a full disk as an enforce failure ("unexpected pos"), the
            # OSError only in __context__, which the pickling that gathers failures to every rank
            # drops: pass the OSError on itself
            code = disk_full_errno(err)
            if code is None:
                raise
            raise OSError(code, os.strerror(code), str(self.path)) from err

    def prepare_local_plan(self, plan):
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise UnsafeCheckpointError(f"'{item.index.fqn}' is not a tensor; it would be pickled")
        return super().prepare_local_plan(plan)

    def finish(self, metadata: Metadata, results) -> None:
        storage = {}
        for wr_list in results:
            storage.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage
        path = Path(self.path) / METADATA_FILE
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(metadata_to_json(metadata), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


class SafeReader(FileSystemReader):
    """FileSystemReader that reads JSON metadata and loads tensors only (weights_only)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        md = read_metadata(self.path)
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan, planner):
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise UnsafeCheckpointError(f"'{item.dest_index.fqn}' would be unpickled; refused")
        return super().read_data(plan, planner)

