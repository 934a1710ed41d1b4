"""Header blocks without a socket: the per-connection decode cache and what it reports."""

from __future__ import annotations

import hpack
import pytest

from extproc.transport.h2.frames import COMPRESSION_ERROR, ProtocolError
from extproc.transport.h2.headers import HEADER_CACHE, HeaderBlocks

REQUEST = [(":method", "POST"), (":scheme", "http"), (":path", "/p"), ("x-prefix", "one")]


def _string(text: str) -> bytes:
    raw = text.encode()
    return bytes((len(raw),)) + raw  # short strings only, no Huffman


def _block(path: str, *extra: tuple[str, str]) -> bytes:
    """:method POST, :scheme http, then literals without indexing: the table stays as it is."""
    block = b"\x83\x86\x04" + _string(path)
    for name, value in extra:
        block += b"\x00" + _string(name) + _string(value)
    return block


def test_a_repeated_block_is_looked_up_until_the_table_changes() -> None:
    enc, blocks = hpack.Encoder(), HeaderBlocks()
    first = enc.encode(REQUEST)  # adds its fields to the table: not cached
    assert blocks.decode(first) == (dict(REQUEST), None)
    assert blocks.cache == {}
    again = enc.encode(REQUEST)  # the same fields, indexed now
    decoded = blocks.decode(again)
    assert decoded == (dict(REQUEST), None)
    assert blocks.decode(again) is decoded
    blocks.decode(enc.encode([("x-prefix", "two")]))  # moves the table's entries
    assert blocks.cache == {}


def test_the_cache_holds_at_most_its_bound() -> None:
    blocks = HeaderBlocks()
    for i in range(HEADER_CACHE + 1):
        blocks.decode(_block(f"/p{i}"))
        assert len(blocks.cache) <= HEADER_CACHE
    assert list(blocks.cache) == [_block(f"/p{HEADER_CACHE}")]  # emptied when full


def test_a_malformed_block_is_a_compression_error_and_is_not_kept() -> None:
    blocks = HeaderBlocks()
    with pytest.raises(ProtocolError) as err:
        blocks.decode(b"\xff\xff\xff\xff\x0f")  # an index far past both tables
    assert err.value.code == COMPRESSION_ERROR
    assert str(err.value).startswith("bad header block: ")
    assert blocks.cache == {}


def test_what_is_wrong_with_the_request_comes_with_the_block() -> None:
    blocks = HeaderBlocks()
    good = _block("/p", ("te", "trailers"))
    bad = _block("/p", ("te", "gzip"))
    assert blocks.decode(good)[1] is None
    assert blocks.decode(bad)[1] == "te: 'gzip' (only 'trailers' is allowed)"
    assert blocks.decode(bad) is blocks.cache[bad]
