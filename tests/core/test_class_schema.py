"""The classes file's schema with plain values: every rule, accepted and refused, with the
message naming the key path, the value and what was expected."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.busy import DECODE, PREFILL, PREFILL_FRAC, BusyThresholds, Share
from extproc.core.classes import ClassConfigError, ClassRegistry, parse_table
from extproc.core.pool import WorkerPool


def table(**cls: Any) -> dict[str, Any]:
    """A one-class document whose class ``a`` has the settings ``cls``."""
    return {"default": "a", "classes": {"a": cls}}


def refused(raw: object) -> ClassConfigError:
    with pytest.raises(ClassConfigError) as info:
        parse_table(raw)
    return info.value


# (document, the class "a" it gives, as (priority, share, status, retry_after, large))
ACCEPTED: list[Any] = [
    pytest.param(table(), (0, Share(1.0, 1.0, 1.0), None, None, None), id="defaults"),
    pytest.param(table(priority=0), (0, Share(1.0, 1.0, 1.0), None, None, None), id="prio-0"),
    pytest.param(table(priority=1000), (1000, Share(1.0, 1.0, 1.0), None, None, None),
                 id="prio-1000"),
    pytest.param(table(share=10), (0, Share(10.0, 10.0, 10.0), None, None, None), id="share-10"),
    pytest.param(table(share=0.001), (0, Share(0.001, 0.001, 0.001), None, None, None),
                 id="share-small"),
    pytest.param(table(share={DECODE: 0.7}), (0, Share(0.7, 1.0, 1.0), None, None, None),
                 id="share-one-threshold"),
    pytest.param(table(share={PREFILL: 0.5, PREFILL_FRAC: 2}),
                 (0, Share(1.0, 0.5, 2.0), None, None, None), id="share-two-thresholds"),
    pytest.param(table(share={}), (0, Share(1.0, 1.0, 1.0), None, None, None),
                 id="share-empty-mapping"),
    *[pytest.param(table(status=s), (0, Share(1.0, 1.0, 1.0), s, None, None), id=f"status-{s}")
      for s in (429, 503, 529)],
    pytest.param(table(status=None, retry_after=None, large_prompt=None),
                 (0, Share(1.0, 1.0, 1.0), None, None, None), id="nulls"),
    pytest.param(table(retry_after=1), (0, Share(1.0, 1.0, 1.0), None, 1, None), id="retry-1"),
    pytest.param(table(retry_after=60), (0, Share(1.0, 1.0, 1.0), None, 60, None),
                 id="retry-60"),
    pytest.param(table(large_prompt={"above_tokens": 1, "share": 0.4}),
                 (0, Share(1.0, 1.0, 1.0), None, None, (1, Share(0.4, 0.4, 0.4))), id="large"),
    pytest.param(table(large_prompt={"above_tokens": 2**31, "share": {DECODE: 0.2}}),
                 (0, Share(1.0, 1.0, 1.0), None, None, (2**31, Share(0.2, 1.0, 1.0))),
                 id="large-mapping-share"),
]  # fmt: skip


@pytest.mark.parametrize(("raw", "expected"), ACCEPTED)
def test_accepted_settings(raw: dict[str, Any], expected: tuple[Any, ...]) -> None:
    c = parse_table(raw).by_name("a")
    large = None if c.large_prompt_tokens is None else (c.large_prompt_tokens, c.large_prompt_share)
    assert (c.priority, c.share, c.status, c.retry_after, large) == expected


# (document, the whole message, or a regex of it when it starts with "^")
REFUSED: list[Any] = [
    # the document
    pytest.param(None, "the document is NoneType, expected a mapping of classes, default, "
                 "header, trusted_marker", id="empty-document"),
    pytest.param([1], "^the document is list", id="list-document"),
    pytest.param({"default": "a", "classes": {"a": {}}, "colour": 1},
                 "colour: unknown key; expected one of classes, default, header, trusted_marker",
                 id="unknown-top-key"),
    pytest.param({"classes": {"a": {}}}, "default: missing; expected a class name",
                 id="no-default"),
    pytest.param({"default": "a"}, "classes: missing; expected a mapping of class name to its "
                 "settings", id="no-classes"),
    pytest.param({"default": "a", "classes": {}}, "classes: expected a mapping of class name to "
                 "its settings, got {}", id="no-class"),
    pytest.param({"default": "a", "classes": ["a"]}, "classes: expected a mapping of class name "
                 "to its settings, got ['a']", id="classes-list"),
    pytest.param({"default": 5, "classes": {"a": {}}},
                 "default: 5 is not a string; expected a class name", id="default-number"),
    pytest.param({"default": "b", "classes": {"a": {}}}, "default: 'b' is not one of the classes",
                 id="default-unknown"),
    # class names
    pytest.param({"default": "a", "classes": {"a": {}, 7: {}}},
                 "classes.7: class name 7 must be 1-64 printable characters", id="name-number"),
    pytest.param({"default": "a", "classes": {"a": {}, "": {}}},
                 "classes.: class name '' must be 1-64 printable characters", id="name-empty"),
    pytest.param({"default": "a", "classes": {"a": {}, "x" * 65: {}}},
                 f"^classes.{'x' * 65}: class name '{'x' * 65}' must be 1-64", id="name-long"),
    pytest.param({"default": "a", "classes": {"a": {}, "b\n": {}}},
                 "^classes.b\n: class name 'b\\\\n' must be 1-64", id="name-unprintable"),
    pytest.param({"default": "a", "classes": {"a": 3}},
                 "classes.a: 3 is not a mapping of class settings", id="class-number"),
    pytest.param(table(colour="red"), "classes.a.colour: unknown key; expected one of priority, "
                 "share, status, retry_after, large_prompt, ttft_p99_target_ms, itl_p99_target_ms",
                 id="unknown-class-key"),
    # priority
    pytest.param(table(priority=-1), "classes.a.priority: -1 is out of range; expected an "
                 "integer 0-1000", id="prio-negative"),
    pytest.param(table(priority=1001), "^classes.a.priority: 1001 is out of range", id="prio-big"),
    pytest.param(table(priority=1.0), "classes.a.priority: 1.0 is not an integer; expected an "
                 "integer 0-1000", id="prio-float"),
    pytest.param(table(priority="1"), "^classes.a.priority: '1' is not an integer",
                 id="prio-string"),
    pytest.param(table(priority=True), "^classes.a.priority: True is not an integer",
                 id="prio-bool"),
    # share
    pytest.param(table(share=0), "classes.a.share: 0 is out of range; expected a share in "
                 "(0, 10], 1 = the configured limit", id="share-0"),
    pytest.param(table(share=-0.5), "^classes.a.share: -0.5 is out of range", id="share-neg"),
    pytest.param(table(share=10.01), "^classes.a.share: 10.01 is out of range", id="share-big"),
    pytest.param(table(share=float("inf")), "^classes.a.share: inf is out of range",
                 id="share-inf"),
    pytest.param(table(share=float("nan")), "^classes.a.share: nan is out of range",
                 id="share-nan"),
    pytest.param(table(share="0.5"), "^classes.a.share: '0.5' is not a number", id="share-text"),
    pytest.param(table(share=True), "^classes.a.share: True is not a number", id="share-bool"),
    pytest.param(table(share=[0.5]), "^classes.a.share: \\[0.5\\] is not a number",
                 id="share-list"),
    pytest.param(table(share={"bogus": 1}), "classes.a.share: unknown threshold 'bogus'; "
                 f"expected {DECODE}, {PREFILL} or {PREFILL_FRAC}", id="share-unknown-threshold"),
    pytest.param(table(share={PREFILL: 0}), f"^classes.a.share.{PREFILL}: 0 is out of range",
                 id="share-threshold-0"),
    pytest.param(table(share={DECODE: "x"}), f"^classes.a.share.{DECODE}: 'x' is not a number",
                 id="share-threshold-text"),
    # status and retry_after
    pytest.param(table(status=500), "classes.a.status: 500 is not one of the allowed values; "
                 "expected one of 429, 503, 529, or null for the overload status", id="status"),
    pytest.param(table(status="429"), "^classes.a.status: '429' is not one of", id="status-text"),
    pytest.param(table(retry_after=0), "classes.a.retry_after: 0 is out of range; expected "
                 "whole seconds 1-60, or null for the estimate", id="retry-0"),
    pytest.param(table(retry_after=61), "^classes.a.retry_after: 61 is out of range",
                 id="retry-61"),
    pytest.param(table(retry_after=2.5), "^classes.a.retry_after: 2.5 is not an integer",
                 id="retry-float"),
    # large_prompt
    pytest.param(table(large_prompt={"above_tokens": 5}), "classes.a.large_prompt: "
                 "{'above_tokens': 5} must have exactly above_tokens and share",
                 id="large-no-share"),
    pytest.param(table(large_prompt={"share": 0.5}), "^classes.a.large_prompt: \\{'share': 0.5\\} "
                 "must have exactly", id="large-no-tokens"),
    pytest.param(table(large_prompt={"above_tokens": 5, "share": 0.5, "x": 1}),
                 "^classes.a.large_prompt.x: unknown key; expected one of above_tokens, share",
                 id="large-extra"),
    pytest.param(table(large_prompt=5), "^classes.a.large_prompt: 5 is not a mapping",
                 id="large-number"),
    pytest.param(table(large_prompt={"above_tokens": 0, "share": 0.5}),
                 "classes.a.large_prompt.above_tokens: 0 is out of range; expected whole "
                 "tokens >= 1", id="large-tokens-0"),
    pytest.param(table(large_prompt={"above_tokens": 2**31 + 1, "share": 0.5}),
                 "^classes.a.large_prompt.above_tokens: 2147483649 is out of range",
                 id="large-tokens-big"),
    pytest.param(table(large_prompt={"above_tokens": 5, "share": 11}),
                 "^classes.a.large_prompt.share: 11 is out of range", id="large-share"),
    pytest.param(table(large_prompt={"above_tokens": 5, "share": {"x": 1}}),
                 "^classes.a.large_prompt.share: unknown threshold 'x'", id="large-share-key"),
    # header and trusted_marker
    pytest.param({**table(), "header": "X-Class"},
                 "header: 'X-Class' is not a lower-case HTTP header name", id="header-upper"),
    pytest.param({**table(), "header": ""}, "^header: '' is not a lower-case", id="header-empty"),
    pytest.param({**table(), "header": "a:b"}, "^header: 'a:b' is not a lower-case",
                 id="header-colon"),
    pytest.param({**table(), "header": 3}, "header: 3 is not a string; expected a lower-case "
                 "HTTP header name", id="header-number"),
    pytest.param({**table(), "trusted_marker": {"value": "x"}},
                 "trusted_marker: {'value': 'x'} needs header (and may have value)",
                 id="marker-no-header"),
    pytest.param({**table(), "trusted_marker": {"header": "m", "x": 1}},
                 "trusted_marker.x: unknown key; expected one of header, value",
                 id="marker-extra"),
    pytest.param({**table(), "trusted_marker": {"header": "M"}},
                 "^trusted_marker.header: 'M' is not a lower-case", id="marker-upper"),
    pytest.param({**table(), "trusted_marker": {"header": "m", "value": 3}},
                 "trusted_marker.value: 3 is not a string; expected a string", id="marker-value"),
    pytest.param({**table(), "trusted_marker": "m"}, "^trusted_marker: 'm' is not a mapping",
                 id="marker-string"),
]  # fmt: skip


@pytest.mark.parametrize(("raw", "message"), REFUSED)
def test_refused_documents_name_the_key_and_the_value(raw: object, message: str) -> None:
    got = str(refused(raw))
    if message.startswith("^"):
        assert re.match(message, got), got
    else:
        assert got == message


def test_the_error_keeps_the_key_path() -> None:
    assert refused(table(share={PREFILL: 0})).loc == ("classes", "a", "share", PREFILL)
    assert refused(table(colour=1)).loc == ("classes", "a", "colour")
    assert refused(table(large_prompt={"above_tokens": 5})).loc == ("classes", "a", "large_prompt")
    assert refused({"default": "a", "classes": {"a": {}, 7: {}}}).loc == ("classes", 7)
    assert refused({"default": "b", "classes": {"a": {}}}).loc == ("default",)
    assert refused([]).loc == ()


def test_a_class_named_like_a_key_is_still_a_class() -> None:
    """Class names live beside keys such as ``share``; the path is read by position."""
    t = parse_table({"default": "share", "classes": {"share": {"share": 0.5}}})
    assert t.by_name("share").share == Share(0.5, 0.5, 0.5)
    err = refused({"default": "share", "classes": {"share": {"share": 0}}})
    assert str(err).startswith("classes.share.share: 0 is out of range")
    err = refused({"default": "share", "classes": {"share": {"colour": 1}}})
    assert str(err).startswith("classes.share.colour: unknown key; expected one of priority")


def test_a_refused_runtime_change_changes_nothing() -> None:
    registry = ClassRegistry(
        parse_table(table(share=0.7, status=429)), WorkerPool(BusyThresholds())
    )
    before = registry.table
    refusals: list[tuple[dict[str, Any], str]] = [
        ({"share": 0}, "classes.a.share: 0 is out of range"),
        ({"status": 500}, "classes.a.status: 500 is not one of"),
        ({"colour": 1}, "classes.a.colour: unknown key"),
        ({"large_prompt": {"above_tokens": 1}}, "classes.a.large_prompt: {'above_tokens': 1} must"),
    ]
    for changes, message in refusals:
        with pytest.raises(ClassConfigError) as info:
            registry.update_class("a", changes)
        assert str(info.value).startswith(message), info.value
        assert registry.table is before and registry.versions.stamps == {}
    updated = registry.update_class("a", {"share": {DECODE: 0.5}, "retry_after": 3})
    assert updated.share == Share(0.5, 1.0, 1.0) and updated.status == 429  # share replaced
    assert updated.retry_after == 3 and registry.table.by_name("a") == updated


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["a", "", "X-Y", "share", DECODE, "priority", "429"]),
)
_KEYS_SEEN = st.one_of(
    st.sampled_from(
        ["classes", "default", "header", "trusted_marker", "a", "share", "priority", "status",
         "retry_after", "large_prompt", "above_tokens", "value", DECODE, PREFILL, PREFILL_FRAC]
    ),
    st.integers(0, 3),
)  # fmt: skip
_DOCS = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_KEYS_SEEN, inner)),
    max_leaves=12,
)


@settings(max_examples=400, derandomize=True, deadline=None)
@given(_DOCS)
def test_any_document_is_a_table_or_one_worded_error(raw: object) -> None:
    """Whatever YAML gives, the result is a table or a ClassConfigError naming a key path
    that the message starts with."""
    try:
        parse_table(raw)
    except ClassConfigError as exc:
        text = str(exc)
        assert text and "Input should" not in text and "Value error" not in text, text
        where = ".".join(map(str, exc.loc))
        assert text.startswith(where) or text.startswith("the document"), (text, exc.loc)
