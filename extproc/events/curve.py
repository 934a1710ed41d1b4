"""ZeroMQ CURVE on the event plane: who may publish worker load (docs/events.md, "Security").

The extproc's SUB socket is the CURVE server and holds the server key pair. Each publisher
(the simulated worker, the sidecar agent, an engine using :mod:`extproc.events.publisher`)
is a CURVE client with its own key pair and the server's public key. The extproc admits
the publishers whose public keys are in a directory (ZAP, libzmq's authentication
protocol, answered on the event loop). A publisher without the server's public key cannot
finish the handshake, one whose key is not in the directory is refused; either way nothing
it sends reaches the worker pool, and the refusal is counted
(``extproc_events_refused_total{reason}``).

Keys live in files in ZeroMQ's certificate format, never on the command line:
``python -m extproc.events.keys DIR NAME`` writes ``DIR/NAME.key`` (public: give it to
the other side) and ``DIR/NAME.key_secret`` (secret: keep it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

from extproc.background import CURVE_REFUSALS, Guard

log = logging.getLogger("extproc.events.curve")

# Handshake failures seen on the SUB socket, by the reason label they are counted under.
REFUSED_UNKNOWN_KEY = "unknown_key"  # the ZAP handler refused the publisher's key
REFUSED_HANDSHAKE = "handshake_failed"  # no CURVE, or not the server's public key
REFUSED_REASONS = (REFUSED_UNKNOWN_KEY, REFUSED_HANDSHAKE)
_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: REFUSED_UNKNOWN_KEY,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: REFUSED_HANDSHAKE,
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: REFUSED_HANDSHAKE,
}


# After the monitor socket fails to receive, the wait before the next try.
RECV_RETRY_SECONDS = 0.1


class CurveKeyError(ValueError):
    """A key file or directory that cannot be used; the message names the path."""


def load_public_key(path: str | Path) -> bytes:
    """The public key of a certificate file (either half of a pair)."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read a CURVE key from {str(path)!r}: {exc}") from None
    return public


def load_key_pair(path: str | Path) -> tuple[bytes, bytes]:
    """(public, secret) from a ``*.key_secret`` certificate file."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read a CURVE key from {str(path)!r}: {exc}") from None
    if secret is None:
        raise CurveKeyError(
            f"{str(path)!r} holds no secret key; expected the '.key_secret' file of a pair"
        )
    return public, secret


def check_publisher_dir(path: str | Path) -> Path:
    """The directory of admitted publishers' public keys; it must hold at least one."""
    folder = Path(path)
    if not folder.is_dir():
        raise CurveKeyError(f"{str(path)!r} is not a directory of publisher public keys")
    keys = sorted(folder.glob("*.key"))
    if not keys:
        raise CurveKeyError(f"{str(path)!r} holds no '*.key' public key files")
    for key in keys:
        load_public_key(key)
    return folder


@dataclass(frozen=True)
class CurveClient:
    """A publisher's side: its own key pair and the extproc's public key."""

    public: bytes
    secret: bytes
    server_public: bytes

    @classmethod
    def from_files(cls, secret_file: str | Path, server_public_file: str | Path) -> CurveClient:
        public, secret = load_key_pair(secret_file)
        return cls(public, secret, load_public_key(server_public_file))

    def apply(self, sock: Any) -> None:
        """Set the client options on a socket (an aiozmq transport or a zmq socket)."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)


# One ZAP handler per ZeroMQ context (libzmq allows one); each server socket has its own
# ZAP domain in it, with its own admitted keys. context address -> (handler, sockets).
_ZAP: dict[int, tuple[AsyncioAuthenticator, int]] = {}


def _zap_for(context: zmq.Context[Any]) -> AsyncioAuthenticator:
    key = context.underlying
    auth, users = _ZAP.get(key, (None, 0))
    if auth is None:
        auth = AsyncioAuthenticator(context=zmq.asyncio.Context.shadow(key), log=log)
        auth.start()
    _ZAP[key] = (auth, users + 1)
    return auth


def _zap_release(context: zmq.Context[Any]) -> None:
    key = context.underlying
    auth, users = _ZAP.pop(key)
    if users > 1:
        _ZAP[key] = (auth, users - 1)
    else:
        auth.stop()


class CurveServer:
    """The extproc's side: the server key pair, the admitted keys, the refusal count."""

    def __init__(
        self,
        secret_file: str | Path,
        publishers_dir: str | Path,
        on_refused: Callable[[str], None],
        *,
        guard: Guard | None = None,
    ) -> None:
        self.public, self.secret = load_key_pair(secret_file)
        self.publishers = check_publisher_dir(publishers_dir)
        self.on_refused = on_refused
        # A monitor event that cannot be read or counted is itself counted, and the watch
        # goes on with the next one.
        self.guard = guard or Guard(CURVE_REFUSALS)
        self._context: zmq.Context[Any] | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._watch: asyncio.Task[None] | None = None

    def start(self, sock: zmq.Socket[bytes]) -> None:
        """Make ``sock`` a CURVE server (before it binds or connects) and answer ZAP."""
        self._context = sock.context
        domain = f"extproc-{id(self):x}"
        _zap_for(sock.context).configure_curve(domain=domain, location=str(self.publishers))
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        monitor = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        self._monitor = zmq.asyncio.Socket.from_socket(monitor)
        self._watch = asyncio.get_running_loop().create_task(self._count_refusals())

    async def _count_refusals(self) -> None:
        monitor = self._monitor
        assert monitor is not None
        while True:
            try:
                frames = await monitor.recv_multipart()
            except Exception:
                if monitor.closed:
                    return  # stopped
                self.guard.failure()
                await asyncio.sleep(RECV_RETRY_SECONDS)  # not a hot loop on a broken socket
                continue
            self.guard.call(self._count_refusal, frames)

    def _count_refusal(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)
        reason = _FAILED.get(zmq.Event(event["event"]))
        if reason is not None:
            self.on_refused(reason)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("refused a publisher (%s) from %s", reason, event["endpoint"])

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._monitor.close(linger=0)
            self._monitor = None
        if self._context is not None:
            _zap_release(self._context)
            self._context = None
