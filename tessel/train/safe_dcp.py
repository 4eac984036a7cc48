"""torch.distributed.checkpoint storage that never unpickles.

DCP's stock FileSystemWriter pickles its global metadata into `.metadata`, and
its reader unpickles it: whoever can write a checkpoint could then run code in
every process that loads it. Here the metadata is written as JSON instead
(`dcp_metadata.json`, no `.metadata` file at all), and the reader accepts only
tensor entries: values that DCP would store as pickled bytes (BYTE_IO items:
ints, dicts, arbitrary objects) are refused on both sides. Tensor payloads are
read by DCP itself with torch.load(weights_only=True), which admits tensors
and plain containers only; everything else a checkpoint holds (step, data
position, schedules) goes into the JSON manifest of tessel.train.checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
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
    except (KeyError, TypeError, ValueError) as err:
        raise UnsafeCheckpointError(f"malformed {METADATA_FILE}: {err!r}") from None
    return Metadata(state_dict_metadata=entries, storage_data=storage, storage_meta=StorageMeta(),
                    version=doc.get("version"))


def read_metadata(path: str | Path) -> Metadata:
    return metadata_from_json(json.loads((Path(path) / METADATA_FILE).read_text()))


# ---- storage writer / reader ------------------------------------------------
class JsonMetadataWriter(FileSystemWriter):
    """FileSystemWriter whose global metadata is JSON; refuses non-tensor values."""

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

