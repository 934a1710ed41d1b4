"""Header blocks: HPACK decoding with a per-connection cache, literal encoding, request checks.

Requests are decoded with ``hpack``'s decoder (RFC 7541), which keeps the dynamic table
the peer's encoder fills. Replies are HPACK literals without indexing, so the server keeps
no encoder state.
"""

from __future__ import annotations

import hpack

from extproc.transport.h2.frames import COMPRESSION_ERROR, ProtocolError

MAX_HEADER_LIST = 64 << 10
# Decoded header blocks kept per connection (see ``HeaderBlocks.decode``).
HEADER_CACHE = 64
# Request header fields HTTP/2 forbids (RFC 9113 §8.2.2) and the pseudo-headers it defines.
CONNECTION_HEADERS = frozenset(
    ("connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade")
)
REQUEST_PSEUDO = frozenset((":method", ":scheme", ":path", ":authority"))


def hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """``value`` as an HPACK integer with a ``prefix_bits`` prefix (RFC 7541 §5.1)."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: str, value: str) -> bytes:
    """A header as an HPACK literal without indexing: no state shared with the peer."""
    n, v = name.encode(), value.encode()
    return b"\x00" + hpack_int(len(n), 7) + n + hpack_int(len(v), 7) + v


def _hpack_int_at(block: bytes, i: int, prefix_bits: int) -> tuple[int, int]:
    """The HPACK integer at ``block[i]`` and the index after it (RFC 7541 §5.1)."""
    limit = (1 << prefix_bits) - 1
    value = block[i] & limit
    i += 1
    if value < limit:
        return value, i
    shift = 0
    while True:
        b = block[i]
        i += 1
        value += (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def changes_table(block: bytes) -> bool:
    """Whether decoding this HPACK block adds to or resizes the dynamic table (RFC 7541 §6).

    A block that does not is a pure function of its bytes and the table as it stands.
    A malformed block counts as changing it (it is never cached; the decoder reports it).
    """
    i, n = 0, len(block)
    try:
        while i < n:
            b = block[i]
            if b & 0x80:  # indexed field
                _, i = _hpack_int_at(block, i, 7)
                continue
            if b & 0x60:  # literal with incremental indexing, or a table size update
                return True
            # Literal without indexing or never indexed: 4-bit name index, then strings.
            name_index, i = _hpack_int_at(block, i, 4)
            for _ in range(2 if name_index == 0 else 1):
                length, i = _hpack_int_at(block, i, 7)
                i += length
    except IndexError:
        return True
    return i != n


def request_problem(headers: list[tuple[str, str]]) -> str | None:
    """What makes these request headers malformed (RFC 9113 §8.2, §8.3.1), or None."""
    seen: set[str] = set()
    regular = False
    for name, value in headers:
        if name.startswith(":"):
            if regular:
                return f"pseudo-header {name} after a regular header"
            if name not in REQUEST_PSEUDO:
                return f"pseudo-header {name} in a request"
            if name in seen:
                return f"pseudo-header {name} twice"
            if name == ":path" and not value:
                return "empty :path"
            seen.add(name)
            continue
        regular = True
        if name != name.lower():
            return f"header name {name!r} not in lower case"
        if name in CONNECTION_HEADERS:
            return f"connection-specific header {name}"
        if name == "te" and value != "trailers":
            return f"te: {value!r} (only 'trailers' is allowed)"
    missing = [n for n in (":method", ":scheme", ":path") if n not in seen]
    if missing:
        return f"no {', '.join(missing)}"
    return None


class HeaderBlocks:
    """One connection's request header blocks: the HPACK decoder and the blocks seen before."""

    __slots__ = ("cache", "decoder")

    def __init__(self) -> None:
        self.decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_LIST)
        self.cache: dict[bytes, tuple[dict[str, str], str | None]] = {}

    def decode(self, block: bytes) -> tuple[dict[str, str], str | None]:
        """Decode a header block; a repeated one that leaves the table alone is looked up.

        Envoy sends the same block for every ext_proc stream of a connection (its
        dynamic table entries plus a Huffman-coded ``:path`` literal), and decoding
        that in pure Python is a quarter of the per-request CPU. The second value says
        what is malformed in it as request headers (checked once per distinct block).
        """
        cache = self.cache
        cached = cache.get(block)
        if cached is not None:
            return cached
        try:
            headers = [(str(k), str(v)) for k, v in self.decoder.decode(block)]
        except hpack.HPACKError as exc:
            raise ProtocolError(COMPRESSION_ERROR, f"bad header block: {exc}") from None
        decoded = dict(headers), request_problem(headers)
        if changes_table(block):
            cache.clear()  # cached blocks may refer to entries that have moved
        else:
            if len(cache) >= HEADER_CACHE:
                cache.clear()
            cache[block] = decoded
        return decoded
