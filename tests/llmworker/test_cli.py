"""The worker programs' settings tables: each flag's rule, errors that name the flag or
variable, the value and what was expected, flags over variables, and exit code 2."""

from __future__ import annotations

from typing import Any

import pytest

from llmworker import agent_settings, sim_settings
from llmworker.agent_settings import AgentFlags
from llmworker.settings import SettingsError, WorkerSettings
from llmworker.sim_settings import SimFlags

AGENT = {
    "engine": "vllm",
    "engine_url": "http://127.0.0.1:8000",
    "model": "m",
    "worker_id": "w",
    "endpoint": "h:1",
    "publish": ["tcp://127.0.0.1:5557"],
}


def _read(model: type[WorkerSettings], flags: dict[str, Any], env: dict[str, str]) -> Any:
    base = AGENT if model is AgentFlags else {}
    return model.read({**base, **flags}, env)


@pytest.mark.parametrize(
    ("model", "name", "text", "value"),
    [
        (SimFlags, "kv_total_blocks", " +5 ", 5),
        (AgentFlags, "kv_total_blocks", "0", 0),
        (SimFlags, "speedup", "1e3", 1000.0),
        (SimFlags, "step_base_ms", "0", 0.0),
        (AgentFlags, "interval", "0.25", 0.25),
        (AgentFlags, "engine_down_grace", "0", 0.0),
        (SimFlags, "port", "0", 0),
        (SimFlags, "host", "[::1]", "::1"),
        (AgentFlags, "listen", "[::1]:0", ("::1", 0)),
        (SimFlags, "log_level", "debug", "DEBUG"),
    ],
)
def test_values_accepted(model: type[WorkerSettings], name: str, text: str, value: Any) -> None:
    assert getattr(_read(model, {name: text}, {}), name) == value


@pytest.mark.parametrize(
    ("model", "flags", "env", "message"),
    [
        (SimFlags, {"kv_total_blocks": "0"}, {},
         "--kv-total-blocks='0' is invalid: expected an integer >= 1"),
        (SimFlags, {"max_num_seqs": "1.0"}, {},
         "--max-num-seqs='1.0' is invalid: expected an integer >= 1"),
        (AgentFlags, {"kv_total_blocks": "-1"}, {},
         "--kv-total-blocks='-1' is invalid: expected an integer >= 0"),
        (SimFlags, {"speedup": "x"}, {}, "--speedup='x' is invalid: expected a finite number > 0"),
        (SimFlags, {"speedup": "-2"}, {},
         "--speedup='-2' is invalid: expected a finite number > 0"),
        (SimFlags, {"speedup": "nan"}, {},
         "--speedup='nan' is invalid: expected a finite number > 0"),
        (SimFlags, {"shutdown_timeout": "-inf"}, {},
         "--shutdown-timeout='-inf' is invalid: expected a finite number >= 0"),
        (AgentFlags, {"interval": "0"}, {},
         "--interval='0' is invalid: expected a finite number of seconds > 0"),
        (AgentFlags, {"engine_down_grace": "inf"}, {},
         "--engine-down-grace='inf' is invalid: expected a finite number of seconds >= 0"),
        (SimFlags, {"port": "70000"}, {}, "--port='70000' is invalid: expected a port 0-65535"),
        (SimFlags, {"port": "http"}, {}, "--port='http' is invalid: expected a port 0-65535"),
        (SimFlags, {"host": "[zz::1"}, {},
         "--host='[zz::1' is invalid: expected an IP address or host name"),
        (SimFlags, {"publish": ["tcp://127.0.0.1:1", "localhost:5557"]}, {},
         "--publish='localhost:5557' is invalid: expected a ZeroMQ endpoint like "
         "tcp://127.0.0.1:5557"),
        (SimFlags, {"advertise": "nohost"}, {},
         "--advertise='nohost' is invalid: endpoint 'nohost' is not host:port"),
        (AgentFlags, {"listen": "::1:80"}, {},
         "--listen='::1:80' is invalid: expected HOST:PORT; an IPv6 listen address needs "
         "brackets"),
        (AgentFlags, {"listen": "h:99999"}, {},
         "--listen='h:99999' is invalid: expected HOST:PORT (port 0-65535)"),
        (AgentFlags, {"engine_url": "127.0.0.1:8000"}, {},
         "--engine-url='127.0.0.1:8000' is invalid: expected the engine's base URL like "
         "http://127.0.0.1:8000"),
        (AgentFlags, {"metrics_path": "metrics"}, {},
         "--metrics-path='metrics' is invalid: expected a path starting with '/'"),
        (SimFlags, {}, {"DYN_ENGINE_REQUEST_LIMIT": "x"},
         "DYN_ENGINE_REQUEST_LIMIT='x' is invalid: expected an integer >= 1"),
        (SimFlags, {"engine_request_limit": "2"}, {"DYN_DYNAMO_REQUEST_QUEUE_LIMIT": "1"},
         "DYN_DYNAMO_REQUEST_QUEUE_LIMIT='1' is invalid: expected an integer >= 2"),
        (SimFlags, {"curve_secret_key": "k"}, {},
         "--curve-secret-key and --curve-server-key go together"),
        (AgentFlags, {"endpoint": None}, {},
         "--endpoint HOST:PORT is required unless --listen is given"),
        (AgentFlags, {"endpoint": None, "listen": "127.0.0.1:0", "engine_request_limit": "x"},
         {}, "--engine-request-limit='x' is invalid: expected an integer >= 1"),
        (AgentFlags, {"engine_request_limit": "2"}, {},
         "--engine-request-limit needs --listen: only the proxy can admit requests"),
    ],
)  # fmt: skip
def test_errors_name_the_setting_the_value_and_what_was_expected(
    model: type[WorkerSettings], flags: dict[str, Any], env: dict[str, str], message: str
) -> None:
    with pytest.raises(SettingsError) as info:
        _read(model, flags, env)
    assert str(info.value) == message


def test_a_required_setting_left_out_is_named() -> None:
    with pytest.raises(SettingsError, match=r"^--worker-id is required: expected an id$"):
        AgentFlags.read({k: v for k, v in AGENT.items() if k != "worker_id"}, {})


def test_a_flag_wins_over_its_variable_and_only_declared_variables_are_read() -> None:
    env = {
        "DYN_ENGINE_REQUEST_LIMIT": "4",
        "DYN_DYNAMO_REQUEST_QUEUE_LIMIT": " 3 ",
        "kv_total_blocks": "0",  # a field name is not a variable
        "port": "x",
    }
    s = SimFlags.read({"engine_request_limit": "7"}, env)
    assert (s.engine_request_limit, s.queue_limit, s.kv_total_blocks, s.port) == (7, 3, 2048, 8001)
    s = SimFlags.read({}, {**env, "DYN_ENGINE_REQUEST_LIMIT": "  "})  # blank: unset
    assert (s.engine_request_limit, s.queue_limit) == (None, 16)


def test_every_flag_is_in_help_with_its_variable() -> None:
    for model, parser in (
        (SimFlags, sim_settings.build_parser()),
        (AgentFlags, agent_settings.build_parser()),
    ):
        text = parser.format_help()
        for row in model.rows().values():
            if row["flag"]:
                assert row["flag"] in text
        assert "[env DYN_ENGINE_REQUEST_LIMIT]" in text
        assert "DYN_DYNAMO_REQUEST_QUEUE_LIMIT" in text and "DYN_HTTP_OVERLOAD_STATUS_CODE" in text


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--block-size", "0"], {}, "--block-size='0' is invalid: expected an integer >= 1"),
        (["--log-level", "loud"], {}, "--log-level"),
        ([], {"DYN_DYNAMO_REQUEST_QUEUE_LIMIT": "1", "DYN_ENGINE_REQUEST_LIMIT": "2"},
         "DYN_DYNAMO_REQUEST_QUEUE_LIMIT='1'"),
    ],
)  # fmt: skip
def test_sim_exits_2_naming_the_setting(
    argv: list[str], env: dict[str, str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        sim_settings.parse_args(argv, env)
    assert exited.value.code == 2
    assert named in capsys.readouterr().err
