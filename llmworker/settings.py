"""Settings of the worker programs: flags over environment variables, each declared once.

The worker programs read their settings the way the extproc reads its own, with the same
machinery (:mod:`extproc.settings_table`): every setting is a row made with :func:`option`
that carries its flag, its environment variable (most have none), its ``--help`` group and
text, and what a valid value looks like; the argparse parser is generated from the rows and
pydantic validates every value, from a flag or the environment alike. A flag wins over its
variable; a blank variable is unset. An invalid value is a :class:`SettingsError` worded
``FLAG=VALUE is invalid: what was expected`` for the first problem, and the programs exit with
code 2.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field

from extproc.settings_table import (
    LOG_LEVELS,
    ErrorStyle,
    LogLevel,
    Number,
    SettingsError,
    SettingsTable,
    Whole,
    option,
    stripped,
    whole,
)

__all__ = [
    "LOG_LEVELS",
    "LogLevel",
    "Number",
    "OptNumber",
    "OptWhole",
    "SettingsError",
    "Whole",
    "WorkerSettings",
    "option",
]

# None (unset) or a value: unlike the router's thresholds, 'none' or '' is not a value here
OptWhole = Annotated[int | None, BeforeValidator(whole)]
OptNumber = Annotated[float | None, BeforeValidator(stripped), Field(allow_inf_nan=False)]


class WorkerSettings(SettingsTable):
    """The base of a worker program's settings table: flags over the declared variables."""

    BLANK_IS_UNSET = True
    ERRORS = ErrorStyle("{where}={value} is invalid: {reason}", every=False)
