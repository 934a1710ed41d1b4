"""Addresses the worker-side processes print, announce and forward to."""

from __future__ import annotations

import socket

from yarl import URL

WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def join_host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def advertised_endpoint(host: str, port: int) -> str:
    """``host:port`` Envoy can reach; a wildcard bind advertises this host's address."""
    if host in WILDCARD_HOSTS:
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
    return join_host_port(host, port)


def join_url(base: URL, path_qs: str) -> URL:
    """``base`` (which may carry a path prefix) followed by a raw path and query."""
    return URL(str(base).rstrip("/") + path_qs, encoded=True)
