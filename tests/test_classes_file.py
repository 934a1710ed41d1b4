"""The classes file as the service reads it: an error names the file, the line of the key,
the key path and the value; a syntax error names the line and column."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.settings import SettingsError, load_class_table, load_settings

GOOD = """\
default: standard
header: x-request-class
trusted_marker:
  header: x-request-class-trusted
  value: secret
classes:
  critical:
    priority: 0
    share: 1.0
  standard:
    priority: 1
    share:
      active_decode_blocks_threshold: 0.9
  sheddable:
    priority: 2
    share: 0.7
    status: 429
    retry_after: 5
    large_prompt:
      above_tokens: 4000
      share: 0.4
"""


def _error(tmp_path: Path, text: str) -> str:
    path = tmp_path / "classes.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_class_table(str(path))
    message = str(info.value)
    assert message.startswith(str(path)), message
    return message.removeprefix(str(path))


def _edit(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new)


def test_the_good_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "classes.yaml"
    path.write_text(GOOD)
    table = load_class_table(str(path))
    assert [c.name for c in table.classes] == ["critical", "standard", "sheddable"]
    assert table.trusted_marker == ("x-request-class-trusted", "secret")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (_edit("share: 0.7", "share: 0"), ", line 16: classes.sheddable.share: 0 is out of range"),
        (
            _edit("threshold: 0.9", "threshold: x"),
            ", line 13: classes.standard.share.active_decode_blocks_threshold: 'x' is not a number",
        ),
        (_edit("status: 429", "status: 500"), ", line 17: classes.sheddable.status: 500 is not"),
        (
            _edit("above_tokens: 4000", "above_tokens: -1"),
            ", line 20: classes.sheddable.large_prompt.above_tokens: -1 is out of range",
        ),
        (
            _edit("      share: 0.4\n", ""),
            ", line 19: classes.sheddable.large_prompt: {'above_tokens': 4000} must have exactly",
        ),
        (_edit("    priority: 1\n", "    colour: red\n"), ", line 11: classes.standard.colour: "),
        (_edit("default: standard", "default: vip"), ", line 1: default: 'vip' is not one of"),
        (_edit("header: x-request-class\n", "header: X\n"), ", line 2: header: 'X' is not"),
        (_edit("  value: secret", "  value: 3"), ", line 5: trusted_marker.value: 3 is not"),
        (_edit("  critical:", "  7:"), ", line 7: classes.7: class name 7 must be"),
        (_edit("classes:", "extra: 1\nclasses:"), ", line 6: extra: unknown key"),
        # flow style: the line of the key inside the braces
        (
            "default: a\nclasses:\n  b: {}\n  a: {priority: 1,\n    share: 0}\n",
            ", line 5: classes.a.share: 0 is out",
        ),
        # no line to point at: the document itself
        ("", ": the document is NoneType, expected a mapping"),
        ("- a\n", ", line 1: the document is list, expected a mapping"),
    ],
)
def test_an_error_names_the_line_and_the_key(tmp_path: Path, text: str, message: str) -> None:
    got = _error(tmp_path, text)
    assert got.startswith(message), got


def test_a_repeated_key_points_at_the_one_that_counts(tmp_path: Path) -> None:
    text = "default: a\nclasses:\n  a: {share: 1}\n  a: {share: 0}\n"
    assert _error(tmp_path, text).startswith(", line 4: classes.a.share: 0 is out of range")


def test_a_syntax_error_names_the_line_and_column(tmp_path: Path) -> None:
    got = _error(tmp_path, "default: a\nclasses:\n  a: {share: 1\n")
    assert got.startswith(" is not valid YAML at line 4, column 1:"), got


def test_settings_refuse_the_file_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "classes.yaml"
    path.write_text(_edit("share: 0.7", "share: 0"))
    with pytest.raises(SettingsError) as info:
        load_settings(["--classes-file", str(path)], {})
    assert f"invalid --classes-file value {str(path)!r}: {path}, line 16: classes." in str(
        info.value
    )
    with pytest.raises(SettingsError, match="cannot read the classes file"):
        load_settings([], {"EXTPROC_CLASSES_FILE": str(tmp_path / "missing.yaml")})
