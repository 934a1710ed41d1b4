"""Flag types of the worker programs: errors name the value and what was expected."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pytest

from llmworker import cli


@pytest.mark.parametrize(
    ("kind", "text", "value"),
    [
        (cli.positive_int, " +5 ", 5),
        (cli.non_negative_int, "0", 0),
        (cli.positive_number, "1e3", 1000.0),
        (cli.non_negative_number, "0", 0.0),
        (cli.positive_seconds, "0.25", 0.25),
        (cli.non_negative_seconds, "0", 0.0),
    ],
)
def test_flag_types_accept(kind: Callable[[str], Any], text: str, value: float) -> None:
    assert kind(text) == value


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        (cli.positive_int, "0", "expected an integer >= 1, got '0'"),
        (cli.positive_int, "1.0", "expected an integer >= 1, got '1.0'"),
        (cli.non_negative_int, "-1", "expected an integer >= 0, got '-1'"),
        (cli.positive_number, "x", "expected a number > 0, got 'x'"),
        (cli.positive_number, "-2", "expected a finite number > 0, got '-2'"),
        (cli.positive_number, "nan", "expected a finite number > 0, got 'nan'"),
        (cli.non_negative_number, "-inf", "expected a finite number >= 0, got '-inf'"),
        (cli.positive_seconds, "0", "expected a finite number of seconds > 0, got '0'"),
        (cli.non_negative_seconds, "inf", "expected a finite number of seconds >= 0, got 'inf'"),
    ],
)
def test_flag_types_reject_naming_value_and_expectation(
    kind: Callable[[str], Any], text: str, message: str
) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as info:
        kind(text)
    assert str(info.value) == message
