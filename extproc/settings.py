"""Service settings: command-line flags over environment variables (docs/configuration.md).

Every setting is declared once, as a row of :class:`Settings` (a settings table of
:mod:`extproc.settings_table`): its type and bounds, default, flag, environment variable
(``DYN_*`` for the thresholds, as the Dynamo frontend names them; ``EXTPROC_*`` for the
service's own), help text with its unit, ``--help`` group, and what a valid value looks
like. The argparse parser and ``--help`` are generated from those rows; pydantic-settings
reads the environment. A flag wins over its variable; an empty variable is a value (for a
threshold: off). An invalid value is a :class:`SettingsError` worded ``invalid FLAG value
VALUE: what was expected``, every problem in one line (exit code 2).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, get_args

import yaml
from pydantic import BeforeValidator, field_validator, model_validator
from pydantic_settings import NoDecode

from extproc.core.busy import MAX_TARGET_MS, MAX_TOKEN_THRESHOLD
from extproc.core.classes import ClassConfigError, ClassTable, parse_table
from extproc.core.loopback import is_loopback_host
from extproc.handlers.body_budget import DEFAULT_BUDGET_MIB, MAX_BUDGET_MIB
from extproc.openai.errors import (
    DEFAULT_OVERLOAD_STATUS,
    OVERLOAD_STATUS_ENV,
    overload_status_from_env,
)
from extproc.settings_table import (
    ErrorStyle,
    LogLevel,
    Number,
    SettingsTable,
    Whole,
    invalid,
    lower,
    option,
    stripped,
    whole,
)
from extproc.settings_table import SettingsError as SettingsError  # raised by load_settings

RouterMode = Literal["kv", "round-robin", "random"]
TtftSource = Literal["gateway", "engine"]
GrpcServerKind = Literal["builtin", "grpcio"]
Protocol = Literal["envoy", "epp"]
AdmissionControl = Literal["none", "token-capacity"]
GRPC_SERVERS: tuple[str, ...] = get_args(GrpcServerKind)
ROUTER_MODES: tuple[str, ...] = get_args(RouterMode)
PROTOCOLS: tuple[str, ...] = get_args(Protocol)
ADMISSION_CONTROL_CHOICES: tuple[str, ...] = get_args(AdmissionControl)
_DISABLED = ("", "none", "None")
_ZMQ = re.compile(r"^(tcp|ipc|inproc)://.+")


def load_class_table(path: str) -> ClassTable:
    """The request classes of a YAML file; ValueError naming the file, the line, the key
    and the value."""
    try:
        with open(path, encoding="utf-8") as f:
            loader = yaml.SafeLoader(f.read())
    except OSError as exc:
        raise ValueError(f"cannot read the classes file: {exc.strerror}") from None
    try:
        node = loader.get_single_node()
        raw = None if node is None else loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ValueError(f"{path} is not valid YAML{where}: {problem}") from None
    finally:
        loader.dispose()
    try:
        return parse_table(raw)
    except ClassConfigError as exc:
        line = _line_of(node, exc.loc) if node is not None else None
        raise ValueError(f"{path}{'' if line is None else f', line {line}'}: {exc}") from None


def _line_of(node: yaml.Node, loc: tuple[str | int, ...]) -> int:
    """The 1-based line of the deepest key of ``loc`` present in the YAML node tree (the
    line of the key itself, where the reader looks for it)."""
    line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = [(k, v) for k, v in node.value if k.value == str(part)]
            if not match:
                break
            key, node = match[-1]  # a repeated key: the last one wins, as when loading
            line = key.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if not 0 <= part < len(node.value):
                break
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def _loopback_endpoint(endpoint: str) -> bool:
    """A ZMQ endpoint only this machine reaches: ipc://, inproc://, or tcp:// on loopback."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return True
    return is_loopback_host(rest.rsplit(":", 1)[0])


class OverloadStatus(NamedTuple):
    """The rejection status from DYN_HTTP_OVERLOAD_STATUS_CODE and the warning, if invalid."""

    status: int = DEFAULT_OVERLOAD_STATUS
    warning: str | None = None


# value shapes of the router's own, applied before pydantic's type and bound checks -----


def _off(v: Any) -> Any:
    """'None', 'none', empty or blank: the setting is off."""
    v = stripped(v)
    return None if v is None or v in _DISABLED else v


def _flag_bool(v: Any) -> Any:
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", "", "none"):
        return False
    raise invalid()


def _items(v: Any) -> list[str]:
    """A comma-separated string, or repeated flags each possibly comma-separated."""
    if v is None:
        return []
    out: list[str] = []
    for item in [v] if isinstance(v, str) else list(v):
        out.extend(p.strip() for p in str(item).split(",") if p.strip())
    return out


def _statuses(v: Any) -> Any:
    """Comma-separated HTTP statuses, each 100-999 and not 2xx; empty or none: off."""
    if isinstance(v, tuple):
        return v
    text = _off(v)
    if text is None:
        return ()
    codes: set[int] = set()
    for item in str(text).split(","):
        item = item.strip()
        if not (len(item) == 3 and item.isascii() and item.isdigit() and item[0] != "0"):
            raise ValueError(
                f"expected comma-separated HTTP statuses 100-999 (like 429,503), or empty to "
                f"turn this off; {item!r} is not one"
            )
        if item[0] == "2":
            raise ValueError(
                f"expected non-2xx HTTP statuses (like 429,503); {item} is a success, not a refusal"
            )
        codes.add(int(item))
    return tuple(sorted(codes))


def _overload(v: Any) -> OverloadStatus:
    if isinstance(v, OverloadStatus):
        return v
    return OverloadStatus(*overload_status_from_env({OVERLOAD_STATUS_ENV: str(v)}))


def _opt_whole(v: Any) -> Any:
    return None if _off(v) is None else whole(v)


OptNumber = Annotated[float | None, BeforeValidator(_off)]
OptWhole = Annotated[int | None, BeforeValidator(_opt_whole)]
Items = Annotated[list[str], NoDecode, BeforeValidator(_items)]


def setting(default: Any, flag: str | None, env: str, group: str, help: str, **more: Any) -> Any:
    """One row of the settings table: :func:`extproc.settings_table.option` with the variable
    third, as every setting of the service has one (``flag`` None means env only)."""
    return option(default, flag, group, help, env=env, **more)


class Settings(SettingsTable):
    """Validated, immutable configuration of the extproc service: the table of settings."""

    GROUPS: ClassVar[dict[str, tuple[str, str | None]]] = {
        "busy": ("busy thresholds (per model; defaults for new models)", None),
        "router": ("router", None),
        "listen": ("listeners", None),
        "events": ("worker load events (ZeroMQ)", None),
        "replicas": (
            "replicas (share in-flight estimates and threshold changes; docs/replicas.md)",
            None,
        ),
        "logging": ("logging", None),
    }
    BLANK_IS_UNSET = False  # an empty variable turns a threshold off
    ERRORS = ErrorStyle("invalid {where} value {value}: {reason}", every=True)

    # busy thresholds ------------------------------------------------------------------
    active_decode_blocks_threshold: OptNumber = setting(
        None,
        "--active-decode-blocks-threshold",
        "DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD",
        "busy",
        "KV-block utilisation fraction in [0, 1]: a rank is busy when active decode blocks "
        "> value x kv_total_blocks (kv router mode only). Default: off",
        metavar="FRACTION",
        expected="a number in [0, 1], or None to disable",
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
    )
    active_prefill_tokens_threshold: OptWhole = setting(
        None,
        "--active-prefill-tokens-threshold",
        "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD",
        "busy",
        "tokens: a rank is busy when active prefill tokens > value. Default: off",
        metavar="TOKENS",
        expected="a whole number of tokens >= 0, or None to disable",
        ge=0,
        le=MAX_TOKEN_THRESHOLD,
    )
    active_prefill_tokens_threshold_frac: OptNumber = setting(
        None,
        "--active-prefill-tokens-threshold-frac",
        "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC",
        "busy",
        "multiple of the worker's max_num_batched_tokens (may exceed 1): busy when active "
        "prefill tokens > floor(value x max_num_batched_tokens). Default: off",
        metavar="MULTIPLE",
        expected="a number >= 0 (may exceed 1), or None to disable",
        ge=0.0,
        allow_inf_nan=False,
    )
    ttft_p99_target_ms: OptNumber = setting(
        None,
        "--ttft-p99-target-ms",
        "EXTPROC_TTFT_P99_TARGET_MS",
        "busy",
        "time-to-first-token target, in ms, for every model: each request is dispatched to "
        "the worker with the smallest predicted TTFT when it fits, held in the router for a "
        "slot when only the wait fits, else rejected at once (x-shed-reason: deadline); the "
        "thresholds stay ceilings (docs/latency-target.md). Default: off",
        metavar="MS",
        expected=f"milliseconds in (0, {MAX_TARGET_MS}], or None to disable",
        gt=0.0,
        le=float(MAX_TARGET_MS),
        allow_inf_nan=False,
    )
    itl_p99_target_ms: OptNumber = setting(
        None,
        "--itl-p99-target-ms",
        "EXTPROC_ITL_P99_TARGET_MS",
        "busy",
        "inter-token-latency p99 target, in ms, for every model: stored and shown with the "
        "thresholds, not enforced (admission holds the TTFT target). Default: off",
        metavar="MS",
        expected=f"milliseconds in (0, {MAX_TARGET_MS}], or None to disable",
        gt=0.0,
        le=float(MAX_TARGET_MS),
        allow_inf_nan=False,
    )
    ttft_source: Annotated[TtftSource | None, BeforeValidator(stripped)] = setting(
        None,
        "--ttft-source",
        "EXTPROC_TTFT_SOURCE",
        "busy",
        "deprecated, no effect (accepted for old launch commands): gateway | engine; "
        "deadline admission predicts from the gateway's own timings and the engines' queue "
        "fields",
        metavar="{gateway,engine}",
        expected="gateway or engine",
    )
    overload: Annotated[OverloadStatus, NoDecode, BeforeValidator(_overload)] = setting(
        OverloadStatus(),
        None,
        OVERLOAD_STATUS_ENV,
        "busy",
        f"HTTP status of rejections, 200-999; anything else means {DEFAULT_OVERLOAD_STATUS} "
        "with a warning. Default: 529",
        expected="an integer in 200-999",
    )

    worker_busy_statuses: Annotated[tuple[int, ...], NoDecode, BeforeValidator(_statuses)] = (
        setting(
            (429, 503),
            "--worker-busy-statuses",
            "EXTPROC_WORKER_BUSY_STATUSES",
            "busy",
            "comma-separated HTTP statuses a worker answers when it refuses work (vLLM's queue "
            "limits, llama-server without a free slot): retried on the listed fallbacks, then "
            "the overload reply, the worker skipped for up to 1 s; 529 and x-worker-overloaded: "
            "1 always count; empty turns the list off. Default: 429,503",
            metavar="STATUSES",
            expected="comma-separated HTTP statuses 100-999, not 2xx, or empty to turn off",
        )
    )

    # router ---------------------------------------------------------------------------
    router_mode: Annotated[RouterMode, BeforeValidator(stripped)] = setting(
        "kv",
        "--router-mode",
        "DYN_ROUTER_MODE",
        "router",
        "kv = least-loaded free worker by KV utilisation then prefill tokens; "
        "round-robin; random. Default: kv",
        metavar="{kv,round-robin,random}",
        expected=f"one of {', '.join(ROUTER_MODES)}",
    )
    router_track_output_blocks: Annotated[bool, BeforeValidator(_flag_bool)] = setting(
        False,
        "--router-track-output-blocks",
        "DYN_ROUTER_TRACK_OUTPUT_BLOCKS",
        "router",
        "count generated tokens into the router's own active-block estimate; needs "
        "response bodies observed (envoy/envoy-track-output.yaml). Default: off",
        action="toggle",
        expected="true or false",
    )
    router_queue_threshold: OptNumber = setting(
        None,
        "--router-queue-threshold",
        "DYN_ROUTER_QUEUE_THRESHOLD",
        "router",
        "multiple of max_num_batched_tokens: hold requests in the router while every "
        "eligible worker has router-tracked prefill tokens above it. Default: off",
        metavar="MULTIPLE",
        expected="a number >= 0 (may exceed 1), or None to disable",
        ge=0.0,
        allow_inf_nan=False,
    )
    router_queue_timeout: Number = setting(
        5.0,
        "--router-queue-timeout",
        "EXTPROC_ROUTER_QUEUE_TIMEOUT",
        "router",
        "seconds a request may wait in the router queue before the overload reply. Default: 5",
        metavar="SECONDS",
        expected="seconds in (0, 28] (Envoy's max_message_timeout is 30 s)",
        gt=0.0,
        le=28.0,
        allow_inf_nan=False,
    )
    tokenizer: str | None = setting(
        None,
        "--tokenizer",
        "EXTPROC_TOKENIZER",
        "router",
        "path of a local tokenizer.json for exact prompt-token counts (tokenizers library; "
        "never downloaded). Default: estimate ceil(UTF-8 bytes / 4)",
        metavar="PATH",
        expected="a local tokenizer.json file",
    )
    state_file: Annotated[str | None, BeforeValidator(_off)] = setting(
        None,
        "--state-file",
        "EXTPROC_STATE_FILE",
        "router",
        "JSON file where thresholds and classes changed at runtime are kept and applied "
        "again after a restart (over the startup values). Default: none (runtime changes "
        "last until the process ends)",
        metavar="FILE",
        expected="a writable file path",
    )
    classes_file: str | None = setting(
        None,
        "--classes-file",
        "EXTPROC_CLASSES_FILE",
        "router",
        "YAML file of request classes (name, priority, share of each threshold, status, "
        "Retry-After, large-prompt share); docs/classes.md. Default: none (one class)",
        metavar="FILE",
        expected="a YAML file of request classes",
    )
    admission_control: Annotated[AdmissionControl | None, BeforeValidator(stripped)] = setting(
        None,
        "--admission-control",
        "DYN_ADMISSION_CONTROL",
        "router",
        "deprecated, no effect (accepted for old launch commands): none | token-capacity",
        metavar="{none,token-capacity}",
        expected=f"one of {', '.join(ADMISSION_CONTROL_CHOICES)}",
    )

    # listeners ------------------------------------------------------------------------
    grpc_host: str = setting(
        "127.0.0.1",
        "--grpc-host",
        "EXTPROC_GRPC_HOST",
        "listen",
        "ext_proc gRPC listen address. Default: 127.0.0.1",
        metavar="HOST",
        expected="a host",
    )
    grpc_port: Whole = setting(
        9002,
        "--grpc-port",
        "EXTPROC_GRPC_PORT",
        "listen",
        "ext_proc gRPC listen port. Default: 9002",
        metavar="PORT",
        expected="a TCP port 0-65535 (0 = any free port)",
        ge=0,
        le=65535,
    )
    grpc_server: Annotated[GrpcServerKind, BeforeValidator(lower)] = setting(
        "builtin",
        "--grpc-server",
        "EXTPROC_GRPC_SERVER",
        "listen",
        "builtin = the extproc's own HTTP/2 server on the event loop (about 4x less CPU per "
        "request); grpcio = grpcio's asyncio server. Default: builtin",
        metavar="{builtin,grpcio}",
        expected=f"one of {', '.join(GRPC_SERVERS)}",
    )
    protocol: Annotated[Protocol, BeforeValidator(lower)] = setting(
        "envoy",
        "--protocol",
        "EXTPROC_PROTOCOL",
        "listen",
        "what the ext_proc replies speak: envoy = the shipped Envoy configs (override_host "
        "or ORIGINAL_DST); epp = the Gateway API Inference Extension's Endpoint Picker "
        "protocol, for Kubernetes gateways (honours the proxy's endpoint subset hint). "
        "Default: envoy",
        metavar="{envoy,epp}",
        expected=f"one of {', '.join(PROTOCOLS)}",
    )
    epp_fallbacks: Annotated[int, BeforeValidator(whole)] = setting(
        0,
        "--epp-fallbacks",
        "EXTPROC_EPP_FALLBACKS",
        "listen",
        "with --protocol epp: free endpoints listed after the pick (comma-separated, in the "
        "header and the metadata alike) for the proxy to retry on. Envoy's ORIGINAL_DST "
        "cluster keyed on the header (Envoy AI Gateway's wiring) reads one address and fails "
        "on a list: raise it only for a proxy that takes the list. Default: 0",
        metavar="N",
        expected="a whole number 0-16",
        ge=0,
        le=16,
    )
    request_body_budget_mib: Whole = setting(
        DEFAULT_BUDGET_MIB,
        "--request-body-budget-mib",
        "EXTPROC_REQUEST_BODY_BUDGET_MIB",
        "listen",
        "MiB: the most memory all FULL_DUPLEX_STREAMED request bodies being gathered before "
        "their decision may hold together (a body is at most 32 MiB, and at most 7/8 of the "
        "budget; the last 1/8 is kept for bodies of at most 256 KiB). A body that would "
        f"pass it gets the overload reply at once. Default: {DEFAULT_BUDGET_MIB}",
        metavar="MIB",
        expected=f"a whole number of MiB in [1, {MAX_BUDGET_MIB}]",
        ge=1,
        le=MAX_BUDGET_MIB,
    )
    admin_host: str = setting(
        "127.0.0.1",
        "--admin-host",
        "EXTPROC_ADMIN_HOST",
        "listen",
        "admin HTTP listen address; anything but loopback needs --admin-token for POST. "
        "Default: 127.0.0.1",
        metavar="HOST",
        expected="a host",
    )
    admin_port: Whole = setting(
        9003,
        "--admin-port",
        "EXTPROC_ADMIN_PORT",
        "listen",
        "admin HTTP port. Default: 9003",
        metavar="PORT",
        expected="a TCP port 0-65535 (0 = any free port)",
        ge=0,
        le=65535,
    )
    admin_token: str | None = setting(
        None,
        "--admin-token",
        "EXTPROC_ADMIN_TOKEN",
        "listen",
        "bearer token required for POST /busy_threshold when the admin API is not on "
        "loopback. Default: none",
        metavar="TOKEN",
        expected="a token",
    )

    # worker load events ---------------------------------------------------------------
    event_bind: Items = setting(
        lambda: ["tcp://127.0.0.1:5557"],
        "--event-bind",
        "EXTPROC_EVENT_BIND",
        "events",
        "ZMQ endpoint(s) the SUB socket binds, comma-separated or repeated. "
        "Default: tcp://127.0.0.1:5557",
        metavar="ENDPOINT",
        action="append",
        expected="ZMQ endpoints like tcp://127.0.0.1:5557",
    )
    event_connect: Items = setting(
        list,
        "--event-connect",
        "EXTPROC_EVENT_CONNECT",
        "events",
        "ZMQ endpoint(s) the SUB socket connects to (publishers that bind). Default: none",
        metavar="ENDPOINT",
        action="append",
        expected="ZMQ endpoints like tcp://127.0.0.1:5557",
    )
    worker_ttl: Number = setting(
        10.0,
        "--worker-ttl",
        "EXTPROC_WORKER_TTL",
        "events",
        "seconds: a worker silent this long is removed as if it said bye. Default: 10",
        metavar="SECONDS",
        expected="a number of seconds > 0",
        gt=0.0,
        le=86400.0,
        allow_inf_nan=False,
    )
    startup_grace: Number = setting(
        1.0,
        "--startup-grace",
        "EXTPROC_STARTUP_GRACE",
        "events",
        "seconds to listen for worker events before serving ext_proc, so that a restarted "
        "extproc knows the workers before its first decision (Envoy fails open meanwhile). "
        "Default: 1",
        metavar="SECONDS",
        expected="seconds in [0, 60]",
        ge=0.0,
        le=60.0,
        allow_inf_nan=False,
    )
    worker_allow: Items = setting(
        list,
        "--worker-allow",
        "EXTPROC_WORKER_ALLOW",
        "events",
        "allow-list of announced worker endpoints: CIDRs and/or host:port, comma-separated "
        "or repeated. Default: allow all",
        metavar="CIDR|HOST:PORT",
        action="append",
        expected="CIDRs and/or host:port",
    )
    event_curve_secret_key: str | None = setting(
        None,
        "--event-curve-secret-key",
        "EXTPROC_EVENT_CURVE_SECRET_KEY",
        "events",
        "ZeroMQ CURVE: the extproc's secret key file (NAME.key_secret from python -m "
        "extproc.events.keys); with --event-curve-publishers only admitted publishers are "
        "heard (docs/events.md). Default: off (plain TCP)",
        metavar="FILE",
        expected="a CURVE secret key file",
    )
    event_curve_publishers: str | None = setting(
        None,
        "--event-curve-publishers",
        "EXTPROC_EVENT_CURVE_PUBLISHERS",
        "events",
        "ZeroMQ CURVE: directory of the admitted publishers' public key files (*.key). "
        "Default: off",
        metavar="DIR",
        expected="a directory of publisher public keys",
    )

    # replicas -------------------------------------------------------------------------
    replica_publish: Items = setting(
        list,
        "--replica-publish",
        "EXTPROC_REPLICA_PUBLISH",
        "replicas",
        "ZMQ endpoint(s) this replica publishes its estimates to: a forwarder's XSUB port or "
        "the other replicas' event sockets; comma-separated or repeated. Default: none "
        "(sharing off)",
        metavar="ENDPOINT",
        action="append",
        expected="ZMQ endpoints like tcp://127.0.0.1:5557",
    )
    replica_id: Annotated[str | None, BeforeValidator(_off)] = setting(
        None,
        "--replica-id",
        "EXTPROC_REPLICA_ID",
        "replicas",
        "this replica's id on the event plane. Default: host-pid-random, new at each start",
        metavar="ID",
        expected="at most 128 characters without spaces",
        max_length=128,
        pattern=r"^\S+$",
    )
    replica_interval: Number = setting(
        1.0,
        "--replica-interval",
        "EXTPROC_REPLICA_INTERVAL",
        "replicas",
        "seconds between full estimate snapshots (changes go out at once). Default: 1",
        metavar="SECONDS",
        expected="seconds in (0, 60]",
        gt=0.0,
        le=60.0,
        allow_inf_nan=False,
    )
    replica_ttl: Number = setting(
        3.0,
        "--replica-ttl",
        "EXTPROC_REPLICA_TTL",
        "replicas",
        "seconds of silence after which another replica's estimate is dropped. Default: 3",
        metavar="SECONDS",
        expected="seconds in (0, 3600]",
        gt=0.0,
        le=3600.0,
        allow_inf_nan=False,
    )

    # logging --------------------------------------------------------------------------
    log_level: LogLevel = setting(
        "INFO",
        "--log-level",
        "EXTPROC_LOG_LEVEL",
        "logging",
        "DEBUG, INFO, WARNING or ERROR. Default: INFO",
        metavar="LEVEL",
        expected="DEBUG, INFO, WARNING or ERROR",
    )

    @field_validator("event_curve_secret_key", mode="before")
    @classmethod
    def _curve_secret(cls, v: Any) -> str | None:
        from extproc.events.curve import CurveKeyError, load_key_pair

        path = _off(v)
        if path is None:
            return None
        try:
            load_key_pair(str(path))
        except CurveKeyError as exc:
            raise ValueError(f"expected a CURVE secret key file: {exc}") from None
        return str(path)

    @field_validator("event_curve_publishers", mode="before")
    @classmethod
    def _curve_publishers(cls, v: Any) -> str | None:
        from extproc.events.curve import CurveKeyError, check_publisher_dir

        path = _off(v)
        if path is None:
            return None
        try:
            check_publisher_dir(str(path))
        except CurveKeyError as exc:
            raise ValueError(f"expected a directory of publisher public keys: {exc}") from None
        return str(path)

    @field_validator("classes_file", mode="before")
    @classmethod
    def _classes_file(cls, v: Any) -> str | None:
        path = _off(v)
        if path is None:
            return None
        load_class_table(str(path))
        return str(path)

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

    @field_validator("event_bind", "event_connect", "replica_publish")
    @classmethod
    def _zmq_endpoints(cls, v: list[str]) -> list[str]:
        for endpoint in v:
            if not _ZMQ.match(endpoint):
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
        path = _off(v)
        if path is None:
            return None
        if not os.path.isfile(str(path)):
            raise ValueError(f"expected a local tokenizer.json file; {path!r} does not exist")
        return str(path)

    @property
    def kv_mode(self) -> bool:
        return self.router_mode == "kv"

    @property
    def overload_status(self) -> int:
        return self.overload.status

    def startup_warnings(self) -> list[str]:
        """The one-line warnings to log once at startup."""
        warnings = []
        if self.admission_control is not None:
            warnings.append(
                f"--admission-control={self.admission_control} (DYN_ADMISSION_CONTROL) is "
                "deprecated and has no effect; use --active-decode-blocks-threshold, "
                "--active-prefill-tokens-threshold or --active-prefill-tokens-threshold-frac "
                "(DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD, DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD, "
                "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC) instead"
            )
        if self.ttft_source is not None:
            warnings.append(
                f"--ttft-source={self.ttft_source} (EXTPROC_TTFT_SOURCE) is deprecated and has "
                "no effect: the latency controller it chose a source for was replaced by "
                "deadline admission, which predicts each request's time to first token from "
                "the gateway's own timings and the engines' queue fields (--ttft-p99-target-ms; "
                "docs/latency-target.md)"
            )
        if self.active_decode_blocks_threshold is not None and not self.kv_mode:
            warnings.append(
                f"--active-decode-blocks-threshold={self.active_decode_blocks_threshold} is "
                f"inactive: decode-block checks run only with --router-mode kv "
                f"(router mode is {self.router_mode})"
            )
        if not is_loopback_host(self.admin_host) and not self.admin_token:
            warnings.append(
                f"admin API listens on {self.admin_host} without --admin-token: "
                "POST /busy_threshold is refused (401) until a token is set"
            )
        if self.overload.warning:
            warnings.append(self.overload.warning)
        if self.event_curve_secret_key is None:
            wide = [e for e in self.event_bind if not _loopback_endpoint(e)]
            if wide:
                warnings.append(
                    f"the event socket listens beyond loopback ({', '.join(wide)}) without "
                    "CURVE: anyone who reaches it can announce workers and report load; "
                    "see --event-curve-secret-key and --event-curve-publishers"
                )
        return warnings


# --help groups, in order: key -> title
GROUPS = {key: title for key, (title, _) in Settings.GROUPS.items()}
# field name -> its row (flag, env, group, expected, metavar, action, help, ...)
TABLE = Settings.rows()
# name -> (flag, env var) of every setting that has a flag
SETTING_NAMES: dict[str, tuple[str, str]] = {
    name: (row["flag"], row["env"]) for name, row in TABLE.items() if row["flag"]
}
DESCRIPTION = (
    "Envoy external processor that rejects requests with 529 when every LLM worker "
    "is busy and otherwise routes each request to a free worker. Every flag also "
    "reads the environment variable shown; a flag wins over its variable. "
    "Thresholds are off until given; 'None' or an empty value turns one off."
)


def build_parser() -> argparse.ArgumentParser:
    """The command line, generated from the settings table."""
    return Settings.build_parser(
        "python -m extproc", DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def load_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Parse flags over the environment; raise SettingsError on any invalid value."""
    return Settings.read(vars(build_parser().parse_args(argv)), environ)


def all_startup_warnings(settings: Settings) -> list[str]:
    """The warnings to log once at startup (kept for callers; same as the method)."""
    return settings.startup_warnings()
