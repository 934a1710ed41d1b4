"""The request-classes schema: what the classes file and a runtime change may say.

Strict pydantic models (no string-to-number coercion, no booleans for numbers, unknown keys
refused) for the document (docs/classes.md) and one class's settings. :func:`check_table`
and :func:`check_class` raise :class:`ClassConfigError` worded as
"<key path>: <value> is <problem>; expected <what>", keeping the key path so that the
loader can add the line of the file it came from. Pure: the file is read by the caller.
"""

from __future__ import annotations

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

from extproc.core.busy import (
    DECODE,
    ITL_TARGET,
    MAX_TARGET_MS,
    PREFILL,
    PREFILL_FRAC,
    TTFT_TARGET,
    Share,
)

DEFAULT_HEADER = "x-request-class"
REJECTION_STATUSES = (429, 503, 529)
MAX_SHARE = 10.0
Loc = tuple[str | int, ...]


class ClassConfigError(ValueError):
    """A class table that cannot be used; the message names the key and the value, and
    ``loc`` is the key path (empty: the whole document)."""

    def __init__(self, message: str, loc: Loc = ()) -> None:
        super().__init__(message)
        self.loc = loc


SHARE_EXPECTED = f"a share in (0, {MAX_SHARE:g}], 1 = the configured limit"
_STRICT = ConfigDict(strict=True, extra="forbid", frozen=True)

ShareValue = Annotated[float, Field(gt=0.0, le=MAX_SHARE, allow_inf_nan=False)]
TARGET_EXPECTED = f"a number of milliseconds in (0, {MAX_TARGET_MS}], or null for none"
# A latency target for the class's requests, in ms (docs/latency-target.md).
TargetValue = Annotated[float, Field(gt=0.0, le=float(MAX_TARGET_MS), allow_inf_nan=False)]


class ThresholdShares(BaseModel):
    """A share per threshold; a threshold left out keeps the configured limit (1)."""

    model_config = _STRICT
    active_decode_blocks_threshold: ShareValue = 1.0
    active_prefill_tokens_threshold: ShareValue = 1.0
    active_prefill_tokens_threshold_frac: ShareValue = 1.0


def _share_kind(v: Any) -> str:
    return "mapping" if isinstance(v, dict) else "number"


# A number (every threshold) or a mapping of threshold name to share.
ShareSpec = Annotated[
    Annotated[ShareValue, Tag("number")] | Annotated[ThresholdShares, Tag("mapping")],
    Discriminator(_share_kind),
]


def to_share(spec: float | ThresholdShares) -> Share:
    if isinstance(spec, ThresholdShares):
        return Share(
            spec.active_decode_blocks_threshold,
            spec.active_prefill_tokens_threshold,
            spec.active_prefill_tokens_threshold_frac,
        )
    return Share(spec, spec, spec)


class LargePrompt(BaseModel):
    model_config = _STRICT
    above_tokens: Annotated[int, Field(ge=1, le=2**31)]
    share: ShareSpec


class ClassSettings(BaseModel):
    model_config = _STRICT
    priority: Annotated[int, Field(ge=0, le=1000)] = 0
    share: ShareSpec = 1.0
    status: Literal[429, 503, 529] | None = None
    retry_after: Annotated[int, Field(ge=1, le=60)] | None = None
    large_prompt: LargePrompt | None = None
    ttft_p99_target_ms: TargetValue | None = None
    itl_p99_target_ms: TargetValue | None = None


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


class TrustedMarker(BaseModel):
    model_config = _STRICT
    header: HeaderName
    value: str | None = None


class ClassesFile(BaseModel):
    model_config = _STRICT
    classes: Annotated[dict[ClassName, ClassSettings], Field(min_length=1)]
    default: str
    header: HeaderName = DEFAULT_HEADER
    trusted_marker: TrustedMarker | None = None


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
    TTFT_TARGET: TARGET_EXPECTED,
    ITL_TARGET: TARGET_EXPECTED,
}
# The keys of each kind of mapping, and how a mapping with a key missing is described.
_KEYS = {
    "document": list(ClassesFile.model_fields),
    "class": list(ClassSettings.model_fields),
    "large_prompt": list(LargePrompt.model_fields),
    "trusted_marker": list(TrustedMarker.model_fields),
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
        what = _EXPECTED.get(str(loc[-1]), "a value")
        return ClassConfigError(f"{where}: missing; expected {what}", loc)
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


def check_class(name: str, raw: object) -> ClassSettings:
    """One class's settings (a mapping of the keys of a class in the file)."""
    try:
        return ClassSettings.model_validate(raw)
    except ValidationError as exc:
        raise _problem(exc.errors()[0], ("classes", name)) from None


def check_table(raw: object) -> ClassesFile:
    """The whole document, as parsed from YAML."""
    try:
        return ClassesFile.model_validate(raw)
    except ValidationError as exc:
        raise _problem(exc.errors()[0]) from None
