"""Request classes: shed the sheddable first, keep headroom for critical traffic.

A class is a name, a priority and its share of every busy threshold (critical 1.0 uses the
configured limits; sheddable 0.7 sees a worker as busy at 70 % of them). A class may also
set a prompt size above which its requests use a lower share, so a flood of huge prompts
is shed before short interactive requests of the same class. Classes come from a YAML file
(``--classes-file``), checked once at startup against :mod:`extproc.core.class_schema`; a
request names its class in a header (docs/classes.md). Without a file there is one class
with the full share: the behaviour without classes, exactly.

The pool keeps a busy flag per worker and *variant* (a class, or a class's large-prompt
share): :meth:`ClassTable.variant` maps a request to the index the decision reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from extproc.core.busy import DECODE, FULL_SHARE, PREFILL, PREFILL_FRAC, Share
from extproc.core.class_schema import (
    DEFAULT_HEADER,
    ClassSettings,
    check_class,
    check_table,
    to_share,
)
from extproc.core.class_schema import ClassConfigError as ClassConfigError  # the error of parse_*
from extproc.core.pool import WorkerPool
from extproc.core.replica import Stamp, Versions


@dataclass(frozen=True, slots=True)
class RequestClass:
    """One request class as configured."""

    name: str
    priority: int
    share: Share = FULL_SHARE
    status: int | None = None  # None: the overload status
    retry_after: int | None = None  # None: the estimate
    large_prompt_tokens: int | None = None
    large_prompt_share: Share | None = None
    ttft_p99_target_ms: float | None = None
    itl_p99_target_ms: float | None = None

    @property
    def has_target(self) -> bool:
        return self.ttft_p99_target_ms is not None or self.itl_p99_target_ms is not None

    def as_dict(self) -> dict[str, Any]:
        """The class as the API shows it; a latency target key only while it is set."""
        out = {
            "name": self.name,
            "priority": self.priority,
            "share": _share_dict(self.share),
            "status": self.status,
            "retry_after": self.retry_after,
            "large_prompt": None
            if self.large_prompt_tokens is None or self.large_prompt_share is None
            else {
                "above_tokens": self.large_prompt_tokens,
                "share": _share_dict(self.large_prompt_share),
            },
        }
        if self.ttft_p99_target_ms is not None:
            out["ttft_p99_target_ms"] = self.ttft_p99_target_ms
        if self.itl_p99_target_ms is not None:
            out["itl_p99_target_ms"] = self.itl_p99_target_ms
        return out


def _share_dict(share: Share) -> dict[str, float]:
    return {
        DECODE: share.active_decode_blocks,
        PREFILL: share.active_prefill_tokens,
        PREFILL_FRAC: share.active_prefill_tokens_frac,
    }


@dataclass(frozen=True)
class ClassTable:
    """The classes in force: lookup by name and the variant index of a request."""

    classes: tuple[RequestClass, ...] = (RequestClass("default", 0),)
    default: str = "default"
    header: str = DEFAULT_HEADER
    trusted_marker: tuple[str, str | None] | None = None
    _index: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    _large: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if self.default not in names:
            raise ClassConfigError(
                f"default: {self.default!r} is not one of the classes", ("default",)
            )
        ordered = [self.by_name(self.default)] + [c for c in self.classes if c.name != self.default]
        for i, c in enumerate(ordered):
            self._index[c.name] = i
        n = len(ordered)
        for c in ordered:
            if c.large_prompt_share is not None:
                self._large[c.name] = n
                n += 1

    @property
    def enabled(self) -> bool:
        """More than the single implicit class."""
        return len(self.classes) > 1 or self.classes[0].share != FULL_SHARE

    @property
    def marker_header(self) -> str:
        """The trusted marker's header name, or "" without one."""
        return "" if self.trusted_marker is None else self.trusted_marker[0]

    def trusts(self, marker: str | None) -> bool:
        """Whether the class header counts, given the marker header's value (None: absent)."""
        if self.trusted_marker is None:
            return True
        value = self.trusted_marker[1]
        return marker is not None and (value is None or marker == value)

    def by_name(self, name: str) -> RequestClass:
        for c in self.classes:
            if c.name == name:
                return c
        raise KeyError(name)

    def shares(self) -> list[Share]:
        """The pool's shares by variant index: classes (the default first), then the
        large-prompt shares."""
        out: list[Share] = [FULL_SHARE] * (len(self._index) + len(self._large))
        for c in self.classes:
            out[self._index[c.name]] = c.share
            if c.name in self._large and c.large_prompt_share is not None:
                out[self._large[c.name]] = c.large_prompt_share
        return out

    def resolve(self, name: str | None) -> tuple[RequestClass, bool]:
        """The class a header value names, and whether the name was unknown (it is then
        the default class, counted by the caller)."""
        if name is None:
            return self.by_name(self.default), False
        index = self._index.get(name)
        if index is None:
            return self.by_name(self.default), True
        return self.by_name(name), False

    def variant(self, request_class: RequestClass, prompt_tokens: int) -> int:
        """The pool index (the variant) a request of ``request_class`` with
        ``prompt_tokens`` is decided under."""
        name = request_class.name
        limit = request_class.large_prompt_tokens
        if limit is not None and prompt_tokens > limit and name in self._large:
            return self._large[name]
        return self._index[name]

    def variant_classes(self) -> list[RequestClass]:
        """The class of each variant index (a large-prompt share is its class's)."""
        out = [self.classes[0]] * (len(self._index) + len(self._large))
        for c in self.classes:
            out[self._index[c.name]] = c
            if c.name in self._large:
                out[self._large[c.name]] = c
        return out

    def variant_names(self) -> list[str]:
        """A label per variant index, for diagnostics: the class, or ``class/large``."""
        out = [""] * (len(self._index) + len(self._large))
        for name, i in self._index.items():
            out[i] = name
        for name, i in self._large.items():
            out[i] = f"{name}/large"
        return out


# ----- from the checked schema (extproc.core.class_schema) ------------------------------


def _request_class(name: str, s: ClassSettings) -> RequestClass:
    lp = s.large_prompt
    return RequestClass(
        name,
        s.priority,
        to_share(s.share),
        s.status,
        s.retry_after,
        None if lp is None else lp.above_tokens,
        None if lp is None else to_share(lp.share),
        s.ttft_p99_target_ms,
        s.itl_p99_target_ms,
    )


def parse_class(name: str, raw: object) -> RequestClass:
    """One class's settings (a mapping of the keys of a class in the file)."""
    return _request_class(name, check_class(name, raw))


def parse_table(raw: object) -> ClassTable:
    """A validated :class:`ClassTable` from the parsed YAML document."""
    doc = check_table(raw)
    marker = doc.trusted_marker
    return ClassTable(
        tuple(_request_class(n, c) for n, c in doc.classes.items()),
        doc.default,
        doc.header,
        None if marker is None else (marker.header, marker.value),
    )


class ClassRegistry:
    """The class table in force. The admin API changes one class at a time; the pool's
    flags are recomputed at once and listeners (the handler's pre-built replies) told."""

    def __init__(self, table: ClassTable, pool: WorkerPool) -> None:
        self.pool = pool
        self.table = table
        self.listeners: list[Callable[[ClassTable], None]] = []
        # The version stamps of class changes, by class; its listeners are told of a
        # change made here (to share it with other replicas, to save it).
        self.versions = Versions(pool.replica)
        pool.set_shares(table.shares())

    def update_class(
        self, name: str, changes: dict[str, Any], stamp: Stamp | None = None
    ) -> RequestClass:
        """Apply ``changes`` (keys of a class's settings) to class ``name``; KeyError if no
        such class, ClassConfigError (nothing changed) if the result is not valid.

        A change made here (no ``stamp``) is stamped like a threshold change and announced
        to the listeners of ``versions``; one from another replica applies only if its
        stamp is newer (the class is then returned unchanged when it is not)."""
        current = self.table.by_name(name)
        taken = self.versions.next_stamp(name, stamp)
        if taken is None:
            return current
        raw = {k: v for k, v in current.as_dict().items() if k != "name"}
        raw.update(changes)
        updated = parse_class(name, raw)
        self.versions.record(name, taken)
        table = ClassTable(
            tuple(updated if c.name == name else c for c in self.table.classes),
            self.table.default,
            self.table.header,
            self.table.trusted_marker,
        )
        self.table = table
        self.pool.set_shares(table.shares())
        for listener in self.listeners:
            listener(table)
        if stamp is None:
            self.versions.announce(name)
        return updated
