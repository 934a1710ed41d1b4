"""A settings table: command-line flags over environment variables, each setting declared once.

The idiom of the extproc's settings and of the worker programs'. Every setting is a field of a
pydantic-settings model made with :func:`option`: its type and bounds, default, flag,
environment variable (or none), ``--help`` group and text, and what a valid value looks like.
The argparse parser is generated from the fields, pydantic-settings reads the declared
variables and no others (case-sensitive), and pydantic validates every value, from a flag or
the environment alike. A flag wins over its variable. An invalid value is a
:class:`SettingsError` naming the flag or variable, the value and what was expected; the
programs exit with code 2.

pydantic-settings' own CLI source is not used: it groups ``--help`` only by nested models
(which would rename the attributes the programs read), does not show the environment
variables, and its errors name the field rather than the flag.

Both the router and ``llmworker`` build on this module, so it imports neither.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, Self, get_args

from pydantic import BeforeValidator, Field, ValidationError
from pydantic.json_schema import JsonDict
from pydantic_core import PydanticCustomError, PydanticUndefined
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

_WHOLE = re.compile(r"^\+?[0-9]+$")


class SettingsError(ValueError):
    """An invalid setting; the message names the flag or variable, the value and what was
    expected."""


# value shapes, applied before pydantic's type and bound checks -----------------------


def invalid() -> PydanticCustomError:
    """An error shown as the setting's own "expected ..." text."""
    return PydanticCustomError("invalid", "invalid value")


def stripped(v: Any) -> Any:
    """A string without surrounding spaces; anything else unchanged."""
    return v.strip() if isinstance(v, str) else v


def upper(v: Any) -> Any:
    return v.strip().upper() if isinstance(v, str) else v


def lower(v: Any) -> Any:
    return v.strip().lower() if isinstance(v, str) else v


def whole(v: Any) -> Any:
    """Digits only (an optional '+'; spaces ignored): no '1.0', '1e3', '1_000' or '-0'."""
    if v is None or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    digits = str(v).strip()
    if isinstance(v, bool) or not digits.isascii() or not _WHOLE.match(digits):
        raise invalid()
    return int(digits)


Whole = Annotated[int, BeforeValidator(whole)]
Number = Annotated[float, BeforeValidator(stripped), Field(allow_inf_nan=False)]  # finite
LogLevel = Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], BeforeValidator(upper)]
LOG_LEVELS: tuple[str, ...] = get_args(get_args(LogLevel)[0])


# the rows -----------------------------------------------------------------------------

Action = Literal["append", "store_true", "toggle"]
_ACTIONS: dict[str, Any] = {
    "append": "append",
    "store_true": "store_true",
    "toggle": argparse.BooleanOptionalAction,  # --flag / --no-flag
}


def option(
    default: Any,
    flag: str | None,
    group: str,
    help: str,
    *,
    expected: str,
    env: str | None = None,
    metavar: str | None = None,
    action: Action | None = None,
    choices: Sequence[str] | None = None,
    **bounds: Any,
) -> Any:
    """One row of a settings table: a pydantic Field carrying its flag and ``--help`` text.

    ``default`` ``...`` makes the setting required, a callable is called for each new table
    (a list); ``flag`` None means env only; ``env`` is the variable pydantic-settings reads
    (None: the flag only); ``metavar`` names the value's unit in ``--help``; ``expected`` is
    what an error says a valid value looks like; ``bounds`` are pydantic Field constraints.
    """
    extra: JsonDict = {
        "flag": flag,
        "env": env,
        "group": group,
        "expected": expected,
        "metavar": metavar,
        "action": action,
        "choices": None if choices is None else list(choices),
    }
    common: dict[str, Any] = {
        "validation_alias": env,
        "description": help,
        "json_schema_extra": extra,
        **bounds,
    }
    if callable(default):
        return Field(default_factory=default, **common)
    return Field(PydanticUndefined if default is ... else default, **common)


class ErrorStyle(NamedTuple):
    """How a table words an invalid value.

    ``invalid`` is formatted with ``where`` (the flag, or the variable the value came from),
    ``value`` (its repr) and ``reason``; ``every`` reports every problem, joined by '; ',
    else only the first in the table's order.
    """

    invalid: str
    every: bool


# the environment ----------------------------------------------------------------------

_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("settings_environ", default=None)


class _Environment(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping (os.environ by default),
    reading only the variables the table declares (a field's name is not a variable)."""

    def __init__(
        self, settings_cls: type[SettingsTable], environ: Mapping[str, str], blank_is_unset: bool
    ) -> None:
        declared = {row["env"] for row in settings_cls.rows().values() if row["env"]}
        self._environ = {
            k: v
            for k, v in environ.items()
            if k in declared and not (blank_is_unset and not v.strip())
        }
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return self._environ


# the table ----------------------------------------------------------------------------


class SettingsTable(BaseSettings):
    """The base of a program's settings table: flags over the declared variables.

    A subclass declares its rows with :func:`option`, its ``--help`` groups, whether a blank
    variable is unset or a value (the router's "empty turns a threshold off"), and how its
    errors are worded.
    """

    model_config = SettingsConfigDict(
        frozen=True, extra="ignore", populate_by_name=True, case_sensitive=True
    )
    # --help groups, in order: key -> (title, description); a group without a description
    # lists its env-only settings instead
    GROUPS: ClassVar[dict[str, tuple[str, str | None]]] = {}
    # each program says whether a blank variable is unset or a value, and how it words errors
    BLANK_IS_UNSET: ClassVar[bool]
    ERRORS: ClassVar[ErrorStyle]

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # flags (passed as init values) over the environment; no .env or secret files
        environ = _ENVIRON.get()
        return (
            init_settings,
            _Environment(cls, os.environ if environ is None else environ, cls.BLANK_IS_UNSET),
        )

    @classmethod
    def rows(cls) -> dict[str, dict[str, Any]]:
        """Field name -> its row (flag, env, group, expected, metavar, action, help, ...)."""
        out = {}
        for name, field in cls.model_fields.items():
            extra = field.json_schema_extra
            assert isinstance(extra, dict), name
            out[name] = {
                **extra,
                "help": field.description,
                "required": field.is_required(),
                "default": field.get_default(call_default_factory=True),
            }
        return out

    @classmethod
    def build_parser(
        cls,
        prog: str,
        description: str,
        formatter_class: type[argparse.HelpFormatter] = argparse.HelpFormatter,
    ) -> argparse.ArgumentParser:
        """The command line, generated from the table: each flag's help names its variable
        and its default (unless the text already does), and whether it is required."""
        parser = argparse.ArgumentParser(
            prog=prog,
            description=description,
            formatter_class=formatter_class,
            argument_default=argparse.SUPPRESS,
        )
        rows = cls.rows()
        groups = {}
        for key, (title, about) in cls.GROUPS.items():
            env_only = [
                f"{row['env']} (env only): {row['help']}"
                for row in rows.values()
                if row["group"] == key and not row["flag"] and row["env"]
            ]
            groups[key] = parser.add_argument_group(title, about or "\n".join(env_only) or None)
        for name, row in rows.items():
            if not row["flag"]:
                continue
            help_text = str(row["help"])
            if row["env"]:
                help_text += f" [env {row['env']}]"
            if row["required"]:
                help_text += " (required)"
            elif row["default"] not in (None, False, []) and "default" not in help_text.lower():
                help_text += f" (default: {row['default']})"
            kw: dict[str, Any] = {"dest": name, "help": help_text, "required": row["required"]}
            if row["action"]:
                kw["action"] = _ACTIONS[row["action"]]
            for key in ("metavar", "choices"):
                if row[key]:
                    kw[key] = row[key]
            groups[row["group"]].add_argument(row["flag"], **kw)
        return parser

    @classmethod
    def read(
        cls, flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> Self:
        """Validate ``flags`` (field name -> value; they win) over the environment."""
        env = os.environ if environ is None else environ
        given = dict(flags or {})
        token = _ENVIRON.set(env)
        try:
            return cls(**given)
        except ValidationError as exc:
            raise SettingsError(cls._describe(exc, given, env)) from None
        finally:
            _ENVIRON.reset(token)

    @classmethod
    def parse(
        cls,
        parser: argparse.ArgumentParser,
        argv: Sequence[str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Self:
        """Parse the command line over the environment; exit 2 naming a bad setting."""
        flags = vars(parser.parse_args(argv))
        try:
            return cls.read(flags, environ)
        except SettingsError as exc:
            parser.error(str(exc))  # usage and the message on stderr, exit code 2

    @classmethod
    def _describe(
        cls, exc: ValidationError, flags: Mapping[str, Any], env: Mapping[str, str]
    ) -> str:
        """The problems in the table's wording (fields are checked in the table's order)."""
        rows = cls.rows()
        by_env = {row["env"]: name for name, row in rows.items() if row["env"]}
        problems: list[str] = []
        for err in exc.errors():
            key = str(err["loc"][0]) if err["loc"] else ""
            name = by_env.get(key, key)
            row = rows.get(name)
            reason = str(err["msg"]).removeprefix("Value error, ")
            if row is None:  # a rule across settings
                problem = reason
            elif err["type"] == "missing":
                problem = f"{row['flag'] or row['env']} is required: expected {row['expected']}"
            else:
                where, raw = (
                    (row["flag"], flags[name]) if name in flags else (row["env"], env.get(key))
                )
                if isinstance(raw, list):
                    raw = _first_bad(raw, err["loc"])
                if err["type"] != "value_error":
                    reason = f"expected {row['expected']}"
                problem = cls.ERRORS.invalid.format(where=where, value=repr(raw), reason=reason)
            if problem not in problems:
                problems.append(problem)
        return "; ".join(problems) if cls.ERRORS.every else problems[0]


def _first_bad(values: list[Any], loc: tuple[int | str, ...]) -> Any:
    """The item of a repeated flag that an error's location points at (all of them when the
    error is about the list)."""
    index = loc[1] if len(loc) > 1 else None
    return values[index] if isinstance(index, int) and index < len(values) else values
