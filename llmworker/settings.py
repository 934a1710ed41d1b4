"""Settings of the worker programs: flags over environment variables, each declared once.

The idiom of the extproc's settings: every setting is a field of a pydantic-settings model
that carries its flag, its environment variable (most have none), its ``--help`` group and
text, and what a valid value looks like. The argparse parser is generated from the fields,
pydantic-settings reads the declared variables, and pydantic validates every value, from a
flag or the environment alike. A flag wins over its variable; a blank variable is unset.
An invalid value is a :class:`SettingsError` naming the flag or variable, the value and what
was expected, and the programs exit with code 2.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import Annotated, Any, ClassVar, Literal, Self

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


# value shapes -----------------------------------------------------------------------


def _invalid() -> PydanticCustomError:
    # shown as the setting's own "expected ..." text
    return PydanticCustomError("invalid", "invalid value")


def _whole(v: Any) -> Any:
    """Digits only (an optional '+'; spaces ignored): no '1.0', '1e3' or '-0'."""
    if v is None or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    text = str(v).strip()
    if isinstance(v, bool) or not text.isascii() or not _WHOLE.match(text):
        raise _invalid()
    return int(text)


def _text(v: Any) -> Any:
    return v.strip() if isinstance(v, str) else v


Whole = Annotated[int, BeforeValidator(_whole)]
OptWhole = Annotated[int | None, BeforeValidator(_whole)]
Number = Annotated[float, BeforeValidator(_text), Field(allow_inf_nan=False)]
OptNumber = Annotated[float | None, BeforeValidator(_text), Field(allow_inf_nan=False)]


def option(
    default: Any,
    flag: str | None,
    group: str,
    help: str,
    *,
    expected: str,
    env: str | None = None,
    metavar: str | None = None,
    action: Literal["append", "store_true"] | None = None,
    choices: Sequence[str] | None = None,
    **bounds: Any,
) -> Any:
    """One row of a settings table: a pydantic Field carrying its flag and ``--help`` text.

    ``default`` ``...`` makes the flag required; ``flag`` None means env only; ``env`` is
    the variable pydantic-settings reads (None: the flag only); ``expected`` is what an
    error says a valid value looks like; ``bounds`` are pydantic Field constraints.
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
    return Field(
        PydanticUndefined if default is ... else default,
        validation_alias=env,
        description=help,
        json_schema_extra=extra,
        **bounds,
    )


_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("llmworker_environ", default=None)


class _Environment(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping (os.environ by default),
    reading only the variables the settings declare; a blank value is unset."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        declared = {
            extra["env"]
            for f in settings_cls.model_fields.values()
            if isinstance(extra := f.json_schema_extra, dict) and extra.get("env")
        }
        self._environ = {k: v for k, v in environ.items() if k in declared and v.strip()}
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return self._environ


class WorkerSettings(BaseSettings):
    """The base of a worker program's settings table: flags over the declared variables."""

    model_config = SettingsConfigDict(
        frozen=True, extra="ignore", populate_by_name=True, case_sensitive=True
    )
    # --help groups, in order: key -> (title, description)
    GROUPS: ClassVar[dict[str, tuple[str, str | None]]] = {}

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
            _Environment(settings_cls, os.environ if environ is None else environ),
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
    def build_parser(cls, prog: str, description: str) -> argparse.ArgumentParser:
        """The command line, generated from the settings table."""
        parser = argparse.ArgumentParser(
            prog=prog, description=description, argument_default=argparse.SUPPRESS
        )
        groups = {
            key: parser.add_argument_group(title, text) for key, (title, text) in cls.GROUPS.items()
        }
        for name, row in cls.rows().items():
            if not row["flag"]:
                continue
            text = str(row["help"])
            if row["env"]:
                text += f" [env {row['env']}]"
            if row["required"]:
                text += " (required)"
            elif row["default"] not in (None, False, []) and "default" not in text:
                text += f" (default: {row['default']})"
            kw: dict[str, Any] = {"dest": name, "help": text, "required": row["required"]}
            for key in ("metavar", "action", "choices"):
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
            parser.error(str(exc))

    @classmethod
    def _describe(
        cls, exc: ValidationError, flags: Mapping[str, Any], env: Mapping[str, str]
    ) -> str:
        """'<flag or variable>=<value> is invalid: <what was expected>' for the first
        problem (fields are checked in the table's order)."""
        rows = cls.rows()
        by_key = {row["env"]: name for name, row in rows.items() if row["env"]}
        err = exc.errors()[0]
        key = str(err["loc"][0]) if err["loc"] else ""
        name = by_key.get(key, key)
        row = rows.get(name)
        if row is None:  # a rule across settings
            return str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "missing":
            return f"{row['flag'] or row['env']} is required: expected {row['expected']}"
        where, raw = (row["flag"], flags[name]) if name in flags else (row["env"], env.get(key))
        if isinstance(raw, list):
            raw = _first_bad(raw, err["loc"])
        if err["type"] == "value_error":
            msg = str(err["msg"]).removeprefix("Value error, ")
        else:
            msg = f"expected {row['expected']}"
        return f"{where}={raw!r} is invalid: {msg}"


def _first_bad(values: list[Any], loc: tuple[int | str, ...]) -> Any:
    """The item of a repeated flag that an error's location points at."""
    index = loc[1] if len(loc) > 1 else None
    return values[index] if isinstance(index, int) and index < len(values) else values
