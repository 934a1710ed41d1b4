"""The one loopback rule: which listen hosts only this machine can reach.

The admin API's write guard (``extproc.admin.auth``) and the startup warning of
the settings both ask it, so the warning and the guard never disagree.
"""

from __future__ import annotations

import ipaddress


def is_loopback_host(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 or ::1 (also bracketed or IPv4-mapped); else False."""
    text = host.strip().strip("[]").rstrip(".").lower()
    if text == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        return False  # another host name: may resolve to anything
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback
