"""The test harness's own promises that the other tests rely on."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.support.stack import free_port


def test_free_port_is_outside_the_ephemeral_range_and_never_repeats() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    # Outgoing connections take their local port from low upwards; none can take these.
    assert all(1024 <= p < low for p in ports), [p for p in ports if not 1024 <= p < low]
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # still free
