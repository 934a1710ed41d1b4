"""What a gRPC server hands each stream to: a ``Session`` made from the call's metadata.

Both servers (the builtin one and grpcio's) deliver a stream's messages to its session in
order. ``Session.receive`` answers at once with the reply bytes, a list of replies sent in
order, or ``None`` for no reply; or with a ``Deferred`` pair when the answer must wait (the
router queue): its ``first`` reply is sent now and its ``rest`` awaited, while later
messages of that stream wait their turn.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

# A reply that waits, ``(first, rest)``: ``first`` goes out now, the awaited ``rest`` (one
# reply or a list) after it. A plain tuple, so that a session needs nothing from the
# transport to answer with one.
Deferred = tuple[bytes, Awaitable["bytes | list[bytes]"]]


class StatusError(Exception):
    """Raised by ``Session.receive`` to end the call with this gRPC status."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Session(Protocol):
    """One gRPC stream's handler: messages in, replies out, ``close`` exactly once."""

    def receive(self, message: bytes) -> bytes | list[bytes] | Deferred | None: ...

    def close(self) -> None: ...


SessionFactory = Callable[[Mapping[str, str]], Session]
