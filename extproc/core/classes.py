"""Request classes: shed the sheddable first, keep headroom for critical traffic.

A class is a name, a priority and its share of every busy threshold (critical 1.0 uses the
configured limits; sheddable 0.7 sees a worker as busy at 70 % of them). A class may also
set a prompt size above which its requests use a lower share, so a flood of huge prompts
is shed before short interactive requests of the same class. Classes come from a YAML file
(``--classes-file``), validated once at startup; a request names its class in a header
(docs/classes.md). Without a file there is one class with the full share: the behaviour
without classes, exactly.

The pool keeps a busy flag per worker and *variant* (a class, or a class's large-prompt
share): :meth:`ClassTable.variant` maps a request to the index the decision reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from extproc.core.busy import DECODE, FULL_SHARE, PREFILL, PREFILL_FRAC, Share
from extproc.core.pool import WorkerPool

DEFAULT_HEADER = "x-request-class"
REJECTION_STATUSES = (429, 503, 529)
MAX_SHARE = 10.0


class ClassConfigError(ValueError):
    """A class table that cannot be used; the message names the key and the value, and
    ``loc`` is the key path (empty: the whole document)."""

    def __init__(self, message: str, loc: tuple[str | int, ...] = ()) -> None:
        super().__init__(message)
        self.loc = loc


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

    def as_dict(self) -> dict[str, Any]:
        return {
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

    def variant(self, cls: RequestClass, prompt_tokens: int) -> int:
        """The pool index a request of ``cls`` with ``prompt_tokens`` is decided under."""
        limit = cls.large_prompt_tokens
        if limit is not None and prompt_tokens > limit and cls.name in self._large:
            return self._large[cls.name]
        return self._index[cls.name]

    def variant_names(self) -> list[str]:
        """A label per variant index, for diagnostics: the class, or ``class/large``."""
        out = [""] * (len(self._index) + len(self._large))
        for name, i in self._index.items():
            out[i] = name
        for name, i in self._large.items():
            out[i] = f"{name}/large"
        return out


# ----- parsing and validation (pure: the file is read by the caller) -------------------
#
# The schema is a set of strict pydantic models: no string-to-number coercion, no booleans
# for numbers, unknown keys refused. :func:`_problem` words pydantic's first error as
# "<key path>: <value> is <problem>; expected <what>"; the error keeps the key path, so the
# loader can add the line of the file it came from.

Loc = tuple[str | int, ...]
SHARE_EXPECTED = f"a share in (0, {MAX_SHARE:g}], 1 = the configured limit"
_STRICT = ConfigDict(strict=True, extra="forbid", frozen=True)

ShareValue = Annotated[float, Field(gt=0.0, le=MAX_SHARE, allow_inf_nan=False)]


class _ThresholdShares(BaseModel):
    """A share per threshold; a threshold left out keeps the configured limit (1)."""

    model_config = _STRICT
    active_decode_blocks_threshold: ShareValue = 1.0
    active_prefill_tokens_threshold: ShareValue = 1.0
    active_prefill_tokens_threshold_frac: ShareValue = 1.0


def _share_kind(v: Any) -> str:
    return "mapping" if isinstance(v, dict) else "number"


# A number (every threshold) or a mapping of threshold name to share.
ShareSpec = Annotated[
    Annotated[ShareValue, Tag("number")] | Annotated[_ThresholdShares, Tag("mapping")],
    Discriminator(_share_kind),
]


def _to_share(spec: float | _ThresholdShares) -> Share:
    if isinstance(spec, _ThresholdShares):
        return Share(
            spec.active_decode_blocks_threshold,
            spec.active_prefill_tokens_threshold,
            spec.active_prefill_tokens_threshold_frac,
        )
    return Share(spec, spec, spec)


class _LargePrompt(BaseModel):
    model_config = _STRICT
    above_tokens: Annotated[int, Field(ge=1, le=2**31)]
    share: ShareSpec


class _ClassSettings(BaseModel):
    model_config = _STRICT
    priority: Annotated[int, Field(ge=0, le=1000)] = 0
    share: ShareSpec = 1.0
    status: Literal[429, 503, 529] | None = None
    retry_after: Annotated[int, Field(ge=1, le=60)] | None = None
    large_prompt: _LargePrompt | None = None


def _printable(name: str) -> str:
    if not name.isprintable():
        raise PydanticCustomError("printable", "not printable")
    return name


def _header_name(v: str) -> str:
    if not v or v.lower() != v or ":" in v:
        raise PydanticCustomError("header_name", "not a lower-case HTTP header name")
    return v


ClassName = Annotated[str, Field(min_length=1, max_length=64), AfterValidator(_printable)]
HeaderName = Annotated[str, AfterValidator(_header_name)]


class _TrustedMarker(BaseModel):
    model_config = _STRICT
    header: HeaderName
    value: str | None = None


class _ClassesFile(BaseModel):
    model_config = _STRICT
    classes: Annotated[dict[ClassName, _ClassSettings], Field(min_length=1)]
    default: str
    header: HeaderName = DEFAULT_HEADER
    trusted_marker: _TrustedMarker | None = None


# What a valid value of each key looks like, by the key's name.
_EXPECTED = {
    "classes": "a mapping of class name to its settings",
    "default": "a class name",
    "header": "a lower-case HTTP header name",
    "trusted_marker": "a mapping with header (and optionally value), or null",
    "value": "a string",
    "priority": "an integer 0-1000",
    "share": SHARE_EXPECTED,
    **dict.fromkeys((DECODE, PREFILL, PREFILL_FRAC), SHARE_EXPECTED),
    "status": f"one of {', '.join(map(str, REJECTION_STATUSES))}, or null for the overload status",
    "retry_after": "whole seconds 1-60, or null for the estimate",
    "large_prompt": "a mapping with above_tokens and share, or null",
    "above_tokens": "whole tokens >= 1",
}
# The keys of each kind of mapping, and how a mapping with a key missing is described.
_KEYS = {
    "document": list(_ClassesFile.model_fields),
    "class": list(_ClassSettings.model_fields),
    "large_prompt": list(_LargePrompt.model_fields),
    "trusted_marker": list(_TrustedMarker.model_fields),
}
_SHAPES = {
    "large_prompt": "must have exactly above_tokens and share",
    "trusted_marker": "needs header (and may have value)",
}
_NOUNS = {"int": "an integer", "float": "a number", "string": "a string", "bool": "a boolean"}
_RANGE = ("greater_than", "less_than", "finite_number", "too_short", "too_long", "string_too")


def _dotted(loc: Loc) -> str:
    return ".".join(map(str, loc))


def _node(loc: Loc) -> str:
    """What the mapping at ``loc`` is, from its place in the document."""
    if not loc:
        return "document"
    if loc == ("trusted_marker",):
        return "trusted_marker"
    if loc[0] == "classes" and len(loc) >= 2:
        rest = loc[2:]
        if not rest:
            return "class"
        if rest in (("share",), ("large_prompt", "share")):
            return "share"
        if rest == ("large_prompt",):
            return "large_prompt"
    return ""


def _key_path(loc: tuple[str | int, ...]) -> Loc:
    """pydantic's location without the share union's tag (``classes.a.share.number``)."""
    for i in (3, 4):
        if len(loc) > i and _node(loc[:i]) == "share":
            return loc[:i] + loc[i + 1 :]
    return loc


def _problem(err: ErrorDetails, prefix: Loc = ()) -> ClassConfigError:
    """pydantic's error as a message naming the key path, the value and what was expected."""
    loc = _key_path(prefix + tuple(err["loc"]))
    kind, value, where = err["type"], err["input"], _dotted(loc)
    parent = loc[:-1]
    if kind == "extra_forbidden":
        if _node(parent) == "share":
            return ClassConfigError(
                f"{_dotted(parent)}: unknown threshold {loc[-1]!r}; expected "
                f"{DECODE}, {PREFILL} or {PREFILL_FRAC}",
                loc,
            )
        keys = ", ".join(_KEYS.get(_node(parent), []))
        return ClassConfigError(f"{where}: unknown key; expected one of {keys}", loc)
    if kind == "missing":
        shape = _SHAPES.get(_node(parent))
        if shape:
            return ClassConfigError(f"{_dotted(parent)}: {value!r} {shape}", parent)
        return ClassConfigError(f"{where}: missing; expected {_EXPECTED[str(loc[-1])]}", loc)
    if loc[-1:] == ("[key]",):
        return ClassConfigError(
            f"{_dotted(parent)}: class name {parent[-1]!r} must be 1-64 printable characters",
            parent,
        )
    if not loc:
        return ClassConfigError(
            f"the document is {type(value).__name__}, expected a mapping of "
            f"{', '.join(_KEYS['document'])}"
        )
    if loc == ("classes",):
        return ClassConfigError(f"classes: expected {_EXPECTED['classes']}, got {value!r}", loc)
    if _node(loc) == "class":
        return ClassConfigError(f"{where}: {value!r} is not a mapping of class settings", loc)
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        problem = "not a mapping"
    elif kind == "literal_error":
        problem = "not one of the allowed values"
    elif kind.startswith(_RANGE):
        problem = "out of range"
    elif kind.split("_")[0] in _NOUNS:
        problem = f"not {_NOUNS[kind.split('_')[0]]}"
    else:  # our own rules (header names) say what is wrong in full
        return ClassConfigError(f"{where}: {value!r} is {err['msg']}", loc)
    expected = _EXPECTED.get(str(loc[-1]))
    return ClassConfigError(
        f"{where}: {value!r} is {problem}" + (f"; expected {expected}" if expected else ""), loc
    )


def _request_class(name: str, s: _ClassSettings) -> RequestClass:
    lp = s.large_prompt
    return RequestClass(
        name,
        s.priority,
        _to_share(s.share),
        s.status,
        s.retry_after,
        None if lp is None else lp.above_tokens,
        None if lp is None else _to_share(lp.share),
    )


def parse_class(name: str, raw: object) -> RequestClass:
    """One class's settings (a mapping of the keys of a class in the file)."""
    try:
        settings = _ClassSettings.model_validate(raw)
    except ValidationError as exc:
        raise _problem(exc.errors()[0], ("classes", name)) from None
    return _request_class(name, settings)


def parse_table(raw: object) -> ClassTable:
    """A validated :class:`ClassTable` from the parsed YAML document."""
    try:
        doc = _ClassesFile.model_validate(raw)
    except ValidationError as exc:
        raise _problem(exc.errors()[0]) from None
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
        # Told of a change made here (to share it with other replicas), with the class.
        self.change_listeners: list[Callable[[str], None]] = []
        # class -> (version, writer replica): the newest change wins on every replica.
        self.stamps: dict[str, tuple[int, str]] = {}
        pool.set_shares(table.shares())

    def update_class(
        self, name: str, changes: dict[str, Any], stamp: tuple[int, str] | None = None
    ) -> RequestClass:
        """Apply ``changes`` (keys of a class's settings) to class ``name``; KeyError if no
        such class, ClassConfigError (nothing changed) if the result is not valid.

        A change made here (no ``stamp``) is stamped like a threshold change and announced
        to ``change_listeners``; one from another replica applies only if its stamp is
        newer (the class is then returned unchanged when it is not)."""
        current = self.table.by_name(name)
        held = self.stamps.get(name, (0, ""))
        if stamp is not None and stamp <= held:
            return current
        raw = {k: v for k, v in current.as_dict().items() if k != "name"}
        raw.update(changes)
        updated = parse_class(name, raw)
        self.stamps[name] = stamp if stamp is not None else (held[0] + 1, self.pool.replica_id)
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
            for told in self.change_listeners:
                told(name)
        return updated
