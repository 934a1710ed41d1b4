"""Settings of the simulated worker (``python -m llmworker.sim``): its flags, their checks, and
:func:`parse_args`, which turns a command line and the environment into :class:`SimSettings`.

The rows of :class:`SimFlags` are the simulator's own settings (server and engine); the ones it
shares with the agent (admission, the event publisher's timing and keys, logging) come from
:class:`llmworker.cli.WorkerFlags`. ``--help`` lists every flag with its unit.
"""

from __future__ import annotations

import argparse
import ipaddress
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, model_validator

from extproc.events.curve import CurveClient
from llmworker import cli
from llmworker.admission import AdmissionConfig
from llmworker.engine import EngineConfig
from llmworker.profiles import PROFILES, profile_config
from llmworker.settings import Number, Whole, option


@dataclass(frozen=True, slots=True)
class SimSettings:
    """Everything the simulated worker needs, validated."""

    host: str
    port: int
    model: str
    worker_id: str
    engine: EngineConfig
    admission: AdmissionConfig
    dp_size: int = 1
    publish: tuple[str, ...] = ()
    advertise: str | None = None
    heartbeat: float = 2.0
    debounce: float = 0.005
    curve: CurveClient | None = None
    default_max_tokens: int = 16
    embedding_dim: int = 8
    shutdown_timeout: float = 5.0
    log_level: str = "INFO"


def _port(v: int) -> int:
    if not 0 <= v <= 65535:
        raise ValueError("expected a port 0-65535")
    return v


def _host(text: str) -> str:
    """A listen address; an IPv6 one may be in brackets (they are removed)."""
    host = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError("expected an IP address or host name") from None
    return host


_ENGINE = EngineConfig()


class SimFlags(cli.WorkerFlags):
    """The simulated worker's settings table."""

    GROUPS: ClassVar[dict[str, tuple[str, str | None]]] = {
        "server": ("server", None),
        "engine": ("engine", None),
        **cli.WorkerFlags.GROUPS,
    }

    host: Annotated[str, AfterValidator(_host)] = option(
        "127.0.0.1", "--host", "server", "listen address", expected="an IP address or host name"
    )
    port: Annotated[Whole, AfterValidator(_port)] = option(
        8001, "--port", "server", "listen TCP port (0 = any free)", expected="a port 0-65535"
    )
    model: str = option("sim-model", "--model", "server", "served model name", expected="a name")
    worker_id: str | None = option(
        None,
        "--worker-id",
        "server",
        "stable worker id in events and the x-worker-id header (default: sim-<port>)",
        expected="an id",
    )
    default_max_tokens: Whole = option(
        16,
        "--default-max-tokens",
        "server",
        "output tokens when a request sets no max_tokens",
        expected="an integer >= 1",
        ge=1,
    )
    embedding_dim: Whole = option(
        8,
        "--embedding-dim",
        "server",
        "length of the vectors /v1/embeddings returns",
        expected="an integer >= 1",
        ge=1,
    )
    shutdown_timeout: Number = option(
        5.0,
        "--shutdown-timeout",
        "server",
        "seconds in-flight requests get to finish on SIGTERM",
        expected="a finite number >= 0",
        ge=0,
    )
    kv_total_blocks: Whole = option(
        _ENGINE.kv_total_blocks,
        "--kv-total-blocks",
        "engine",
        "KV cache capacity per DP rank, in blocks",
        expected="an integer >= 1",
        ge=1,
    )
    block_size: Whole = option(
        _ENGINE.block_size,
        "--block-size",
        "engine",
        "tokens per KV block",
        expected="an integer >= 1",
        ge=1,
    )
    max_num_seqs: Whole = option(
        _ENGINE.max_num_seqs,
        "--max-num-seqs",
        "engine",
        "most sequences running at once per rank",
        expected="an integer >= 1",
        ge=1,
    )
    max_num_batched_tokens: Whole = option(
        _ENGINE.max_num_batched_tokens,
        "--max-num-batched-tokens",
        "engine",
        "token budget of one step (chunked prefill), in tokens",
        expected="an integer >= 1",
        ge=1,
    )
    dp_size: Whole = option(
        1,
        "--dp-size",
        "engine",
        "data-parallel ranks (one engine each) behind this endpoint",
        expected="an integer >= 1",
        ge=1,
    )
    speedup: Number = option(
        _ENGINE.speedup,
        "--speedup",
        "engine",
        "time scale: every modelled duration is divided by this (1 = real pace)",
        expected="a finite number > 0",
        gt=0,
    )
    step_base_ms: Number = option(
        _ENGINE.step_base_s * 1e3,
        "--step-base-ms",
        "engine",
        "fixed cost of one engine step, in milliseconds at speedup 1",
        expected="a finite number >= 0",
        ge=0,
    )
    step_prefill_token_us: Number = option(
        _ENGINE.step_prefill_token_s * 1e6,
        "--step-prefill-token-us",
        "engine",
        "cost per prefill token in a step, in microseconds at speedup 1",
        expected="a finite number >= 0",
        ge=0,
    )
    step_decode_seq_us: Number = option(
        _ENGINE.step_decode_seq_s * 1e6,
        "--step-decode-seq-us",
        "engine",
        "cost per decoding sequence in a step, in microseconds at speedup 1",
        expected="a finite number >= 0",
        ge=0,
    )
    no_preemption: bool = option(
        False,
        "--no-preemption",
        "engine",
        "reserve KV for the whole output at admission instead of preempting",
        action="store_true",
        expected="a switch",
    )
    profile: str | None = option(
        None,
        "--profile",
        "engine",
        "size and step costs of a real engine as measured (llamacpp-cpu: llama.cpp serving "
        "SmolLM2-135M on one CPU thread, 2 slots, 1024 tokens of context; vllm-cpu: vLLM "
        "serving it on one CPU, 4 sequences, 17 blocks of 128 tokens, one kept aside, and "
        "its chat template's tokens counted); engine flags "
        "given beside it win; unset = the simulator's own defaults",
        choices=tuple(PROFILES),
        expected="a profile name: " + ", ".join(PROFILES),
    )
    publish: list[cli.ZmqEndpoint] = option(
        [],
        "--publish",
        "events",
        "ZeroMQ endpoint of the extproc event socket, e.g. tcp://127.0.0.1:5557 "
        "(repeatable); unset = publish nothing",
        metavar="ENDPOINT",
        action="append",
        expected="a ZeroMQ endpoint like tcp://127.0.0.1:5557",
    )
    advertise: cli.EventEndpoint | None = option(
        None,
        "--advertise",
        "events",
        "endpoint announced in config events (default: --host and the bound port)",
        metavar="HOST:PORT",
        expected="HOST:PORT",
    )

    @model_validator(mode="after")
    def _engine_config(self) -> SimFlags:
        self.engine()
        return self

    def engine(self) -> EngineConfig:
        # flag field -> (EngineConfig field, value)
        values: dict[str, tuple[str, Any]] = {
            "kv_total_blocks": ("kv_total_blocks", self.kv_total_blocks),
            "block_size": ("block_size", self.block_size),
            "max_num_seqs": ("max_num_seqs", self.max_num_seqs),
            "max_num_batched_tokens": ("max_num_batched_tokens", self.max_num_batched_tokens),
            "step_base_ms": ("step_base_s", self.step_base_ms / 1e3),
            "step_prefill_token_us": ("step_prefill_token_s", self.step_prefill_token_us / 1e6),
            "step_decode_seq_us": ("step_decode_seq_s", self.step_decode_seq_us / 1e6),
            "speedup": ("speedup", self.speedup),
            "no_preemption": ("preemption", not self.no_preemption),
        }
        if self.profile is None:
            return EngineConfig(**dict(values.values()))
        # The profile, with the engine flags that were given on top of it.
        given = dict(v for name, v in values.items() if name in self.model_fields_set)
        return profile_config(self.profile, **given)


def build_parser() -> argparse.ArgumentParser:
    return SimFlags.build_parser(
        "python -m llmworker.sim",
        "Simulated OpenAI-compatible LLM worker (vLLM-like continuous batching) "
        "that publishes its load to the extproc.",
    )


def parse_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[SimSettings, str | None]:
    """(settings, startup warning or None); exits 2 with a message on a bad setting."""
    flags = SimFlags.parse(build_parser(), argv, environ)
    admission, warning = flags.admission_config()
    settings = SimSettings(
        host=flags.host,
        port=flags.port,
        model=flags.model,
        worker_id=flags.worker_id or f"sim-{flags.port or uuid.uuid4().hex[:8]}",
        engine=flags.engine(),
        admission=admission,
        dp_size=flags.dp_size,
        publish=tuple(flags.publish),
        advertise=flags.advertise,
        heartbeat=flags.heartbeat,
        curve=flags.curve(),
        debounce=flags.debounce_ms / 1e3,
        default_max_tokens=flags.default_max_tokens,
        embedding_dim=flags.embedding_dim,
        shutdown_timeout=flags.shutdown_timeout,
        log_level=flags.log_level,
    )
    return settings, warning
