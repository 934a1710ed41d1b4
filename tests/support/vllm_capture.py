"""Record a real vLLM's pages and messages for the tests that parse them offline.

``python -m tests.support.vllm_capture [--out tests/llmworker/data]`` starts one vLLM
(:class:`extproc.devstack.vllm.VllmServer`, SmolLM2, a KV cache of 10 blocks of 128 tokens so
that four requests of a few hundred tokens preempt each other), binds a ZMQ SUB socket for its
KV events, and writes:

- ``vllm_metrics_idle.txt``: ``/metrics`` before any request;
- ``vllm_metrics_real.txt``: ``/metrics`` while the requests run, once vLLM has preempted and
  some wait;
- ``vllm_kv_events.bin``: the first KV-event messages, raw (format in the folder's README);
- ``vllm_agent_events.jsonl``: what ``python -m llmworker.agent --engine vllm`` published about
  that engine meanwhile, one decoded event a line, each with the /metrics sample read just
  before it (for comparing the two).

Bounded: every wait has a deadline, the requests are few and short.
"""

from __future__ import annotations

import argparse
import json
import struct
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from extproc.devstack import AgentProcess, free_port, http
from extproc.devstack.prom import metric_sums
from extproc.devstack.vllm import SERVED_MODEL, VllmServer
from extproc.events.schema import decode

PROMPT = "Write a very long story about a lighthouse keeper and the sea. " * 23  # ~300 tokens
MAX_EVENTS = 60


def write_frames(path: Path, messages: list[list[bytes]]) -> None:
    """Each message: u32 frame count, then per frame u32 length and the bytes (big-endian)."""
    with path.open("wb") as f:
        for frames in messages:
            f.write(struct.pack(">I", len(frames)))
            for frame in frames:
                f.write(struct.pack(">I", len(frame)))
                f.write(frame)


def read_frames(path: Path) -> list[list[bytes]]:
    """The messages :func:`write_frames` wrote."""
    data = path.read_bytes()
    messages: list[list[bytes]] = []
    pos = 0
    while pos < len(data):
        (count,) = struct.unpack_from(">I", data, pos)
        pos += 4
        frames = []
        for _ in range(count):
            (length,) = struct.unpack_from(">I", data, pos)
            pos += 4
            frames.append(data[pos : pos + length])
            pos += length
        messages.append(frames)
    return messages


def _complete(url: str, max_tokens: int, results: list[Any]) -> None:
    body = {
        "model": SERVED_MODEL,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
    results.append(http("POST", url + "/v1/completions", body, timeout=600)[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.vllm_capture")
    parser.add_argument("--out", type=Path, default=Path("tests/llmworker/data"))
    parser.add_argument("--logs", type=Path, default=Path("run/vllm-capture"))
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--blocks", type=int, default=10)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.logs.mkdir(parents=True, exist_ok=True)

    ctx = zmq.Context()
    kv_sub = ctx.socket(zmq.SUB)
    kv_sub.setsockopt(zmq.LINGER, 0)
    kv_sub.setsockopt(zmq.SUBSCRIBE, b"")
    kv_port = free_port()
    kv_sub.bind(f"tcp://127.0.0.1:{kv_port}")
    agent_sub = ctx.socket(zmq.SUB)
    agent_sub.setsockopt(zmq.LINGER, 0)
    agent_sub.setsockopt(zmq.SUBSCRIBE, b"")
    agent_port = free_port()
    agent_sub.bind(f"tcp://127.0.0.1:{agent_port}")

    started = time.monotonic()
    server = VllmServer(
        args.logs,
        name="vllm-capture",
        num_gpu_blocks_override=args.blocks,
        kv_events=f"tcp://127.0.0.1:{kv_port}",
    )
    up = time.monotonic() - started
    print(f"vLLM up in {up:.1f} s, RSS {server.rss_bytes() / 2**30:.2f} GiB")
    agent = None
    threads: list[threading.Thread] = []
    try:
        idle = http("GET", server.url + "/metrics")[2].decode()
        (args.out / "vllm_metrics_idle.txt").write_text(idle)
        agent = AgentProcess(
            [
                "--engine", "vllm", "--engine-url", server.url, "--model", SERVED_MODEL,
                "--endpoint", server.endpoint, "--worker-id", "vllm-capture",
                "--interval", "0.2", "--max-num-seqs", "4",
                "--publish", f"tcp://127.0.0.1:{agent_port}",
            ],
            log_dir=args.logs,
            name="agent-vllm-capture",
        )  # fmt: skip
        results: list[Any] = []
        for _ in range(args.requests):
            t = threading.Thread(
                target=_complete, args=(server.url, args.max_tokens, results), daemon=True
            )
            t.start()
            threads.append(t)

        kv_messages: list[list[bytes]] = []
        agent_lines: list[str] = []
        real: str | None = None
        deadline = time.monotonic() + 600
        poller = zmq.Poller()
        poller.register(kv_sub, zmq.POLLIN)
        poller.register(agent_sub, zmq.POLLIN)
        while time.monotonic() < deadline and (any(t.is_alive() for t in threads)):
            for sock, _ in poller.poll(200):
                frames = sock.recv_multipart()
                if sock is kv_sub:
                    if len(kv_messages) < MAX_EVENTS:
                        kv_messages.append(frames)
                    continue
                event = decode(frames[0], frames[1])
                page = http("GET", server.url + "/metrics")[2].decode()
                sums = metric_sums(page)
                seen = {k: v for k, v in sums.items() if k in WATCH}
                fields = {
                    k: getattr(event, k)
                    for k in event.__struct_fields__
                    if getattr(event, k) is not None
                }
                agent_lines.append(
                    json.dumps(
                        {"t": round(time.monotonic() - started, 2),
                         "topic": frames[0].decode(), "event": fields,
                         "vllm_after": dict(sorted(seen.items()))},
                        default=str,
                    )
                )  # fmt: skip
            if real is None:
                page = http("GET", server.url + "/metrics")[2].decode()
                sums = metric_sums(page)
                if (
                    sums.get("vllm:num_preemptions_total", 0) > 0
                    and sums.get("vllm:num_requests_waiting", 0) > 0
                    and sums.get("vllm:num_requests_running", 0) > 0
                ):
                    real = page
                    (args.out / "vllm_metrics_real.txt").write_text(page)
                    print(
                        f"captured /metrics in flight at {time.monotonic() - started:.0f} s: "
                        + ", ".join(f"{k}={sums.get(k)}" for k in WATCH)
                    )
        for t in threads:
            t.join(max(1.0, deadline - time.monotonic()))
        print(f"requests: {results}; {len(kv_messages)} KV-event messages")
        write_frames(args.out / "vllm_kv_events.bin", kv_messages)
        (args.out / "vllm_agent_events.jsonl").write_text("\n".join(agent_lines) + "\n")
        final = http("GET", server.url + "/metrics")[2].decode()
        (args.out / "vllm_metrics_after.txt").write_text(final)
        if real is None:
            print("no page with preemptions, waiting and running requests at once")
            return 1
        return 0
    finally:
        if agent is not None:
            agent.stop()
        server.stop()
        kv_sub.close(0)
        agent_sub.close(0)
        ctx.term()


WATCH = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions_total",
)

if __name__ == "__main__":
    raise SystemExit(main())
