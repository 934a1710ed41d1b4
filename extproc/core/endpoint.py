"""``host:port`` of a worker endpoint, as announced in ``config`` events."""

from __future__ import annotations

import ipaddress


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 host in brackets); raise ValueError if invalid."""
    host, sep, port_text = endpoint.rpartition(":")
    if not sep or not host or not port_text.isdigit() or port_text[0] == "0":
        raise ValueError(f"endpoint {endpoint!r} is not host:port")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"endpoint {endpoint!r}: port {port} is outside 1-65535")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"endpoint {endpoint!r}: unclosed IPv6 bracket")
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"endpoint {endpoint!r}: {host} is not an IPv6 address") from None
        return host[1:-1], port
    if ":" in host or any(c.isspace() for c in host) or "/" in host:
        raise ValueError(f"endpoint {endpoint!r}: bad host {host!r} (IPv6 needs brackets)")
    return host, port
