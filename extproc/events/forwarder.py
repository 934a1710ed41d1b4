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
from collections.abc import Sequence

import zmq

log = logging.getLogger("extproc.events.forwarder")


class _Stop(Exception):
    """A stop signal arrived."""


def _stop(signum: int, frame: object) -> None:
    raise _Stop


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
    # pyzmq runs Python signal handlers while zmq.proxy waits: SIGTERM and SIGINT end it.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.info("forwarding events from %s to %s", args.xsub, args.xpub)
    try:
        zmq.proxy(xsub, xpub)
    except _Stop:
        log.info("stopping")
    finally:
        xsub.close()
        xpub.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
