"""Version stamps of shared settings, with plain values: the newest change wins."""

from __future__ import annotations

import itertools

from extproc.core.replica import UNSTAMPED, Replica, Versions


def test_a_change_made_here_is_one_version_above_the_held_one_by_this_replica() -> None:
    versions = Versions(Replica("r1"))
    assert versions.next_stamp("m") == (1, "r1")
    versions.record("m", (7, "zz"))
    assert versions.next_stamp("m") == (8, "r1")
    assert versions.next_stamp("other") == (1, "r1")  # stamps are per key


def test_another_replicas_change_applies_only_when_newer() -> None:
    versions = Versions(Replica("me"))
    versions.record("m", (3, "b"))
    assert versions.next_stamp("m", (2, "z")) is None  # older version
    assert versions.next_stamp("m", (3, "a")) is None  # same version, lower id
    assert versions.next_stamp("m", (3, "b")) is None  # the same change again
    assert versions.next_stamp("m", (3, "c")) == (3, "c")
    assert versions.next_stamp("m", (4, "a")) == (4, "a")
    assert versions.next_stamp("new", (1, "")) == (1, "")


def test_nothing_is_recorded_until_the_change_applied() -> None:
    versions = Versions(Replica("me"))
    assert versions.next_stamp("m") == (1, "me")
    assert versions.stamps == {} and versions.stamps.get("m", UNSTAMPED) == (0, "")


def test_every_order_of_the_same_changes_ends_in_the_same_stamp() -> None:
    changes = [(1, "r1"), (1, "r2"), (2, "r1"), (2, "r0")]
    ends = set()
    for order in itertools.permutations(changes):
        versions = Versions(Replica("local"))
        for stamp in order:
            taken = versions.next_stamp("m", stamp)
            if taken is not None:
                versions.record("m", taken)
        ends.add(versions.stamps["m"])
    assert ends == {(2, "r1")}


def test_the_id_is_read_when_stamping_and_announce_tells_the_listeners() -> None:
    replica = Replica()
    versions = Versions(replica)
    told: list[str] = []
    versions.listeners.append(told.append)
    replica.replica_id = "set-later"  # the id is known only once the service starts
    assert versions.next_stamp("m") == (1, "set-later")
    versions.announce("m")
    assert told == ["m"]


def test_the_estimates_counter_tells_its_listener_after_each_change() -> None:
    replica = Replica("r")
    seen: list[int] = []
    replica.estimates_changed()  # no listener yet: counted all the same
    replica.on_estimates = lambda: seen.append(replica.estimates_version)
    replica.estimates_changed()
    replica.estimates_changed()
    assert seen == [2, 3]
