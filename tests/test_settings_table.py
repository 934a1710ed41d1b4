"""The settings-table machinery the router and the worker programs share: flags over the
declared variables, a blank variable unset or a value as the table says, the two wordings
of an invalid value, ``--help`` generated from the rows, and exit code 2. A small table of
plain values stands in for a program's."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from extproc import settings_table as st
from extproc.settings_table import SettingsError, SettingsTable


class Table(SettingsTable):
    GROUPS: ClassVar[dict[str, tuple[str, str | None]]] = {
        "main": ("main settings", None),
        "more": ("more settings", "Said by the table itself."),
    }
    BLANK_IS_UNSET = True
    ERRORS = st.ErrorStyle("{where}={value} is invalid: {reason}", every=False)

    count: st.Whole = st.option(
        3, "--count", "main", "how many", env="T_COUNT", expected="an integer >= 1", ge=1
    )
    ratio: st.Number = st.option(
        0.5, "--ratio", "main", "a fraction", env="T_RATIO", expected="a number in [0, 1]", le=1
    )
    mode: str = st.option("a", None, "main", "the mode", env="T_MODE", expected="a mode")
    name: str = st.option(..., "--name", "more", "a name", expected="a name")
    tags: list[st.Whole] = st.option(
        list, "--tag", "more", "tags", action="append", expected="whole numbers"
    )
    loud: bool = st.option(False, "--loud", "more", "say more", action="store_true", expected="")


class EveryProblem(Table):
    BLANK_IS_UNSET = False
    ERRORS = st.ErrorStyle("invalid {where} value {value}: {reason}", every=True)


def _error(table: type[SettingsTable], flags: dict[str, Any], env: dict[str, str]) -> str:
    with pytest.raises(SettingsError) as info:
        table.read({"name": "n", **flags}, env)
    return str(info.value)


def test_a_flag_wins_and_only_declared_variables_are_read() -> None:
    env = {"T_COUNT": " 7 ", "T_RATIO": "0.25", "T_MODE": "b", "ratio": "x", "t_count": "x"}
    t = Table.read({"name": "n"}, env)
    assert (t.count, t.ratio, t.mode, t.tags, t.loud) == (7, 0.25, "b", [], False)
    assert Table.read({"name": "n", "count": "9"}, env).count == 9


def test_a_blank_variable_is_unset_or_a_value_as_the_table_says() -> None:
    assert Table.read({"name": "n"}, {"T_COUNT": "  "}).count == 3
    assert _error(EveryProblem, {}, {"T_COUNT": "  "}) == (
        "invalid T_COUNT value '  ': expected an integer >= 1"
    )


@pytest.mark.parametrize("value", ["1.0", "1e3", "1_000", "-0", "0x10", "\u0663", "", "+"])
def test_a_whole_number_is_digits_only(value: str) -> None:
    assert _error(Table, {"count": value}, {}) == (
        f"--count={value!r} is invalid: expected an integer >= 1"
    )


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "2"])
def test_a_number_is_finite_and_in_its_bounds(value: str) -> None:
    assert _error(Table, {}, {"T_RATIO": value}) == (
        f"T_RATIO={value!r} is invalid: expected a number in [0, 1]"
    )


def test_the_two_wordings_first_problem_or_every_problem() -> None:
    flags = {"count": "0", "ratio": "x"}
    assert _error(Table, flags, {}) == "--count='0' is invalid: expected an integer >= 1"
    assert _error(EveryProblem, flags, {}) == (
        "invalid --count value '0': expected an integer >= 1; "
        "invalid --ratio value 'x': expected a number in [0, 1]"
    )


def test_a_repeated_flag_names_the_bad_item_and_a_required_one_is_named() -> None:
    assert _error(Table, {"tags": ["1", "x"]}, {}) == (
        "--tag='x' is invalid: expected whole numbers"
    )
    with pytest.raises(SettingsError, match=r"^--name is required: expected a name$"):
        Table.read({}, {})


def test_help_is_generated_from_the_rows() -> None:
    text = Table.build_parser("prog", "what it does").format_help()
    assert "how many [env T_COUNT] (default: 3)" in text
    assert "a name (required)" in text
    assert "T_MODE (env only): the mode" in text  # a group without a description lists them
    assert "Said by the table itself." in text
    assert "--tag TAG" in text and "--loud" in text and "--mode" not in text


def test_parse_exits_2_naming_the_setting(capsys: pytest.CaptureFixture[str]) -> None:
    parser = Table.build_parser("prog", "what it does")
    assert Table.parse(parser, ["--name", "n", "--tag", "4", "--loud"], {}).tags == [4]
    with pytest.raises(SystemExit) as exited:
        Table.parse(parser, ["--name", "n"], {"T_COUNT": "many"})
    assert exited.value.code == 2
    assert "prog: error: T_COUNT='many' is invalid: expected an integer >= 1" in (
        capsys.readouterr().err
    )
