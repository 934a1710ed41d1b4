"""Settings of the sidecar agent (``python -m llmworker.agent``): its flags, their checks, and
:func:`parse_args`, which turns a command line and the environment into :class:`AgentSettings`.

The rows of :class:`AgentFlags` are the agent's own settings; the ones it shares with the
simulated worker (admission, the event publisher's timing and keys, logging) come from
:class:`llmworker.cli.WorkerFlags`. ``--help`` lists every flag with its unit.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BeforeValidator, model_validator
from yarl import URL

from extproc.events.curve import CurveClient
from extproc.events.schema import ConfigEvent, EventRejected, decode, encode
from llmworker import cli
from llmworker.admission import ADMISSION_ENVS, ENGINE_LIMIT_ENV, AdmissionConfig
from llmworker.engine_metrics import ENGINES, Engine
from llmworker.netaddr import join_host_port, join_url
from llmworker.settings import Number, OptWhole, SettingsError, option


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """Everything the agent needs, validated."""

    engine: Engine
    engine_url: URL
    model: str
    worker_id: str
    publish: tuple[str, ...]
    endpoint: str | None = None
    listen: tuple[str, int] | None = None
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    metrics_path: str = "/metrics"
    interval: float = 0.1
    scrape_timeout: float = 1.0
    engine_down_grace: float = 10.0
    block_size: int | None = None
    kv_total_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    dp_size: int | None = None
    kv_events_bind: str | None = None
    kv_events_topic: str = "kv-events"
    kv_events_timeout: float = 30.0
    worker_type: str = "decode"
    heartbeat: float = 2.0
    debounce: float = 0.005
    curve: CurveClient | None = None
    shutdown_timeout: float = 5.0
    log_level: str = "INFO"

    @property
    def metrics_url(self) -> URL:
        return join_url(self.engine_url, self.metrics_path)

    @property
    def kv_events_endpoints(self) -> tuple[str, ...]:
        """Where the agent binds for vLLM's KV events: ``--kv-events-bind``'s port for rank
        0, the next ports for the next ranks (vLLM offsets its endpoint by the rank)."""
        if self.kv_events_bind is None:
            return ()
        base, port = _kv_events_parts(self.kv_events_bind)
        return tuple(f"{base}:{port + r}" for r in range(self.dp_size or 1))


def _engine_url(text: str) -> URL:
    try:
        url = URL(text)
    except ValueError:
        url = URL()
    if url.scheme not in ("http", "https") or not url.host or url.query_string or url.fragment:
        raise ValueError("expected the engine's base URL like http://127.0.0.1:8000")
    return url


def _metrics_path(text: str) -> str:
    if not text.startswith("/"):
        raise ValueError("expected a path starting with '/'")
    return text


def _base_url(text: str) -> str:
    _engine_url(text)
    return text


def _kv_events_parts(text: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` split into ``tcp://HOST`` and the port."""
    base, _, port = text.rpartition(":")
    return base, int(port)


def _kv_events_bind(text: str) -> str:
    expected = (
        "expected tcp://HOST:PORT to bind, with a port 1-65535 (the endpoint vLLM's "
        "--kv-events-config names; vLLM connects to it)"
    )
    if not text.startswith("tcp://"):
        raise ValueError(expected)
    host, sep, port = text[len("tcp://") :].rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(expected)
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise ValueError(expected + "; an IPv6 host needs brackets")
    return text


def _listen(text: Any) -> tuple[str, int] | None:
    if text is None or isinstance(text, tuple):
        return text
    text = str(text)
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError("expected HOST:PORT (port 0-65535)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError("expected HOST:PORT; an IPv6 listen address needs brackets")
    return host or "0.0.0.0", int(port_text)


class AgentFlags(cli.WorkerFlags):
    """The agent's settings table."""

    GROUPS: ClassVar[dict[str, tuple[str, str | None]]] = {
        "engine": ("engine", None),
        "facts": ("engine facts", "Used only when the engine's metrics do not carry the value."),
        "worker": ("worker", None),
        "events": cli.WorkerFlags.GROUPS["events"],
        "admission": ("proxy and worker-side admission", cli.ADMISSION_ENV_HELP),
        "logging": cli.WorkerFlags.GROUPS["logging"],
    }

    engine: Engine = option(
        ..., "--engine", "engine", "engine kind", choices=ENGINES, expected="an engine kind"
    )
    engine_url: Annotated[str, AfterValidator(_base_url)] = option(
        ...,
        "--engine-url",
        "engine",
        "engine's OpenAI HTTP server, e.g. http://127.0.0.1:8000",
        metavar="URL",
        expected="the engine's base URL",
    )
    metrics_path: Annotated[str, AfterValidator(_metrics_path)] = option(
        "/metrics",
        "--metrics-path",
        "engine",
        "engine's metrics path",
        metavar="PATH",
        expected="a path starting with '/'",
    )
    interval: Number = option(
        0.1,
        "--interval",
        "engine",
        "scrape period, in seconds",
        metavar="SECONDS",
        expected="a finite number of seconds > 0",
        gt=0,
    )
    scrape_timeout: Number = option(
        1.0,
        "--scrape-timeout",
        "engine",
        "timeout of one scrape, in seconds",
        metavar="SECONDS",
        expected="a finite number of seconds > 0",
        gt=0,
    )
    engine_down_grace: Number = option(
        10.0,
        "--engine-down-grace",
        "engine",
        "seconds without usable metrics before the agent says bye (the last state is "
        "repeated meanwhile)",
        metavar="SECONDS",
        expected="a finite number of seconds >= 0",
        ge=0,
    )
    block_size: OptWhole = option(
        None,
        "--block-size",
        "facts",
        "tokens per KV block (default: the engine's, else 16)",
        metavar="TOKENS",
        expected="an integer >= 1",
        ge=1,
    )
    kv_total_blocks: OptWhole = option(
        None,
        "--kv-total-blocks",
        "facts",
        "KV cache capacity per DP rank, in blocks of --block-size tokens",
        metavar="BLOCKS",
        expected="an integer >= 0",
        ge=0,
    )
    max_num_batched_tokens: OptWhole = option(
        None,
        "--max-num-batched-tokens",
        "facts",
        "engine's per-step token budget, in tokens",
        metavar="TOKENS",
        expected="an integer >= 1",
        ge=1,
    )
    max_num_seqs: OptWhole = option(
        None,
        "--max-num-seqs",
        "facts",
        "most sequences the engine runs at once per DP rank (vLLM --max-num-seqs, SGLang "
        "--max-running-requests); unset and not printed by the engine = not reported",
        metavar="N",
        expected="an integer >= 1",
        ge=1,
    )
    dp_size: OptWhole = option(
        None,
        "--dp-size",
        "facts",
        "data-parallel ranks behind the endpoint (default: the ranks the metrics show)",
        metavar="N",
        expected="an integer >= 1",
        ge=1,
    )
    kv_events_bind: Annotated[str, AfterValidator(_kv_events_bind)] | None = option(
        None,
        "--kv-events-bind",
        "engine",
        "vLLM only: bind here for vLLM's own KV events, the endpoint of vLLM's "
        "--kv-events-config (rank r of a data-parallel vLLM publishes to PORT + r; give "
        "--dp-size); unset = the scrape alone",
        metavar="tcp://HOST:PORT",
        expected="tcp://HOST:PORT with a port 1-65535",
    )
    kv_events_topic: str = option(
        "kv-events",
        "--kv-events-topic",
        "engine",
        "the topic of vLLM's --kv-events-config",
        metavar="TOPIC",
        expected="a topic",
    )
    kv_events_timeout: Number = option(
        30.0,
        "--kv-events-timeout",
        "engine",
        "with --kv-events-bind: warn when vLLM has held blocks this many seconds and no KV "
        "event has arrived",
        metavar="SECONDS",
        expected="a finite number of seconds > 0",
        gt=0,
    )
    model: str = option(
        ..., "--model", "worker", "served model name, as clients send it", expected="a name"
    )
    worker_id: str = option(
        ..., "--worker-id", "worker", "stable worker id in events", expected="an id"
    )
    endpoint: cli.EventEndpoint | None = option(
        None,
        "--endpoint",
        "worker",
        "where Envoy reaches this worker's OpenAI server (required without --listen; "
        "default with --listen: the listen address)",
        metavar="HOST:PORT",
        expected="HOST:PORT",
    )
    worker_type: Literal["decode", "prefill"] = option(
        "decode",
        "--worker-type",
        "worker",
        "worker role",
        choices=("decode", "prefill"),
        expected="decode or prefill",
    )
    publish: list[cli.ConnectableZmqEndpoint] = option(
        ...,
        "--publish",
        "events",
        "ZeroMQ endpoint of the extproc event socket, e.g. tcp://127.0.0.1:5557 (repeatable)",
        metavar="ENDPOINT",
        action="append",
        expected="a ZeroMQ endpoint like tcp://127.0.0.1:5557",
    )
    listen: Annotated[tuple[str, int] | None, BeforeValidator(_listen)] = option(
        None,
        "--listen",
        "admission",
        "serve a reverse proxy to the engine here (port 0 = any free); unset = no proxy",
        metavar="HOST:PORT",
        expected="HOST:PORT (port 0-65535)",
    )
    shutdown_timeout: Number = option(
        5.0,
        "--shutdown-timeout",
        "admission",
        "seconds in-flight proxied requests get to finish on SIGTERM",
        metavar="SECONDS",
        expected="a finite number of seconds >= 0",
        ge=0,
    )

    @model_validator(mode="after")
    def _endpoint_and_admission(self) -> AgentFlags:
        if self.listen is None and self.endpoint is None:
            raise ValueError("--endpoint HOST:PORT is required unless --listen is given")
        if self.listen is None and self.engine_request_limit is not None:
            raise ValueError(
                "--engine-request-limit needs --listen: only the proxy can admit requests"
            )
        if self.kv_events_bind is not None:
            if self.engine != "vllm":
                raise ValueError(
                    f"--kv-events-bind is for --engine vllm (vLLM's KV events), "
                    f"not --engine {self.engine}"
                )
            _, port = _kv_events_parts(self.kv_events_bind)
            if port + (self.dp_size or 1) - 1 > 65535:
                raise ValueError(
                    f"--kv-events-bind {self.kv_events_bind} with --dp-size {self.dp_size}: "
                    "the last rank's port would be above 65535"
                )
        endpoint = self.endpoint
        if endpoint is None and self.listen is not None:
            endpoint = join_host_port(self.listen[0], self.listen[1] or 1)
        probe = ConfigEvent(worker_id=self.worker_id, model=self.model, endpoint=endpoint or "")
        try:
            decode(*encode(probe))
        except EventRejected as exc:
            raise ValueError(f"--worker-id/--model/--endpoint: {exc.detail}") from None
        return self


def build_parser() -> argparse.ArgumentParser:
    return AgentFlags.build_parser(
        "python -m llmworker.agent",
        "Sidecar next to a vLLM, SGLang or llama.cpp server: scrapes its metrics "
        "and publishes the worker's config and per-rank load to the extproc; optionally "
        "fronts the engine as a reverse proxy with worker-side admission.",
    )


def parse_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[AgentSettings, str | None]:
    """(settings, startup warning or None); exits 2 with a message on a bad setting.

    Without ``--listen`` the admission variables are not read (only the proxy admits);
    a set DYN_ENGINE_REQUEST_LIMIT is then a warning."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    env = os.environ if environ is None else environ
    proxied = "listen" in args
    try:
        flags = AgentFlags.read(
            args, env if proxied else {k: v for k, v in env.items() if k not in ADMISSION_ENVS}
        )
    except SettingsError as exc:
        parser.error(str(exc))
    admission, warning = flags.admission_config()
    if (
        not proxied
        and (os.environ if environ is None else environ).get(ENGINE_LIMIT_ENV, "").strip()
    ):
        warning = f"{ENGINE_LIMIT_ENV} is set but has no effect without --listen"
    settings = AgentSettings(
        engine=flags.engine,
        engine_url=_engine_url(flags.engine_url),
        model=flags.model,
        worker_id=flags.worker_id,
        publish=tuple(flags.publish),
        endpoint=flags.endpoint,
        listen=flags.listen,
        admission=admission,
        metrics_path=flags.metrics_path,
        interval=flags.interval,
        scrape_timeout=flags.scrape_timeout,
        engine_down_grace=flags.engine_down_grace,
        block_size=flags.block_size,
        kv_total_blocks=flags.kv_total_blocks,
        max_num_batched_tokens=flags.max_num_batched_tokens,
        max_num_seqs=flags.max_num_seqs,
        dp_size=flags.dp_size,
        kv_events_bind=flags.kv_events_bind,
        kv_events_topic=flags.kv_events_topic,
        kv_events_timeout=flags.kv_events_timeout,
        worker_type=flags.worker_type,
        heartbeat=flags.heartbeat,
        curve=flags.curve(),
        debounce=flags.debounce_ms / 1e3,
        shutdown_timeout=flags.shutdown_timeout,
        log_level=flags.log_level,
    )
    return settings, warning
