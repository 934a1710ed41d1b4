"""A raw pyzmq PUB socket into the extproc's SUB bind: any frames, valid or not."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import zmq

from extproc.devstack.procs import Extproc, wait_until


class Publisher:
    """Sends config / load / bye events (msgpack, or JSON with ``json_``) or raw frames."""

    def __init__(self, endpoint: str) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.seq: dict[str, int] = {}

    def send(self, topic: str, payload: dict[str, Any] | bytes, *, json_: bool = False) -> None:
        if isinstance(payload, bytes):
            data = payload
        elif json_:
            data = json.dumps(payload).encode()
        else:
            data = msgspec.msgpack.encode(payload)
        self.sock.send_multipart([topic.encode(), data])

    def send_frames(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def config(self, worker_id: str, model: str, endpoint: str, **extra: Any) -> None:
        self.send(
            "config",
            {"v": 1, "worker_id": worker_id, "model": model, "endpoint": endpoint, **extra},
        )

    def load(self, worker_id: str, **fields: Any) -> None:
        self.send("load", {"v": 1, "worker_id": worker_id, **fields})

    def bye(self, worker_id: str) -> None:
        self.send("bye", {"v": 1, "worker_id": worker_id})

    def announce(
        self, ext: Extproc, worker_id: str, model: str, endpoint: str, **extra: Any
    ) -> None:
        """Send config until the extproc knows the worker (PUB/SUB joins late)."""

        def known() -> bool:
            self.config(worker_id, model, endpoint, **extra)
            w = ext.workers().get(worker_id)
            return bool(w and w["model"] == model and w["endpoint"] == endpoint)

        wait_until(known, 10, f"worker {worker_id} announced")

    def close(self) -> None:
        self.sock.close(0)
