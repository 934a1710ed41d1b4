"""``--worker-allow``: which announced worker endpoints may receive traffic."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from extproc.core.endpoint import parse_endpoint

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_allow_entry(entry: str) -> Network | tuple[str, int]:
    """A CIDR (or a bare IP) or a ``host:port``; raise ValueError naming the entry."""
    text = entry.strip()
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        pass
    try:
        host, port = parse_endpoint(text)
    except ValueError:
        raise ValueError(
            f"worker allow-list entry {entry!r} is neither a CIDR (10.0.0.0/8) "
            "nor host:port (10.0.0.5:8000)"
        ) from None
    return host.lower(), port


@dataclass(frozen=True)
class WorkerAllowList:
    """Empty = allow every endpoint (Envoy's override_host only uses cluster members)."""

    networks: tuple[Network, ...] = ()
    endpoints: frozenset[tuple[str, int]] = field(default_factory=frozenset)

    @classmethod
    def from_entries(cls, entries: list[str]) -> WorkerAllowList:
        nets: list[Network] = []
        eps: set[tuple[str, int]] = set()
        for entry in entries:
            parsed = parse_allow_entry(entry)
            if isinstance(parsed, tuple):
                eps.add(parsed)
            else:
                nets.append(parsed)
        return cls(tuple(nets), frozenset(eps))

    @property
    def allow_all(self) -> bool:
        return not self.networks and not self.endpoints

    def allows(self, endpoint: str) -> bool:
        if self.allow_all:
            return True
        host, port = parse_endpoint(endpoint)
        if (host.lower(), port) in self.endpoints:
            return True
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(addr in net for net in self.networks)
