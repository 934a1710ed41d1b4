"""The request-body budget through the real Envoy in full-duplex mode (envoy/envoy-epp.yaml with
both bodies FULL_DUPLEX_STREAMED, as Istio and Envoy AI Gateway wire an InferencePool): many
large uploads at once hold no more than the budget, the extproc's memory stays under the
budget plus a fixed margin, small requests are routed meanwhile, and the bodies past the
budget get the overload reply at once (``x-shed-reason: body_budget``).

The uploads are raw HTTP/1.1 requests sent in two steps, so that they are all in flight (the
body partly sent, the extproc gathering it) when the memory is read: the extproc's
``extproc_buffered_body_bytes`` says when each has arrived.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.devstack import (
    Envoy,
    Extproc,
    Publisher,
    async_wait_until,
    checkout_file,
    http,
    metric_value,
)
from tests.support.envoy_wirings import full_duplex

CHAT = "/v1/chat/completions"
MIB = 1 << 20
BUDGET_MIB = 32  # large bodies may hold 28 MiB of it; the last 4 MiB are for small ones
LARGEST = BUDGET_MIB * MIB * 7 // 8
SIZE = 2 * MIB  # one large body
TAIL = 4096  # sent once the memory has been read
# What the extproc may use above its idle size besides the budget: the gRPC buffers, the
# bytearrays' spare room, a decided body's copies on its way back to Envoy.
MARGIN = 32 * MIB


def chat_body(size: int) -> bytes:
    """A chat request body of exactly ``size`` bytes."""
    empty = len(json.dumps({"model": "m", "messages": [{"role": "user", "content": ""}]}))
    content = "x" * (size - empty)
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()


def rss(pid: int) -> int:
    """The process's resident set size in bytes (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


class PeakRss:
    """The highest VmRSS of a process while it runs, read every few milliseconds."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak


class Upload:
    """One POST of a chat body to Envoy over HTTP/1.1, sent in two steps; its response is
    read as soon as it comes (a refusal comes before the body is all sent)."""

    def __init__(self, port: int, size: int, *, chunked: bool) -> None:
        self.port = port
        self.body = chat_body(size)
        self.chunked = chunked
        self.status = 0
        self.headers: dict[str, str] = {}
        self.reply = b""
        self.error: str | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None

    async def start(self, first: int) -> None:
        """Connect, send the headers and the first ``first`` bytes of the body."""
        reader, self._writer = await asyncio.open_connection("127.0.0.1", self.port)
        framing = (
            "transfer-encoding: chunked" if self.chunked else f"content-length: {len(self.body)}"
        )
        head = (
            f"POST {CHAT} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"{framing}\r\n\r\n"
        )
        self._writer.write(head.encode())
        self._send(self.body[:first])
        await self._writer.drain()
        self._reading = asyncio.create_task(self._read(reader))

    async def finish(self, first: int) -> None:
        """Send the rest of the body; the response follows."""
        assert self._writer is not None
        self._send(self.body[first:])
        if self.chunked:
            self._writer.write(b"0\r\n\r\n")
        await self._writer.drain()

    def _send(self, data: bytes) -> None:
        assert self._writer is not None
        for i in range(0, len(data), 64 * 1024):
            piece = data[i : i + 64 * 1024]
            self._writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if self.chunked else piece)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            lines = head.split("\r\n")
            self.status = int(lines[0].split(" ")[1])
            for line in lines[1:]:
                if ":" in line:
                    k, v = line.split(":", 1)
                    self.headers[k.strip().lower()] = v.strip()
            if self.headers.get("transfer-encoding") == "chunked":
                while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
                    self.reply += (await reader.readexactly(size + 2))[:-2]
                await reader.readuntil(b"\r\n")
            else:
                length = int(self.headers.get("content-length", "0"))
                self.reply = await reader.readexactly(length)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            self.error = repr(exc)

    @property
    def answered(self) -> bool:
        return self._reading is not None and self._reading.done()

    async def response(self, timeout: float = 20) -> None:
        assert self._reading is not None
        await asyncio.wait_for(self._reading, timeout)

    def close(self) -> None:
        """Drop the connection (the client goes away)."""
        if self._reading is not None:
            self._reading.cancel()
        if self._writer is not None:
            self._writer.transport.abort()


class Picker:
    """The extproc as an Endpoint Picker with a 32 MiB body budget behind a full-duplex
    Envoy; echo workers a and b serve model ``m``."""

    def __init__(self, log_dir: Path, workers: dict[str, int]) -> None:
        self.ext = Extproc(
            log_dir,
            ["--protocol", "epp", "--worker-ttl", "300", "--request-body-budget-mib",
             str(BUDGET_MIB)],
        )  # fmt: skip
        self.envoy = Envoy(
            log_dir, self.ext, [], tweak=full_duplex, source=checkout_file("envoy/envoy-epp.yaml")
        )
        self.pub = Publisher(self.ext.event_endpoint)
        self.endpoints = {f"127.0.0.1:{workers[n]}" for n in ("a", "b")}
        for name in ("a", "b"):
            self.pub.announce(self.ext, name, "m", f"127.0.0.1:{workers[name]}")

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        return metric_value(self.ext.metrics(), name, labels) or 0.0

    async def buffered(self) -> float:
        return await asyncio.to_thread(self.value, "extproc_buffered_body_bytes")

    def small_chat(self) -> None:
        """A small request is routed to one of the workers."""
        body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
        status, _, raw = http("POST", self.envoy.url + CHAT, body)
        assert status == 200, (status, raw)
        assert json.loads(raw)["destination"] in self.endpoints

    def close(self) -> None:
        self.pub.close()
        self.envoy.stop()
        self.ext.stop()


@pytest.fixture(scope="module")
def picker(log_dir: Path, echo_workers: dict[str, int]) -> Iterator[Picker]:
    p = Picker(log_dir, echo_workers)
    yield p
    p.close()


def refused_for_the_budget(up: Upload) -> bool:
    return (
        up.status == 529
        and up.headers.get("x-shed-reason") == "body_budget"
        and up.headers.get("retry-after") == "1"
        and json.loads(up.reply)["code"] == 529
    )


async def small_requests_meanwhile(picker: Picker, n: int) -> None:
    for _ in range(n):
        await asyncio.to_thread(picker.small_chat)


async def test_bodies_past_the_budget_get_the_overload_reply_on_their_headers(
    picker: Picker,
) -> None:
    """Declared lengths are taken at the headers: 14 bodies of 2 MiB fill the 28 MiB that
    large bodies may hold; the next ones are refused before they send a byte."""
    ups = [Upload(picker.envoy.port, SIZE, chunked=False) for _ in range(24)]
    try:
        await asyncio.gather(*(up.start(0) for up in ups))
        fit = LARGEST // SIZE
        assert fit == 14

        async def settled() -> bool:
            answered = sum(up.answered for up in ups)
            return answered == len(ups) - fit and await picker.buffered() == fit * SIZE

        await async_wait_until(settled, 20, "the bodies past the budget answered")
        refused = [up for up in ups if up.answered]
        assert all(refused_for_the_budget(up) for up in refused), [
            (up.status, up.headers, up.error) for up in refused
        ]
        await small_requests_meanwhile(picker, 10)
        admitted = [up for up in ups if not up.answered]
        await asyncio.gather(*(up.finish(0) for up in admitted))
        for up in admitted:
            await up.response()
            assert up.status == 200, (up.status, up.reply[:200], up.error)
            assert json.loads(up.reply)["body_len"] == SIZE
        assert await picker.buffered() == 0
    finally:
        for up in ups:
            up.close()


async def test_many_large_uploads_stay_within_the_budget_and_small_ones_are_routed(
    picker: Picker,
) -> None:
    """40 chunked uploads of 2 MiB (80 MiB in all) through a 32 MiB budget: each is taken
    chunk by chunk, those a chunk does not fit are refused at once, the others stay in
    flight; the extproc's resident memory stays under its idle size + the budget + a fixed
    margin, and small requests are routed meanwhile."""
    n, first = 40, SIZE - TAIL
    await asyncio.to_thread(picker.small_chat)  # warm
    refused_before = picker.value("extproc_request_body_rejections_total", {"reason": "budget"})
    idle = rss(picker.ext.proc.pid)
    peak = PeakRss(picker.ext.proc.pid)
    ups = [Upload(picker.envoy.port, SIZE, chunked=True) for _ in range(n)]
    try:
        await asyncio.gather(*(up.start(first) for up in ups))

        async def in_flight() -> bool:
            # Every upload is refused (answered) or holds all it has sent.
            waiting = sum(not up.answered for up in ups)
            return await picker.buffered() == waiting * first

        await async_wait_until(in_flight, 30, "every upload refused or gathered")
        admitted = [up for up in ups if not up.answered]
        refused = [up for up in ups if up.answered]
        assert 0 < len(admitted) * first <= LARGEST, len(admitted)
        assert all(refused_for_the_budget(up) for up in refused), [
            (up.status, up.headers, up.error) for up in refused
        ]
        counted = picker.value("extproc_request_body_rejections_total", {"reason": "budget"})
        assert counted - refused_before == len(refused)
        await small_requests_meanwhile(picker, 20)
        await asyncio.gather(*(up.finish(first) for up in admitted))
        for up in admitted:
            await up.response()
            assert up.status == 200, (up.status, up.reply[:200], up.error)
            assert json.loads(up.reply)["body_len"] == SIZE
    finally:
        top = peak.stop()
        for up in ups:
            up.close()
    grew = top - idle
    print(f"extproc VmRSS idle {idle / MIB:.1f} MiB, peak {top / MIB:.1f} MiB (+{grew / MIB:.1f})")
    assert grew <= BUDGET_MIB * MIB + MARGIN, f"+{grew / MIB:.1f} MiB"
    assert await picker.buffered() == 0


async def test_clients_that_go_away_mid_upload_give_their_bytes_back(picker: Picker) -> None:
    ups = [Upload(picker.envoy.port, SIZE, chunked=chunked) for chunked in (True, False) * 4]
    try:
        await asyncio.gather(*(up.start(MIB) for up in ups))

        async def held() -> bool:
            return await picker.buffered() == 4 * MIB + 4 * SIZE  # sent, or declared

        await async_wait_until(held, 20, "the uploads gathered")
    finally:
        for up in ups:
            up.close()

    async def released() -> bool:
        return await picker.buffered() == 0

    await async_wait_until(released, 20, "every stream's bytes released")
    await asyncio.to_thread(picker.small_chat)
