"""The process-wide budget for request bodies gathered before a decision.

A filter in FULL_DUPLEX_STREAMED mode sends the request body in chunks and the extproc
gathers all of it before deciding. Each stream's gathered bytes are taken from one budget
shared by every stream; a stream whose body would take the total past it is refused (the
handler answers the overload reply and drops what the stream held), the others go on.

The last eighth of the budget is kept for small bodies (at most :data:`SMALL_BODY` bytes,
or the reserve itself when that is smaller): a burst of large uploads cannot fill the budget
and turn away ordinary chat requests. A body larger than :attr:`BodyBudget.largest` can never
be gathered, however idle the process is.

Each stream's holding is keyed by the stream object; :meth:`BodyBudget.release` returns all
of it and must be called when the stream ends, whatever ended it.
"""

from __future__ import annotations

# Default budget: 256 MiB, eight 32 MiB bodies at once (a 1 GiB container keeps room for
# the rest of the process and the copies a decided body makes on its way back to Envoy).
DEFAULT_BUDGET_MIB = 256
MAX_BUDGET_MIB = 1 << 20  # 1 TiB
MIB = 1 << 20
# A body of at most this many bytes may use the reserve (a 16k-token prompt is ~64 KiB).
SMALL_BODY = 256 * 1024
# Seconds between two log lines about refused bodies.
LOG_EVERY = 60.0


class BodyBudget:
    """Bytes held by the streams gathering a request body, within ``limit`` in all."""

    __slots__ = ("_held", "_logged_at", "_unlogged", "largest", "limit", "reserve", "small", "used")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"body budget must be at least 1 byte, got {limit}")
        self.limit = limit
        # Kept for small bodies: large ones stop at limit - reserve.
        self.reserve = limit // 8
        self.small = min(SMALL_BODY, self.reserve)
        # The largest body that can ever be taken.
        self.largest = limit - self.reserve
        self.used = 0
        self._held: dict[object, int] = {}
        self._logged_at: float | None = None
        self._unlogged = 0

    def held(self, stream: object) -> int:
        """Bytes ``stream`` holds now."""
        return self._held.get(stream, 0)

    def take(self, stream: object, n: int) -> bool:
        """Add ``n`` bytes to ``stream``'s holding; False (nothing taken) when the total
        would pass the budget: the whole of it for a small body, all but the reserve for a
        larger one."""
        if n <= 0:
            return True
        total = self._held.get(stream, 0) + n
        ceiling = self.limit if total <= self.small else self.limit - self.reserve
        if self.used + n > ceiling:
            return False
        self._held[stream] = total
        self.used += n
        return True

    def release(self, stream: object) -> int:
        """Return everything ``stream`` holds (nothing when it holds nothing); the bytes."""
        n = self._held.pop(stream, 0)
        self.used -= n
        return n

    def refused(self, now: float) -> int | None:
        """Count a body refused at ``now`` (seconds); when a log line is due (the first
        refusal, then at most one every LOG_EVERY s), the refusals it reports, else None."""
        self._unlogged += 1
        if self._logged_at is not None and now - self._logged_at < LOG_EVERY:
            return None
        self._logged_at = now
        count, self._unlogged = self._unlogged, 0
        return count

    @property
    def streams(self) -> int:
        """Streams holding bytes now."""
        return len(self._held)
