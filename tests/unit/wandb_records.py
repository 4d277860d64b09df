"""What an offline W&B run recorded, read back from its transaction logs (RUN_DIR/wandb/offline-run-*/run-<id>.wandb).

wandb 0.31 has no Python reader of these files (wandb-core, in Go, writes and syncs them); their
format is LevelDB's log: a 7-byte header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of
chunks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last), each record a protobuf `Record`.
"""

import json
import struct
from pathlib import Path

BLOCK = 32768
CHUNK_HEADER = 7


def records(path: Path):
    """The `wandb_internal_pb2.Record`s of one .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B transaction log"
    pos, pending = 7, b""
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + CHUNK_HEADER])
        if kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        pending += data[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def offline_runs(wandb_dir: Path) -> list[Path]:
    """The offline run folders, oldest first (one per start of the run)."""
    return sorted(wandb_dir.glob("offline-run-*"))


def run_id(folder: Path) -> str:
    return next(folder.glob("run-*.wandb")).stem.removeprefix("run-")


def history(folder: Path) -> list[dict]:
    """The rows logged in one offline run folder, each {key: value} (nested keys joined by '/')."""
    rows = []
    for record in records(next(folder.glob("run-*.wandb"))):
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return rows


def config(folder: Path) -> dict:
    """The run's config as logged in one folder: {top-level key: value} (updates applied in order)."""
    found = {}
    for record in records(next(folder.glob("run-*.wandb"))):
        kind = record.WhichOneof("record_type")
        items = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        found.update({item.key: json.loads(item.value_json) for item in items})
    return found


def table(folder: Path, row: dict, name: str) -> dict:
    """The table `name` a history row refers to: {"columns": [...], "data": [[...], ...]}."""
    return json.loads((folder / "files" / row[f"{name}/path"]).read_text())
