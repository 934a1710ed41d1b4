"""``python -m extproc.devstack.ttft`` against a real local HTTP server: a streamed 200 is
timed at its first body byte, a refusal shows its shed reason and retry headers, lines come
in the order sent, and a server that is not there is a line with the error, not a crash."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from extproc.devstack import free_port
from extproc.devstack.ttft import main

FIRST_TOKEN_S = 0.3


class Handler(BaseHTTPRequestHandler):
    calls = 0

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        assert body["stream"] is True and body["model"] == "smollm2", body
        Handler.calls += 1
        if Handler.calls == 1:  # the first is refused at once
            self.send_response(529)
            self.send_header("x-shed-reason", "deadline")
            self.send_header("retry-after", "1")
            self.send_header("retry-after-ms", "250")
            self.send_header("content-length", "0")
            self.end_headers()
            return
        self.send_response(200)  # headers at once, the first token later (as llama-server)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        self.wfile.flush()
        time.sleep(FIRST_TOKEN_S)
        self.wfile.write(b"data: {}\n\n")
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    Handler.calls = 0
    srv = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_each_request_is_one_line_in_the_order_sent(
    server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--url", server, "--count", "2", "--every", "0.1", "--timeout", "10"]) == 0
    refused, served = capsys.readouterr().out.splitlines()
    assert refused.startswith("t=  0.0s  529  first byte")
    assert refused.endswith("x-shed-reason: deadline  retry-after: 1  retry-after-ms: 250")
    assert served.startswith("t=  0.1s  200  first byte") and "x-shed" not in served
    first_ms = int(served.split("first byte")[1].split("ms")[0])
    assert FIRST_TOKEN_S * 1000 <= first_ms < 5000  # the first body byte, not the headers


def test_a_server_that_is_not_there_is_a_line_not_a_crash(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["--url", url, "--count", "1", "--timeout", "5"]) == 0
    (out,) = capsys.readouterr().out.splitlines()
    assert out.startswith("t=  0.0s  0  first byte") and "ConnectionRefusedError" in out


def test_bad_arguments_are_refused_naming_them() -> None:
    with pytest.raises(SystemExit):
        main(["--count", "0"])
