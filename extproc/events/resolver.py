"""The addresses behind an endpoint a worker announced by host name.

Envoy names the host that served a response by its ``ip:port`` (``%UPSTREAM_HOST%``, the
Endpoint Picker protocol's served-endpoint metadata), and a gateway's endpoint subset names
pods the same way. A worker may announce ``name:port`` instead; the pool matches both only
once it knows the name's addresses. They are looked up here, off the request path: when a
``config`` event names an endpoint whose host is not an IP literal, with the event loop's
non-blocking ``getaddrinfo``, then again on a later ``config`` once the answer is older than
:data:`REFRESH_SECONDS` (a pod behind a name may move). One lookup per endpoint at a time. A
failed lookup is logged once per endpoint and tried again on the next ``config``; until an
answer comes the endpoint matches only as announced.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Callable

from extproc.core.pool import WorkerPool
from extproc.core.worker import Worker

log = logging.getLogger("extproc.events")

# How old an answer may be before the next ``config`` of the worker looks the name up again.
REFRESH_SECONDS = 30.0
# What one lookup may take before it counts as failed.
LOOKUP_TIMEOUT = 5.0


def split_endpoint(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of ``host:port`` (an IPv6 host loses its brackets); None if malformed."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.removeprefix("[").removesuffix("]"), int(port)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def as_endpoint(ip: str, port: int) -> str:
    """``ip:port`` as Envoy writes a host: an IPv6 address in brackets."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class EndpointResolver:
    """Looks up announced host names and gives their addresses to the pool."""

    def __init__(
        self,
        pool: WorkerPool,
        lookup: Callable[[str, int], asyncio.Future[list[str]]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.clock = clock
        self._lookup = lookup or _getaddrinfo
        self._answered: dict[str, float] = {}  # endpoint -> when its last answer came
        self._pending: set[str] = set()  # endpoints being looked up
        self._failed: set[str] = set()  # endpoints whose failure was logged
        self._tasks: set[asyncio.Task[None]] = set()

    def announced(self, worker: Worker) -> None:
        """A ``config`` of ``worker`` was applied: look its host name up if due."""
        endpoint = worker.endpoint
        parts = split_endpoint(endpoint)
        if parts is None or is_ip(parts[0]):
            return
        if endpoint in self._pending:
            return
        answered = self._answered.get(endpoint)
        fresh = answered is not None and self.clock() - answered < REFRESH_SECONDS
        if fresh and endpoint in self.pool.resolved:
            return
        self._pending.add(endpoint)
        task = asyncio.get_running_loop().create_task(self._resolve(endpoint, *parts))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, endpoint: str, host: str, port: int) -> None:
        try:
            ips = await asyncio.wait_for(self._lookup(host, port), LOOKUP_TIMEOUT)
        except Exception as exc:  # a lookup failure is the name's problem, not ours
            if endpoint not in self._failed:
                self._failed.add(endpoint)
                log.warning(
                    "cannot resolve announced endpoint %s (%s): responses Envoy reports by IP "
                    "are matched to it only as announced until it resolves",
                    endpoint,
                    exc or type(exc).__name__,
                )
            return
        finally:
            self._pending.discard(endpoint)
        self._answered[endpoint] = self.clock()
        self._failed.discard(endpoint)
        self.pool.set_addresses(endpoint, frozenset(as_endpoint(ip, port) for ip in ips))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _getaddrinfo(host: str, port: int) -> asyncio.Future[list[str]]:
    async def lookup() -> list[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return sorted({str(info[4][0]) for info in infos})

    return asyncio.ensure_future(lookup())
