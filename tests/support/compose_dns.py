"""A small DNS server for the compose rehearsal: what Docker's embedded DNS does for a
compose network, answering A queries for service names (one record per replica), container
names and hostnames from a JSON file ``{"name": ["10.0.0.3", ...]}`` that it re-reads when
the file changes (scaling, restarts).

    python tests/support/compose_dns.py --bind 10.213.7.2 --records records.json

A name it knows with no A record for the query type (AAAA) gets an empty answer; a name it
does not know gets NXDOMAIN. TTL 0, UDP only (the answers are small).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
from pathlib import Path

TYPE_A = 1
CLASS_IN = 1
FLAG_RESPONSE = 0x8000
FLAG_RD = 0x0100
FLAG_RA = 0x0080
RCODE_FORMERR = 1
RCODE_NXDOMAIN = 3
RCODE_NOTIMP = 4


class Records:
    """The name -> addresses table, re-read when the file's mtime changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mtime: int | None = None
        self._table: dict[str, list[str]] = {}

    def lookup(self, name: str) -> list[str] | None:
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return None
        if mtime != self._mtime:
            table = json.loads(self.path.read_text())
            self._table = {k.lower().rstrip("."): list(v) for k, v in table.items()}
            self._mtime = mtime
        return self._table.get(name.lower().rstrip("."))


def parse_question(packet: bytes) -> tuple[int, int, str, int, int, int]:
    """(id, flags, name, qtype, qclass, end of the question) of a one-question query."""
    if len(packet) < 12:
        raise ValueError("short header")
    ident, flags, qdcount = struct.unpack("!HHH", packet[:6])
    if qdcount != 1:
        raise ValueError(f"{qdcount} questions")
    labels = []
    pos = 12
    while True:
        if pos >= len(packet):
            raise ValueError("truncated name")
        length = packet[pos]
        pos += 1
        if length == 0:
            break
        if length & 0xC0:
            raise ValueError("compressed name in a question")
        labels.append(packet[pos : pos + length].decode("ascii", "replace"))
        pos += length
    if pos + 4 > len(packet):
        raise ValueError("truncated question")
    qtype, qclass = struct.unpack("!HH", packet[pos : pos + 4])
    return ident, flags, ".".join(labels), qtype, qclass, pos + 4


def answer(packet: bytes, records: Records) -> bytes | None:
    """The reply to one query packet, or None for something that is not a query."""
    try:
        ident, flags, name, qtype, qclass, end = parse_question(packet)
    except ValueError:
        if len(packet) < 2:
            return None
        ident = struct.unpack("!H", packet[:2])[0]
        return struct.pack("!HHHHHH", ident, FLAG_RESPONSE | RCODE_FORMERR, 0, 0, 0, 0)
    if flags & FLAG_RESPONSE:
        return None
    question = packet[12:end]
    reply_flags = FLAG_RESPONSE | (flags & FLAG_RD) | FLAG_RA
    if (flags >> 11) & 0xF != 0:  # only standard queries
        return struct.pack("!HHHHHH", ident, reply_flags | RCODE_NOTIMP, 1, 0, 0, 0) + question
    addresses = records.lookup(name)
    if addresses is None:
        return struct.pack("!HHHHHH", ident, reply_flags | RCODE_NXDOMAIN, 1, 0, 0, 0) + question
    answers = b""
    count = 0
    if qtype == TYPE_A and qclass == CLASS_IN:
        for address in addresses:
            # Name: a pointer to the question's name at offset 12.
            answers += struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, 0, 4)
            answers += socket.inet_aton(address)
            count += 1
    return struct.pack("!HHHHHH", ident, reply_flags, 1, count, 0, 0) + question + answers


def serve(bind: str, port: int, records: Records) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((bind, port))
    print(f"dns: answering on {bind}:{port} from {records.path}", flush=True)
    while True:
        packet, peer = sock.recvfrom(4096)
        try:
            reply = answer(packet, records)
        except (OSError, ValueError) as exc:  # a records file caught mid-write, say
            print(f"dns: no answer to {peer}: {exc}", file=sys.stderr, flush=True)
            continue
        if reply is not None:
            sock.sendto(reply, peer)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bind", required=True, help="address to answer on")
    parser.add_argument("--port", type=int, default=53)
    parser.add_argument("--records", type=Path, required=True, help="JSON name -> [addresses]")
    args = parser.parse_args(argv)
    serve(args.bind, args.port, Records(args.records))


if __name__ == "__main__":
    main()
