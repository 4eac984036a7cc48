"""Reading an offline W&B run back from its `run-<id>.wandb` file, for tests.

The file is W&B's transaction log: a 7-byte header (":W&B", magic 0xBEE1, version 0), then
LevelDB-log records in 32 KiB blocks (crc32c, 16-bit length, type FULL/FIRST/MIDDLE/LAST, data;
a block tail shorter than a record header is zero padding), each record's data one protobuf
`wandb.proto.wandb_internal_pb2.Record`. This reads it with W&B's own protobuf classes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # padding to the next block
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _value(item) -> object:
    return json.loads(item.value_json)


def read_run(path: Path) -> dict:
    """{"history": {step: {key: value}}, "config": {...}, "summary": {...}} of one run file."""
    history, config, summary = {}, {}, {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {(item.key or "/".join(item.nested_key)): _value(item) for item in record.history.item}
            history[record.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif kind == "config":
            config.update({(i.key or "/".join(i.nested_key)): _value(i) for i in record.config.update})
        elif kind == "summary":
            summary.update({(i.key or "/".join(i.nested_key)): _value(i) for i in record.summary.update})
        elif kind == "run":
            config.update({(i.key or "/".join(i.nested_key)): _value(i) for i in record.run.config.update})
    return {"history": history, "config": config, "summary": summary}
