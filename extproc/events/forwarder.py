"""``python -m extproc.events.forwarder``: one event bus for many extproc replicas.

libzmq's own proxy between an XSUB socket, which every publisher connects to (workers,
sidecar agents, extproc replicas sharing their estimates), and an XPUB socket, which
every extproc's SUB socket connects to. It keeps no state: run two for redundancy and
connect every side to both (duplicates are harmless: every message is a whole state).
See docs/replicas.md.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence

import zmq

log = logging.getLogger("extproc.events.forwarder")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m extproc.events.forwarder",
        description="Forward worker and replica events from publishers to every extproc.",
    )
    parser.add_argument(
        "--xsub",
        default="tcp://127.0.0.1:5557",
        metavar="ENDPOINT",
        help="where publishers connect (bind). Default: tcp://127.0.0.1:5557",
    )
    parser.add_argument(
        "--xpub",
        default="tcp://127.0.0.1:5558",
        metavar="ENDPOINT",
        help="where each extproc's SUB socket connects (bind). Default: tcp://127.0.0.1:5558",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx = zmq.Context()
    xsub, xpub = ctx.socket(zmq.XSUB), ctx.socket(zmq.XPUB)
    for sock in (xsub, xpub):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 200_000)
        sock.setsockopt(zmq.SNDHWM, 200_000)
    for sock, endpoint, what in ((xsub, args.xsub, "--xsub"), (xpub, args.xpub, "--xpub")):
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            print(f"{parser.prog}: error: cannot bind {what} {endpoint}: {exc}", file=sys.stderr)
            return 1
    # The proxy runs in a thread, steered over an inproc socket; this thread waits for
    # SIGTERM or SIGINT and tells it to stop.
    stops = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    control = ctx.socket(zmq.PAIR)
    control.bind("inproc://forwarder-control")
    steer = ctx.socket(zmq.PAIR)
    steer.connect("inproc://forwarder-control")
    proxy = threading.Thread(
        target=zmq.proxy_steerable, args=(xsub, xpub, None, steer), name="proxy"
    )
    proxy.start()
    log.info("forwarding events from %s to %s", args.xsub, args.xpub)
    signal.sigwait(stops)
    log.info("stopping")
    control.send(b"TERMINATE")
    proxy.join(5)
    for sock in (control, steer, xsub, xpub):
        sock.close(linger=0)
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
