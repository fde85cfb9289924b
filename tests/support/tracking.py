"""Readers of what the trackers wrote, through each tool's own code: a W&B offline run's
transaction log (.wandb: LevelDB's log framing around wandb's own Record protobufs), and a
real `mlflow server` process on a loopback port."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx

from support.ports import free_port

_BLOCK = 32 * 1024  # LevelDB log blocks; a record's header is 7 bytes (crc, length, type)
_HEADER = struct.Struct("<IHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    """Every Record of a .wandb file, in order (wandb.proto.wandb_internal_pb2.Record)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    records, offset, parts = [], 7, b""
    while offset + _HEADER.size <= len(data):
        if _BLOCK - offset % _BLOCK < _HEADER.size:  # a block's tail too short for a header
            offset += _BLOCK - offset % _BLOCK
            continue
        _, length, kind = _HEADER.unpack_from(data, offset)
        offset += _HEADER.size
        if kind == 0 and length == 0:  # zero padding at a block's end
            offset += _BLOCK - offset % _BLOCK if offset % _BLOCK else 0
            continue
        parts += data[offset:offset + length]
        offset += length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def wandb_history(path: Path) -> dict[int, dict[str, float]]:
    """The logged values of a .wandb file by step (what `wandb sync` would upload)."""
    history: dict[int, dict[str, float]] = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            step = record.history.step.num
            for item in record.history.item:
                key = "/".join(item.nested_key) if item.nested_key else item.key
                if not key.startswith("_"):
                    history.setdefault(step, {})[key] = json.loads(item.value_json)
    return history


def wandb_run(path: Path):
    """The run record (id, project, config) of a .wandb file."""
    return next(r.run for r in wandb_records(path) if r.WhichOneof("record_type") == "run")


class MlflowServer:
    """`mlflow server` on a free loopback port over a SQLite store in `root`."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 180) -> MlflowServer:
        self.root.mkdir(parents=True, exist_ok=True)
        mlflow = str(Path(sys.executable).parent / "mlflow")
        # No job runner (it needs huey, and nothing here submits jobs).
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with (self.root / "server.log").open("a") as log:
            self.process = subprocess.Popen(
                [mlflow, "server", "--host", "127.0.0.1", "--port", str(self.port),
                 "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root}/mlflow.db",
                 "--default-artifact-root", str(self.root / "artifacts")],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            assert self.process.poll() is None, (self.root / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{self.uri}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "mlflow server never answered /health"
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, 15)  # uvicorn's worker too: its own session
            self.process.wait(timeout=30)
