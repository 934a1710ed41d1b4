"""Service settings: command-line flags over environment variables (docs/configuration.md).

Every setting is a flag and an environment variable. Threshold names follow
the Dynamo frontend (``DYN_*``); the service's own settings use ``EXTPROC_*``.
A flag wins over its variable. Values are validated once, here, into an
immutable :class:`Settings`; an invalid value is a :class:`SettingsError`
naming the flag or variable, the value and what was expected (exit code 2).
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from extproc.core.busy import MAX_TOKEN_THRESHOLD
from extproc.core.classes import ClassConfigError, ClassTable, parse_table
from extproc.openai.errors import OVERLOAD_STATUS_ENV, overload_status_from_env

RouterMode = Literal["kv", "round-robin", "random"]
GrpcServerKind = Literal["builtin", "grpcio"]
GRPC_SERVERS: tuple[str, ...] = ("builtin", "grpcio")
ROUTER_MODES = ("kv", "round-robin", "random")
ADMISSION_CONTROL_CHOICES = ("none", "token-capacity")
_DISABLED = ("", "none", "None")
_INT = re.compile(r"^\+?[0-9]+$")


def load_class_table(path: str) -> ClassTable:
    """The request classes of a YAML file; ValueError naming the line or key and value."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"cannot read the classes file: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ValueError(f"{path} is not valid YAML{where}: {problem}") from None
    try:
        return parse_table(raw)
    except ClassConfigError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _loopback_endpoint(endpoint: str) -> bool:
    """A ZMQ endpoint only this machine reaches: ipc://, inproc://, or tcp:// on loopback."""
    from extproc.admin.auth import is_loopback_host

    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return True
    host = rest.rsplit(":", 1)[0]
    return is_loopback_host(host)


class SettingsError(ValueError):
    """An invalid setting; the message names the flag or variable and the value."""


def _opt_float(raw: Any, lo: float, hi: float | None, what: str) -> float | None:
    if raw is None:
        return None
    if isinstance(raw, bool):
        raise ValueError(f"expected {what}")
    if isinstance(raw, str):
        text = raw.strip()
        if text in _DISABLED:
            return None
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"expected {what}") from None
    elif isinstance(raw, (int, float)):
        value = float(raw)
    else:
        raise ValueError(f"expected {what}")
    if not math.isfinite(value) or value < lo or (hi is not None and value > hi):
        raise ValueError(f"expected {what}")
    return value


def _opt_int(raw: Any, lo: int, hi: int, what: str) -> int | None:
    if raw is None:
        return None
    if isinstance(raw, bool):
        raise ValueError(f"expected {what}")
    if isinstance(raw, str):
        text = raw.strip()
        if text in _DISABLED:
            return None
        if not _INT.match(text):
            raise ValueError(f"expected {what}")
        value = int(text)
    elif isinstance(raw, int):
        value = raw
    else:
        raise ValueError(f"expected {what}")
    if not lo <= value <= hi:
        raise ValueError(f"expected {what}")
    return value


def _split_list(raw: Any) -> list[str]:
    if raw is None:
        return []
    items = [raw] if isinstance(raw, str) else list(raw)
    out: list[str] = []
    for item in items:
        out.extend(p.strip() for p in str(item).split(",") if p.strip())
    return out


# name -> (flag, env var). The order here is the order of --help groups below.
SETTING_NAMES: dict[str, tuple[str, str]] = {
    "active_decode_blocks_threshold": (
        "--active-decode-blocks-threshold",
        "DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD",
    ),
    "active_prefill_tokens_threshold": (
        "--active-prefill-tokens-threshold",
        "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD",
    ),
    "active_prefill_tokens_threshold_frac": (
        "--active-prefill-tokens-threshold-frac",
        "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC",
    ),
    "router_mode": ("--router-mode", "DYN_ROUTER_MODE"),
    "router_track_output_blocks": (
        "--router-track-output-blocks",
        "DYN_ROUTER_TRACK_OUTPUT_BLOCKS",
    ),
    "router_queue_threshold": ("--router-queue-threshold", "DYN_ROUTER_QUEUE_THRESHOLD"),
    "router_queue_timeout": ("--router-queue-timeout", "EXTPROC_ROUTER_QUEUE_TIMEOUT"),
    "admission_control": ("--admission-control", "DYN_ADMISSION_CONTROL"),
    "grpc_host": ("--grpc-host", "EXTPROC_GRPC_HOST"),
    "grpc_port": ("--grpc-port", "EXTPROC_GRPC_PORT"),
    "grpc_server": ("--grpc-server", "EXTPROC_GRPC_SERVER"),
    "admin_host": ("--admin-host", "EXTPROC_ADMIN_HOST"),
    "admin_port": ("--admin-port", "EXTPROC_ADMIN_PORT"),
    "admin_token": ("--admin-token", "EXTPROC_ADMIN_TOKEN"),
    "event_bind": ("--event-bind", "EXTPROC_EVENT_BIND"),
    "event_connect": ("--event-connect", "EXTPROC_EVENT_CONNECT"),
    "worker_ttl": ("--worker-ttl", "EXTPROC_WORKER_TTL"),
    "startup_grace": ("--startup-grace", "EXTPROC_STARTUP_GRACE"),
    "worker_allow": ("--worker-allow", "EXTPROC_WORKER_ALLOW"),
    "event_curve_secret_key": ("--event-curve-secret-key", "EXTPROC_EVENT_CURVE_SECRET_KEY"),
    "event_curve_publishers": ("--event-curve-publishers", "EXTPROC_EVENT_CURVE_PUBLISHERS"),
    "classes_file": ("--classes-file", "EXTPROC_CLASSES_FILE"),
    "replica_id": ("--replica-id", "EXTPROC_REPLICA_ID"),
    "replica_publish": ("--replica-publish", "EXTPROC_REPLICA_PUBLISH"),
    "replica_interval": ("--replica-interval", "EXTPROC_REPLICA_INTERVAL"),
    "replica_ttl": ("--replica-ttl", "EXTPROC_REPLICA_TTL"),
    "tokenizer": ("--tokenizer", "EXTPROC_TOKENIZER"),
    "log_level": ("--log-level", "EXTPROC_LOG_LEVEL"),
}


class Settings(BaseSettings):
    """Validated, immutable configuration of the extproc service."""

    model_config = SettingsConfigDict(
        frozen=True, extra="ignore", populate_by_name=True, env_ignore_empty=False
    )

    active_decode_blocks_threshold: float | None = Field(
        None, validation_alias="DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD"
    )
    active_prefill_tokens_threshold: int | None = Field(
        None, validation_alias="DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD"
    )
    active_prefill_tokens_threshold_frac: float | None = Field(
        None, validation_alias="DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC"
    )
    router_mode: RouterMode = Field("kv", validation_alias="DYN_ROUTER_MODE")
    router_track_output_blocks: bool = Field(
        False, validation_alias="DYN_ROUTER_TRACK_OUTPUT_BLOCKS"
    )
    router_queue_threshold: float | None = Field(
        None, validation_alias="DYN_ROUTER_QUEUE_THRESHOLD"
    )
    router_queue_timeout: float = Field(5.0, validation_alias="EXTPROC_ROUTER_QUEUE_TIMEOUT")
    admission_control: str | None = Field(None, validation_alias="DYN_ADMISSION_CONTROL")
    grpc_host: str = Field("127.0.0.1", validation_alias="EXTPROC_GRPC_HOST")
    grpc_port: int = Field(9002, validation_alias="EXTPROC_GRPC_PORT")
    grpc_server: GrpcServerKind = Field("builtin", validation_alias="EXTPROC_GRPC_SERVER")
    admin_host: str = Field("127.0.0.1", validation_alias="EXTPROC_ADMIN_HOST")
    admin_port: int = Field(9003, validation_alias="EXTPROC_ADMIN_PORT")
    admin_token: str | None = Field(None, validation_alias="EXTPROC_ADMIN_TOKEN")
    event_bind: list[str] = Field(
        default_factory=lambda: ["tcp://127.0.0.1:5557"], validation_alias="EXTPROC_EVENT_BIND"
    )
    event_connect: list[str] = Field(default_factory=list, validation_alias="EXTPROC_EVENT_CONNECT")
    worker_ttl: float = Field(10.0, validation_alias="EXTPROC_WORKER_TTL")
    startup_grace: float = Field(1.0, validation_alias="EXTPROC_STARTUP_GRACE")
    worker_allow: list[str] = Field(default_factory=list, validation_alias="EXTPROC_WORKER_ALLOW")
    event_curve_secret_key: str | None = Field(
        None, validation_alias="EXTPROC_EVENT_CURVE_SECRET_KEY"
    )
    event_curve_publishers: str | None = Field(
        None, validation_alias="EXTPROC_EVENT_CURVE_PUBLISHERS"
    )
    classes_file: str | None = Field(None, validation_alias="EXTPROC_CLASSES_FILE")
    replica_id: str | None = Field(None, validation_alias="EXTPROC_REPLICA_ID")
    replica_publish: list[str] = Field(
        default_factory=list, validation_alias="EXTPROC_REPLICA_PUBLISH"
    )
    replica_interval: float = Field(1.0, validation_alias="EXTPROC_REPLICA_INTERVAL")
    replica_ttl: float = Field(3.0, validation_alias="EXTPROC_REPLICA_TTL")
    tokenizer: str | None = Field(None, validation_alias="EXTPROC_TOKENIZER")
    log_level: str = Field("INFO", validation_alias="EXTPROC_LOG_LEVEL")
    overload_status: int = 529

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # load_settings() reads flags and the environment itself, so that an error
        # can name the flag or the variable the bad value came from.
        return (init_settings,)

    @field_validator("active_decode_blocks_threshold", mode="before")
    @classmethod
    def _decode(cls, v: Any) -> float | None:
        return _opt_float(v, 0.0, 1.0, "a number in [0, 1], or None to disable")

    @field_validator("active_prefill_tokens_threshold", mode="before")
    @classmethod
    def _prefill(cls, v: Any) -> int | None:
        return _opt_int(
            v, 0, MAX_TOKEN_THRESHOLD, "a whole number of tokens >= 0, or None to disable"
        )

    @field_validator(
        "active_prefill_tokens_threshold_frac", "router_queue_threshold", mode="before"
    )
    @classmethod
    def _frac(cls, v: Any) -> float | None:
        return _opt_float(v, 0.0, None, "a number >= 0 (may exceed 1), or None to disable")

    @field_validator("router_mode", mode="before")
    @classmethod
    def _mode(cls, v: Any) -> str:
        text = str(v).strip()
        if text not in ROUTER_MODES:
            raise ValueError(f"expected one of {', '.join(ROUTER_MODES)}")
        return text

    @field_validator("grpc_server", mode="before")
    @classmethod
    def _server(cls, v: Any) -> str:
        text = str(v).strip().lower()
        if text not in GRPC_SERVERS:
            raise ValueError(f"expected one of {', '.join(GRPC_SERVERS)}")
        return text

    @field_validator("router_track_output_blocks", mode="before")
    @classmethod
    def _bool(cls, v: Any) -> bool:
        if isinstance(v, bool):
            return v
        text = str(v).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", "", "none"):
            return False
        raise ValueError("expected true or false")

    @field_validator("admission_control", mode="before")
    @classmethod
    def _admission(cls, v: Any) -> str | None:
        if v is None:
            return None
        text = str(v).strip()
        if text not in ADMISSION_CONTROL_CHOICES:
            raise ValueError(f"expected one of {', '.join(ADMISSION_CONTROL_CHOICES)}")
        return text

    @field_validator("grpc_port", "admin_port", mode="before")
    @classmethod
    def _port(cls, v: Any) -> int:
        value = _opt_int(v, 0, 65535, "a TCP port 0-65535 (0 = any free port)")
        if value is None:
            raise ValueError("expected a TCP port 0-65535")
        return value

    @field_validator("router_queue_timeout", mode="before")
    @classmethod
    def _queue_timeout(cls, v: Any) -> float:
        value = _opt_float(v, 0.0, 28.0, "seconds in (0, 28] (Envoy's max_message_timeout is 30 s)")
        if not value:
            raise ValueError("expected seconds in (0, 28] (Envoy's max_message_timeout is 30 s)")
        return value

    @field_validator("worker_ttl", mode="before")
    @classmethod
    def _seconds(cls, v: Any) -> float:
        value = _opt_float(v, 0.0, 86400.0, "a number of seconds > 0")
        if not value:
            raise ValueError("expected a number of seconds > 0")
        return value

    @field_validator("startup_grace", mode="before")
    @classmethod
    def _grace(cls, v: Any) -> float:
        value = _opt_float(v, 0.0, 60.0, "seconds in [0, 60]")
        if value is None:
            raise ValueError("expected seconds in [0, 60]")
        return value

    @field_validator("event_curve_secret_key", mode="before")
    @classmethod
    def _curve_secret(cls, v: Any) -> str | None:
        from extproc.events.curve import CurveKeyError, load_key_pair

        if v is None or str(v).strip() in _DISABLED:
            return None
        try:
            load_key_pair(str(v).strip())
        except CurveKeyError as exc:
            raise ValueError(f"expected a CURVE secret key file: {exc}") from None
        return str(v).strip()

    @field_validator("event_curve_publishers", mode="before")
    @classmethod
    def _curve_publishers(cls, v: Any) -> str | None:
        from extproc.events.curve import CurveKeyError, check_publisher_dir

        if v is None or str(v).strip() in _DISABLED:
            return None
        try:
            check_publisher_dir(str(v).strip())
        except CurveKeyError as exc:
            raise ValueError(f"expected a directory of publisher public keys: {exc}") from None
        return str(v).strip()

    @field_validator("classes_file", mode="before")
    @classmethod
    def _classes_file(cls, v: Any) -> str | None:
        if v is None or str(v).strip() in _DISABLED:
            return None
        path = str(v).strip()
        load_class_table(path)
        return path

    @field_validator("replica_id", mode="before")
    @classmethod
    def _replica_id(cls, v: Any) -> str | None:
        if v is None or not str(v).strip():
            return None
        text = str(v).strip()
        if len(text) > 128 or any(c.isspace() for c in text):
            raise ValueError("expected at most 128 characters without spaces")
        return text

    @field_validator("replica_interval", mode="before")
    @classmethod
    def _replica_interval(cls, v: Any) -> float:
        value = _opt_float(v, 0.0, 60.0, "seconds in (0, 60]")
        if not value:
            raise ValueError("expected seconds in (0, 60]")
        return value

    @field_validator("replica_ttl", mode="before")
    @classmethod
    def _replica_ttl(cls, v: Any) -> float:
        value = _opt_float(v, 0.0, 3600.0, "seconds in (0, 3600]")
        if not value:
            raise ValueError("expected seconds in (0, 3600]")
        return value

    @field_validator(
        "event_bind", "event_connect", "worker_allow", "replica_publish", mode="before"
    )
    @classmethod
    def _list(cls, v: Any) -> list[str]:
        return _split_list(v)

    @field_validator("event_bind", "event_connect", "replica_publish")
    @classmethod
    def _zmq_endpoints(cls, v: list[str]) -> list[str]:
        for endpoint in v:
            if not re.match(r"^(tcp|ipc|inproc)://.+", endpoint):
                raise ValueError(
                    f"expected ZMQ endpoints like tcp://127.0.0.1:5557, got {endpoint!r}"
                )
        return v

    @field_validator("worker_allow")
    @classmethod
    def _allow(cls, v: list[str]) -> list[str]:
        from extproc.core.allowlist import parse_allow_entry

        for entry in v:
            parse_allow_entry(entry)
        return v

    @field_validator("tokenizer", mode="before")
    @classmethod
    def _tokenizer(cls, v: Any) -> str | None:
        if v is None or not str(v).strip() or str(v).strip() in _DISABLED:
            return None
        path = str(v).strip()
        if not os.path.isfile(path):
            raise ValueError(f"expected a local tokenizer.json file; {path!r} does not exist")
        return path

    @field_validator("log_level", mode="before")
    @classmethod
    def _level(cls, v: Any) -> str:
        text = str(v).strip().upper()
        if text not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError("expected DEBUG, INFO, WARNING or ERROR")
        return text

    @property
    def kv_mode(self) -> bool:
        return self.router_mode == "kv"

    @model_validator(mode="after")
    def _together(self) -> Settings:
        if (self.event_curve_secret_key is None) != (self.event_curve_publishers is None):
            raise ValueError(
                "--event-curve-secret-key (EXTPROC_EVENT_CURVE_SECRET_KEY) and "
                "--event-curve-publishers (EXTPROC_EVENT_CURVE_PUBLISHERS) go together: "
                "CURVE needs the server key and the admitted publishers"
            )
        if not self.event_bind and not self.event_connect:
            raise ValueError(
                "--event-bind (EXTPROC_EVENT_BIND) and --event-connect (EXTPROC_EVENT_CONNECT) "
                "are both empty: the event socket needs at least one endpoint"
            )
        return self

    @property
    def curve(self) -> bool:
        return self.event_curve_secret_key is not None

    def startup_warnings(self) -> list[str]:
        """The one-line warnings to log once at startup."""
        warnings = []
        if not self.curve:
            wide = [e for e in self.event_bind if not _loopback_endpoint(e)]
            if wide:
                warnings.append(
                    f"the event socket listens beyond loopback ({', '.join(wide)}) without "
                    "CURVE: anyone who reaches it can announce workers and report load; "
                    "see --event-curve-secret-key and --event-curve-publishers"
                )
        if self.admission_control is not None:
            warnings.append(
                f"--admission-control={self.admission_control} (DYN_ADMISSION_CONTROL) is "
                "deprecated and has no effect; use --active-decode-blocks-threshold, "
                "--active-prefill-tokens-threshold or --active-prefill-tokens-threshold-frac "
                "(DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD, DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD, "
                "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC) instead"
            )
        if self.active_decode_blocks_threshold is not None and not self.kv_mode:
            warnings.append(
                f"--active-decode-blocks-threshold={self.active_decode_blocks_threshold} is "
                f"inactive: decode-block checks run only with --router-mode kv "
                f"(router mode is {self.router_mode})"
            )
        if self.admin_host not in ("127.0.0.1", "::1", "localhost") and not self.admin_token:
            warnings.append(
                f"admin API listens on {self.admin_host} without --admin-token: "
                "POST /busy_threshold is refused (401) until a token is set"
            )
        return warnings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m extproc",
        description=(
            "Envoy external processor that rejects requests with 529 when every LLM worker "
            "is busy and otherwise routes each request to a free worker. Every flag also "
            "reads the environment variable shown; a flag wins over its variable. "
            "Thresholds are off until given; 'None' or an empty value turns one off."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )

    def add(group: argparse._ArgumentGroup, name: str, help_: str, **kw: Any) -> None:
        flag, env = SETTING_NAMES[name]
        group.add_argument(flag, dest=name, help=f"{help_} [env {env}]", **kw)

    busy = parser.add_argument_group("busy thresholds (per model; defaults for new models)")
    add(
        busy,
        "active_decode_blocks_threshold",
        "KV-block utilisation fraction in [0, 1]: a rank is busy when active decode blocks "
        "> value x kv_total_blocks (kv router mode only). Default: off",
        metavar="FRACTION",
    )
    add(
        busy,
        "active_prefill_tokens_threshold",
        "tokens: a rank is busy when active prefill tokens > value. Default: off",
        metavar="TOKENS",
    )
    add(
        busy,
        "active_prefill_tokens_threshold_frac",
        "multiple of the worker's max_num_batched_tokens (may exceed 1): busy when active "
        "prefill tokens > floor(value x max_num_batched_tokens). Default: off",
        metavar="MULTIPLE",
    )
    overload = busy
    overload.description = (
        f"Rejections use status {OVERLOAD_STATUS_ENV} (env only, 200-999, default 529)."
    )

    router = parser.add_argument_group("router")
    add(
        router,
        "router_mode",
        "kv = least-loaded free worker by KV utilisation then prefill tokens; "
        "round-robin; random. Default: kv",
        metavar="{kv,round-robin,random}",
    )
    add(
        router,
        "router_track_output_blocks",
        "count generated tokens into the router's own active-block estimate; needs "
        "response bodies observed (envoy/envoy-track-output.yaml). Default: off",
        action=argparse.BooleanOptionalAction,
    )
    add(
        router,
        "router_queue_threshold",
        "multiple of max_num_batched_tokens: hold requests in the router while every "
        "eligible worker has router-tracked prefill tokens above it. Default: off",
        metavar="MULTIPLE",
    )
    add(
        router,
        "router_queue_timeout",
        "seconds a request may wait in the router queue before the overload reply. Default: 5",
        metavar="SECONDS",
    )
    add(
        router,
        "tokenizer",
        "path of a local tokenizer.json for exact prompt-token counts (tokenizers library; "
        "never downloaded). Default: estimate ceil(UTF-8 bytes / 4)",
        metavar="PATH",
    )
    add(
        router,
        "admission_control",
        "deprecated, no effect (accepted for old launch commands): none | token-capacity",
        metavar="{none,token-capacity}",
    )

    listen = parser.add_argument_group("listeners")
    add(listen, "grpc_host", "ext_proc gRPC listen address. Default: 127.0.0.1", metavar="HOST")
    add(listen, "grpc_port", "ext_proc gRPC listen port. Default: 9002", metavar="PORT")
    add(
        listen,
        "grpc_server",
        "builtin = the extproc's own HTTP/2 server on the event loop (about 4x less CPU per "
        "request); grpcio = grpcio's asyncio server. Default: builtin",
        metavar="{builtin,grpcio}",
    )
    add(
        listen,
        "admin_host",
        "admin HTTP listen address; anything but loopback needs --admin-token for POST. "
        "Default: 127.0.0.1",
        metavar="HOST",
    )
    add(listen, "admin_port", "admin HTTP port. Default: 9003", metavar="PORT")
    add(
        listen,
        "admin_token",
        "bearer token required for POST /busy_threshold when the admin API is not on "
        "loopback. Default: none",
        metavar="TOKEN",
    )

    events = parser.add_argument_group("worker load events (ZeroMQ)")
    add(
        events,
        "event_bind",
        "ZMQ endpoint(s) the SUB socket binds, comma-separated or repeated. "
        "Default: tcp://127.0.0.1:5557",
        metavar="ENDPOINT",
        action="append",
    )
    add(
        events,
        "event_connect",
        "ZMQ endpoint(s) the SUB socket connects to (publishers that bind). Default: none",
        metavar="ENDPOINT",
        action="append",
    )
    add(
        events,
        "worker_ttl",
        "seconds: a worker silent this long is removed as if it said bye. Default: 10",
        metavar="SECONDS",
    )
    add(
        events,
        "startup_grace",
        "seconds to listen for worker events before serving ext_proc, so that a restarted "
        "extproc knows the workers before its first decision (Envoy fails open meanwhile). "
        "Default: 1",
        metavar="SECONDS",
    )
    add(
        events,
        "worker_allow",
        "allow-list of announced worker endpoints: CIDRs and/or host:port, comma-separated "
        "or repeated. Default: allow all",
        metavar="CIDR|HOST:PORT",
        action="append",
    )
    add(
        events,
        "event_curve_secret_key",
        "ZeroMQ CURVE: the extproc's secret key file (NAME.key_secret from python -m "
        "extproc.events.keys); with --event-curve-publishers, only admitted publishers "
        "are heard. Default: off (plain TCP)",
        metavar="FILE",
    )
    add(
        events,
        "event_curve_publishers",
        "ZeroMQ CURVE: directory of the admitted publishers' public key files (*.key). "
        "Default: off",
        metavar="DIR",
    )

    add(
        router,
        "classes_file",
        "YAML file of request classes (name, priority, share of each threshold, status, "
        "Retry-After, large-prompt share); docs/classes.md. Default: none (one class)",
        metavar="FILE",
    )

    replicas = parser.add_argument_group(
        "replicas (share in-flight estimates and threshold changes; docs/replicas.md)"
    )
    add(
        replicas,
        "replica_publish",
        "ZMQ endpoint(s) this replica publishes its estimates to: a forwarder's XSUB port or "
        "the other replicas' event sockets; comma-separated or repeated. Default: none "
        "(sharing off)",
        metavar="ENDPOINT",
        action="append",
    )
    add(
        replicas,
        "replica_id",
        "this replica's id on the event plane. Default: host-pid-random, new at each start",
        metavar="ID",
    )
    add(
        replicas,
        "replica_interval",
        "seconds between full estimate snapshots (changes go out at once). Default: 1",
        metavar="SECONDS",
    )
    add(
        replicas,
        "replica_ttl",
        "seconds of silence after which another replica's estimate is dropped. Default: 3",
        metavar="SECONDS",
    )

    misc = parser.add_argument_group("logging")
    add(misc, "log_level", "DEBUG, INFO, WARNING or ERROR. Default: INFO", metavar="LEVEL")
    return parser


def load_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Parse flags over the environment; raise SettingsError on any invalid value."""
    env = dict(os.environ if environ is None else environ)
    parser = build_parser()
    flags = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    for name, (flag, env_name) in SETTING_NAMES.items():
        if name in flags:
            values[name] = flags[name]
            source[name] = flag
        elif env_name in env:
            values[name] = env[env_name]
            source[name] = env_name
    status, status_warning = overload_status_from_env(env)
    values["overload_status"] = status
    try:
        settings = Settings.model_validate(values)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            if not err["loc"]:
                problems.append(str(err["msg"]).removeprefix("Value error, "))
                continue
            name = str(err["loc"][0])
            where = source.get(name, name)
            raw = values.get(name)
            msg = str(err["msg"]).removeprefix("Value error, ")
            problems.append(f"invalid {where} value {raw!r}: {msg}")
        raise SettingsError("; ".join(problems)) from None
    object.__setattr__(settings, "_status_warning", status_warning)
    return settings


def all_startup_warnings(settings: Settings) -> list[str]:
    warnings = settings.startup_warnings()
    status_warning = getattr(settings, "_status_warning", None)
    if status_warning:
        warnings.append(status_warning)
    return warnings
