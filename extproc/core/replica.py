"""This extproc as one replica of several: its id, a counter of changes to its own
estimates, and the version stamps that make the newest change of a shared setting win.

Settings every replica holds a copy of (a model's busy thresholds, a request class) may be
changed on any of them and are shared (docs/replicas.md). Each change carries a stamp
``(version, writer replica id)``. A change made here is stamped one version above the
newest seen for its key, with this replica's id, and announced to the listeners (the
replica publisher, the state file). A change from another replica applies only if its
stamp is newer than the one held. Stamps compare version first, then replica id, so
concurrent changes end in the same state on every replica, whatever the order they
arrive in: the higher version wins, and the higher replica id between equal versions.
"""

from __future__ import annotations

from collections.abc import Callable

# (version, writer replica id); a key never changed holds UNSTAMPED.
Stamp = tuple[int, str]
UNSTAMPED: Stamp = (0, "")


class Replica:
    """Who this extproc is among its replicas, and the change counter of its own estimates."""

    __slots__ = ("estimates_version", "on_estimates", "replica_id")

    def __init__(self, replica_id: str = "") -> None:
        self.replica_id = replica_id
        self.estimates_version = 0
        # Called after every change of this replica's own router estimates.
        self.on_estimates: Callable[[], None] | None = None

    def estimates_changed(self) -> None:
        self.estimates_version += 1
        if self.on_estimates is not None:
            self.on_estimates()


class Versions:
    """The stamps of one kind of shared setting, by key (a model, a class name)."""

    __slots__ = ("listeners", "replica", "stamps")

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.stamps: dict[str, Stamp] = {}
        # Told of a change made here, with its key (to share it, to save it).
        self.listeners: list[Callable[[str], None]] = []

    def next_stamp(self, key: str, stamp: Stamp | None = None) -> Stamp | None:
        """The stamp a change of ``key`` takes, or None when it must be ignored.

        ``stamp`` is another replica's: it is taken if newer than the one held. Without
        it the change is made here: one version above the held one, by this replica.
        Nothing is recorded until :meth:`record`, so a change that fails leaves no trace.
        """
        held = self.stamps.get(key, UNSTAMPED)
        if stamp is None:
            return (held[0] + 1, self.replica.replica_id)
        return stamp if stamp > held else None

    def record(self, key: str, stamp: Stamp) -> None:
        self.stamps[key] = stamp

    def announce(self, key: str) -> None:
        """Tell the listeners that ``key`` was changed here."""
        for listener in self.listeners:
            listener(key)
