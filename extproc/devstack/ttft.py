"""``python -m extproc.devstack.ttft``: what a client sees, one request at a time.

Sends one short streamed chat every ``--every`` seconds, ``--count`` in all (each in its own
thread, so a slow answer does not delay the next), and prints one line per request, in the
order sent, as they end: when it was sent, the status, the time to its first body byte (for
a stream, its first token) and, for a refusal, ``x-shed-reason``, ``Retry-After`` and
``retry-after-ms``::

    t=  0.0s  529  first byte    4 ms  x-shed-reason: deadline  retry-after: 1  retry-after-ms: 1000
    t= 28.0s  200  first byte  263 ms

Bounded: every request has a ``--timeout`` (60 s), and the run ends when the last one does.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Sequence
from http.client import HTTPConnection, HTTPException
from urllib.parse import urlsplit


def one(url: str, model: str, max_tokens: int, timeout: float) -> tuple[int, float, dict[str, str]]:
    """One streamed chat: (status, seconds to the first body byte, headers); status 0 and
    the error in ``error`` when the request failed."""
    parts = urlsplit(url)
    start = time.monotonic()
    conn = HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    try:
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"}
        )
        resp = conn.getresponse()
        resp.read(1)
        first = time.monotonic() - start
        resp.read()
        return resp.status, first, {k.lower(): v for k, v in resp.getheaders()}
    except (OSError, HTTPException) as exc:
        return 0, time.monotonic() - start, {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        conn.close()


def line(sent: float, status: int, first: float, headers: dict[str, str]) -> str:
    out = f"t={sent:5.1f}s  {status}  first byte {first * 1000:4.0f} ms"
    if "error" in headers:
        return f"{out}  {headers['error']}"
    if status != 200:
        for name in ("x-shed-reason", "retry-after", "retry-after-ms"):
            if name in headers:
                out += f"  {name}: {headers[name]}"
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m extproc.devstack.ttft", description=__doc__)
    parser.add_argument("--url", default="http://localhost:8000", help="Envoy's address")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--every", type=float, default=1.0, help="seconds between requests")
    parser.add_argument("--count", type=int, default=15, help="how many requests")
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    args = parser.parse_args(argv)
    if args.count < 1 or args.every < 0:
        parser.error(f"--count {args.count} / --every {args.every}: expected >= 1 and >= 0")
    results: dict[int, tuple[float, int, float, dict[str, str]]] = {}
    t0 = time.monotonic()

    def run(i: int, sent: float) -> None:
        results[i] = (sent, *one(args.url, args.model, args.max_tokens, args.timeout))

    threads: list[threading.Thread] = []
    printed = 0

    def print_done() -> None:  # in the order sent, each once it and those before it are done
        nonlocal printed
        while printed < len(threads) and not threads[printed].is_alive():
            threads[printed].join()
            print(line(*results[printed]), flush=True)
            printed += 1

    for i in range(args.count):
        thread = threading.Thread(target=run, args=(i, time.monotonic() - t0))
        thread.start()
        threads.append(thread)
        while (left := t0 + (i + 1) * args.every - time.monotonic()) > 0:
            print_done()
            time.sleep(min(left, 0.05))
    for thread in threads:
        thread.join()
    print_done()
    return 0


if __name__ == "__main__":
    sys.exit(main())
