"""The proxy's endpoint subset hint (Endpoint Picker protocol), read from request metadata.

A gateway may forward the filter metadata ``envoy.lb.subset_hint`` ->
``x-gateway-destination-endpoint-subset``: the pods' ``ip:port`` the picker must choose
from, as a list of strings or as one comma-separated string (entries of a list may hold
commas too, as the reference picker reads them). :meth:`SubsetHints.read` turns it into a
tuple of addresses (``()`` when present but empty) or ``None`` when absent. A value of any
other shape, or an entry that is not ``ip:port``, is treated as absent and logged, at most
one line per :data:`LOG_EVERY` seconds, naming the value and how many such hints came
since the last line. Parsed hints are cached by value, so a gateway that sends the same
subset on every request costs one lookup.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable, Mapping

from google.protobuf import struct_pb2

from extproc.core.endpoint import parse_endpoint

log = logging.getLogger("extproc.handlers")

SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LOG_EVERY = 60.0
# Distinct hints kept parsed; cleared when exceeded.
CACHE_SIZE = 1024


class MalformedHint(ValueError):
    """The subset hint is not a list or string of ``ip:port``."""


def _address(entry: str) -> str:
    host, _ = parse_endpoint(entry)  # ValueError names the entry
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"endpoint {entry!r}: {host!r} is not an IP address") from None
    return entry


def parse_subset(value: struct_pb2.Value) -> tuple[str, ...]:
    """The addresses of a subset hint, in order, without repeats; raises MalformedHint."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        texts = [value.string_value]
    elif kind == "list_value":
        texts = []
        for item in value.list_value.values:
            if item.WhichOneof("kind") != "string_value":
                raise MalformedHint(f"list entry {_show(item)} is not a string")
            texts.append(item.string_value)
    else:
        raise MalformedHint(f"a {kind or 'missing value'} is not a list or string")
    out: dict[str, None] = {}
    for text in texts:
        for part in text.split(","):
            entry = part.strip()
            if entry:
                try:
                    out[_address(entry)] = None
                except ValueError as exc:
                    raise MalformedHint(str(exc)) from None
    return tuple(out)


def _show(value: struct_pb2.Value) -> str:
    """The hint as the log line names it: JSON-like, cut at 200 characters."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        text = repr(value.string_value)
    elif kind == "list_value":
        text = repr([_plain(v) for v in value.list_value.values])
    else:
        text = repr(_plain(value))
    return text if len(text) <= 200 else text[:197] + "..."


def _plain(value: struct_pb2.Value) -> object:
    kind = value.WhichOneof("kind")
    if kind is None or kind == "null_value":
        return None
    if kind == "struct_value":
        return {k: _plain(v) for k, v in value.struct_value.fields.items()}
    if kind == "list_value":
        return [_plain(v) for v in value.list_value.values]
    return getattr(value, kind)


class SubsetHints:
    """Reads the subset hint of each request; parses each distinct value once."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._parsed: dict[bytes, tuple[str, ...] | MalformedHint] = {}
        self._logged_at: float | None = None
        self._unlogged = 0
        self.malformed = 0  # hints treated as absent, in all

    def read(self, filter_metadata: Mapping[str, struct_pb2.Struct]) -> tuple[str, ...] | None:
        """The subset of one request from its ``metadata_context.filter_metadata``: the
        addresses, ``()`` for an empty subset, None when absent or malformed."""
        namespace = filter_metadata.get(SUBSET_NAMESPACE)
        if namespace is None:
            return None
        value = namespace.fields.get(SUBSET_KEY)
        if value is None:
            return None
        key = value.SerializeToString()
        subset = self._parsed.get(key)
        if subset is None:
            try:
                subset = parse_subset(value)
            except MalformedHint as exc:
                subset = exc.with_traceback(None)
            if len(self._parsed) >= CACHE_SIZE:
                self._parsed.clear()
            self._parsed[key] = subset
        if isinstance(subset, MalformedHint):
            self._malformed(value, subset)
            return None
        return subset

    def _malformed(self, value: struct_pb2.Value, exc: MalformedHint) -> None:
        self.malformed += 1
        self._unlogged += 1
        now = self.clock()
        if self._logged_at is not None and now - self._logged_at < LOG_EVERY:
            return
        self._logged_at = now
        count, self._unlogged = self._unlogged, 0
        log.warning(
            "ignoring the endpoint subset hint %s.%s = %s: %s; expected a list of "
            "\"ip:port\" strings or one comma-separated string. The request is decided as "
            "if no subset were given (%d malformed hint(s) since the last such line; "
            "logged at most every %.0f s)",
            SUBSET_NAMESPACE, SUBSET_KEY, _show(value), exc, count, LOG_EVERY,
        )  # fmt: skip
