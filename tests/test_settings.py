"""Flags and environment variables (docs/configuration.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from extproc.devstack import Extproc, wait_until
from extproc.settings import SETTING_NAMES, SettingsError, all_startup_warnings, load_settings


def test_defaults_all_thresholds_off() -> None:
    s = load_settings([], {})
    assert s.active_decode_blocks_threshold is None
    assert s.active_prefill_tokens_threshold is None
    assert s.active_prefill_tokens_threshold_frac is None
    assert s.router_queue_threshold is None
    assert (s.router_mode, s.router_track_output_blocks) == ("kv", False)
    assert (s.grpc_port, s.admin_port, s.worker_ttl) == (9002, 9003, 10.0)
    assert s.startup_grace == 1.0
    assert s.grpc_server == "builtin"
    assert load_settings([], {"EXTPROC_GRPC_SERVER": " GRPCIO "}).grpc_server == "grpcio"
    assert s.event_bind == ["tcp://127.0.0.1:5557"]
    assert s.admin_host == "127.0.0.1"
    assert s.overload_status == 529
    assert all_startup_warnings(s) == []


def test_each_threshold_is_independent() -> None:
    s = load_settings(["--active-prefill-tokens-threshold", "10"], {})
    assert s.active_prefill_tokens_threshold == 10
    assert s.active_decode_blocks_threshold is None
    assert s.active_prefill_tokens_threshold_frac is None


@pytest.mark.parametrize("off", ["None", "none", "", "  "])
def test_none_and_empty_disable(off: str) -> None:
    env = {
        "DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD": off,
        "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD": off,
        "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC": off,
    }
    s = load_settings([], env)
    assert s.active_decode_blocks_threshold is None
    assert s.active_prefill_tokens_threshold is None
    assert s.active_prefill_tokens_threshold_frac is None


def test_flag_wins_over_env_including_none() -> None:
    env = {
        "DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD": "0.9",
        "DYN_ROUTER_MODE": "random",
        "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD": "5",
    }
    s = load_settings(
        [
            "--active-decode-blocks-threshold",
            "0.25",
            "--router-mode",
            "kv",
            "--active-prefill-tokens-threshold",
            "None",
        ],
        env,
    )
    assert s.active_decode_blocks_threshold == 0.25
    assert s.router_mode == "kv"
    assert s.active_prefill_tokens_threshold is None
    assert load_settings([], env).active_decode_blocks_threshold == 0.9


def test_values_parse() -> None:
    s = load_settings(
        [
            "--active-prefill-tokens-threshold",
            str(2**64 - 1),
            "--active-prefill-tokens-threshold-frac",
            "2.5",
            "--router-track-output-blocks",
            "--worker-allow",
            "10.0.0.0/8,127.0.0.1:8000",
            "--worker-allow",
            "::1/128",
            "--event-bind",
            "tcp://127.0.0.1:1",
            "--event-bind",
            "tcp://127.0.0.1:2",
        ],
        {"DYN_ROUTER_QUEUE_THRESHOLD": "1.5"},
    )
    assert s.active_prefill_tokens_threshold == 2**64 - 1
    assert s.active_prefill_tokens_threshold_frac == 2.5
    assert s.router_track_output_blocks is True
    assert s.router_queue_threshold == 1.5
    assert s.worker_allow == ["10.0.0.0/8", "127.0.0.1:8000", "::1/128"]
    assert s.event_bind == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
    assert load_settings([], {"DYN_ROUTER_TRACK_OUTPUT_BLOCKS": "true"}).router_track_output_blocks


@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        (["--active-decode-blocks-threshold", "1.5"], {}, "--active-decode-blocks-threshold"),
        (["--active-decode-blocks-threshold", "-0.1"], {}, "'-0.1'"),
        (["--active-decode-blocks-threshold", "nan"], {}, "'nan'"),
        ([], {"DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD": "inf"}, "DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD"),
        ([], {"DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD": "half"}, "'half'"),
        (["--active-prefill-tokens-threshold", "-1"], {}, "--active-prefill-tokens-threshold"),
        (["--active-prefill-tokens-threshold", "1.5"], {}, "'1.5'"),
        (["--active-prefill-tokens-threshold", str(2**64)], {}, str(2**64)),
        (["--active-prefill-tokens-threshold-frac", "-2"], {}, "-frac"),
        (["--active-prefill-tokens-threshold-frac", "Infinity"], {}, "Infinity"),
        (["--router-mode", "least"], {}, "--router-mode"),
        ([], {"DYN_ROUTER_MODE": "kv2"}, "DYN_ROUTER_MODE"),
        (["--admission-control", "always"], {}, "--admission-control"),
        ([], {"DYN_ADMISSION_CONTROL": "bogus"}, "DYN_ADMISSION_CONTROL"),
        (["--router-queue-threshold", "-1"], {}, "--router-queue-threshold"),
        (["--worker-ttl", "0"], {}, "--worker-ttl"),
        (["--startup-grace", "-1"], {}, "--startup-grace"),
        ([], {"EXTPROC_STARTUP_GRACE": "61"}, "EXTPROC_STARTUP_GRACE"),
        (["--startup-grace", "soon"], {}, "'soon'"),
        (["--grpc-port", "70000"], {}, "--grpc-port"),
        (["--grpc-server", "h2o"], {}, "--grpc-server"),
        ([], {"EXTPROC_GRPC_SERVER": "nghttp2"}, "'nghttp2'"),
        (["--protocol", "gie"], {}, "--protocol"),
        ([], {"EXTPROC_PROTOCOL": "xds"}, "EXTPROC_PROTOCOL"),
        (["--epp-fallbacks", "-1"], {}, "--epp-fallbacks"),
        ([], {"EXTPROC_EPP_FALLBACKS": "two"}, "'two'"),
        (["--epp-fallbacks", "17"], {}, "--epp-fallbacks"),
        (["--worker-allow", "not-a-cidr"], {}, "not-a-cidr"),
        (["--event-bind", "127.0.0.1:5557"], {}, "--event-bind"),
        ([], {"DYN_ROUTER_TRACK_OUTPUT_BLOCKS": "maybe"}, "DYN_ROUTER_TRACK_OUTPUT_BLOCKS"),
    ],
)
def test_invalid_values_are_errors_naming_flag_and_value(
    argv: list[str], env: dict[str, str], names: str
) -> None:
    with pytest.raises(SettingsError) as exc:
        load_settings(argv, env)
    assert names in str(exc.value)


def test_protocol_and_epp_fallbacks() -> None:
    default = load_settings([], {})
    assert (default.protocol, default.epp_fallbacks) == ("envoy", 0)
    assert load_settings([], {"EXTPROC_PROTOCOL": " EPP "}).protocol == "epp"
    both = load_settings(
        ["--protocol", "envoy", "--epp-fallbacks", "2"], {"EXTPROC_PROTOCOL": "epp"}
    )
    assert (both.protocol, both.epp_fallbacks) == ("envoy", 2)


def test_an_unknown_protocol_exits_2_naming_flag_value_and_choices() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "extproc", "--protocol", "gie"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "--protocol" in proc.stderr and "'gie'" in proc.stderr
    assert "envoy, epp" in proc.stderr


def test_invalid_value_exits_2_with_message() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "extproc", "--active-decode-blocks-threshold", "2"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "--active-decode-blocks-threshold" in proc.stderr and "'2'" in proc.stderr
    assert "[0, 1]" in proc.stderr


def test_help_lists_every_setting_grouped_with_units() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "extproc", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    for flag, env in SETTING_NAMES.values():
        assert flag in out and env in out
    assert "DYN_HTTP_OVERLOAD_STATUS_CODE" in out
    for group in ("busy thresholds", "router", "listeners", "worker load events"):
        assert group in out
    assert "seconds" in out and "tokens" in out


def test_deprecation_and_mode_warnings_logged_once_at_startup(tmp_path: object) -> None:
    from pathlib import Path

    ext = Extproc(
        Path(str(tmp_path)),
        [
            "--admission-control",
            "token-capacity",
            "--active-decode-blocks-threshold",
            "0.5",
            "--router-mode",
            "round-robin",
        ],
        {"DYN_HTTP_OVERLOAD_STATUS_CODE": "12"},
    )
    try:
        log = wait_until(lambda: ext.proc.log() if "serving ext_proc" in ext.proc.log() else "", 10)
        warnings = [ln for ln in log.splitlines() if " WARNING " in ln]
        assert len(warnings) == 3, warnings
        assert (
            sum(
                "--active-prefill-tokens-threshold" in w and "DYN_ADMISSION_CONTROL" in w
                for w in warnings
            )
            == 1
        )
        assert sum("router-mode kv" in w for w in warnings) == 1
        assert sum("DYN_HTTP_OVERLOAD_STATUS_CODE" in w for w in warnings) == 1
        diag = ext.workers()  # the service runs normally
        assert diag == {}
    finally:
        ext.stop()


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--ttft-source", "engine"], {}),
        (["--ttft-source", "gateway"], {}),
        ([], {"EXTPROC_TTFT_SOURCE": " engine "}),
    ],
)
def test_ttft_source_is_accepted_has_no_effect_and_warns_once_naming_its_replacement(
    argv: list[str], env: dict[str, str]
) -> None:
    s = load_settings(argv, env)
    warnings = all_startup_warnings(s)
    assert len(warnings) == 1, warnings
    assert "--ttft-source=" in warnings[0] and "EXTPROC_TTFT_SOURCE" in warnings[0]
    assert "deprecated and has no effect" in warnings[0]
    assert "deadline admission" in warnings[0] and "--ttft-p99-target-ms" in warnings[0]
    assert load_settings([], {}).ttft_source is None
    assert all_startup_warnings(load_settings([], {})) == []


def test_admission_control_env_any_valid_value_warns() -> None:
    s = load_settings([], {"DYN_ADMISSION_CONTROL": "none"})
    warnings = all_startup_warnings(s)
    assert len(warnings) == 1 and "DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD" in warnings[0]


def test_event_bind_failure_exits_nonzero_naming_endpoint(tmp_path: object) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "extproc",
                "--event-bind",
                f"tcp://127.0.0.1:{port}",
                "--grpc-port",
                "0",
                "--admin-port",
                "0",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert proc.returncode != 0
    assert f"tcp://127.0.0.1:{port}" in proc.stderr


def test_tokenizer_path_must_exist() -> None:
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(["--tokenizer", "/nonexistent/tokenizer.json"], {})


@pytest.mark.parametrize("host", ["127.0.0.2", "127.1.2.3", "[::1]", "::ffff:127.0.0.1"])
def test_loopback_admin_host_is_one_rule_for_warning_and_auth(host: str) -> None:
    from extproc.admin.auth import AdminAuth

    s = load_settings(["--admin-host", host], {})
    assert not AdminAuth.from_settings(s.admin_host, s.admin_token).required
    assert all_startup_warnings(s) == []


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.5", "admin.internal"])
def test_non_loopback_admin_host_without_token_warns_and_auth_refuses(host: str) -> None:
    from extproc.admin.auth import AdminAuth

    s = load_settings([], {"EXTPROC_ADMIN_HOST": host})
    assert AdminAuth.from_settings(s.admin_host, s.admin_token).required
    warnings = all_startup_warnings(s)
    assert len(warnings) == 1 and f"listens on {host}" in warnings[0]


def test_overload_status_is_a_field_of_the_immutable_settings() -> None:
    import pydantic

    s = load_settings([], {"DYN_HTTP_OVERLOAD_STATUS_CODE": " 503 "})
    assert s.overload_status == 503 and all_startup_warnings(s) == []
    bad = load_settings([], {"DYN_HTTP_OVERLOAD_STATUS_CODE": "abc"})
    assert bad.overload_status == 529
    assert all_startup_warnings(bad) == [
        "DYN_HTTP_OVERLOAD_STATUS_CODE='abc' is not an integer in 200-999; using 529"
    ]
    assert load_settings([], {"DYN_HTTP_OVERLOAD_STATUS_CODE": ""}).overload_status == 529
    with pytest.raises(pydantic.ValidationError):
        s.router_mode = "random"


def test_env_lists_are_comma_separated_not_json() -> None:
    s = load_settings(
        [],
        {
            "EXTPROC_EVENT_BIND": "tcp://127.0.0.1:1, tcp://127.0.0.1:2",
            "EXTPROC_EVENT_CONNECT": "ipc:///tmp/x",
            "EXTPROC_WORKER_ALLOW": "10.0.0.0/8,127.0.0.1:8000",
        },
    )
    assert s.event_bind == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
    assert s.event_connect == ["ipc:///tmp/x"]
    assert s.worker_allow == ["10.0.0.0/8", "127.0.0.1:8000"]
    with pytest.raises(SettingsError, match=r"EXTPROC_EVENT_CONNECT value '127\.0\.0\.1:1'"):
        load_settings([], {"EXTPROC_EVENT_CONNECT": "127.0.0.1:1"})


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--grpc-port", "1_000"], {}, "invalid --grpc-port value '1_000': expected a TCP port"),
        ([], {"EXTPROC_ADMIN_PORT": "80.0"}, "invalid EXTPROC_ADMIN_PORT value '80.0'"),
        (["--active-prefill-tokens-threshold", "1e3"], {}, "value '1e3': expected a whole"),
        ([], {"EXTPROC_LOG_LEVEL": "loud"}, "EXTPROC_LOG_LEVEL value 'loud': expected DEBUG"),
        (["--router-queue-timeout", "0"], {}, "--router-queue-timeout value '0': expected seconds"),
        ([], {"EXTPROC_WORKER_TTL": "nan"}, "EXTPROC_WORKER_TTL value 'nan'"),
    ],
)
def test_errors_name_source_value_and_expectation(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(SettingsError) as exc:
        load_settings(argv, env)
    assert message in str(exc.value)


def test_unrelated_and_lowercase_env_names_are_ignored() -> None:
    s = load_settings([], {"dyn_router_mode": "random", "EXTPROC_UNKNOWN": "1"})
    assert s.router_mode == "kv"
    # a setting's attribute name is not a variable either
    s = load_settings([], {"grpc_port": "x", "worker_ttl": "x", "router_mode": "random"})
    assert (s.grpc_port, s.worker_ttl, s.router_mode) == (9002, 10.0, "kv")


def test_every_setting_has_one_row_with_env_help_and_group() -> None:
    from extproc.settings import GROUPS, TABLE, Settings

    assert set(TABLE) == set(Settings.model_fields)
    for name, row in TABLE.items():
        assert row["env"].startswith(("DYN_", "EXTPROC_")), name
        assert row["help"] and row["expected"] and row["group"] in GROUPS, name
        if row["flag"]:
            assert SETTING_NAMES[name] == (row["flag"], row["env"])
    assert [n for n in TABLE if n not in SETTING_NAMES] == ["overload"]


def test_curve_replica_and_classes_settings(tmp_path: Path) -> None:
    from extproc.events.keys import main as keys_main

    assert keys_main([str(tmp_path / "k"), "extproc"]) == 0
    (tmp_path / "pubs").mkdir()
    (tmp_path / "pubs" / "w.key").write_bytes((tmp_path / "k" / "extproc.key").read_bytes())
    secret = str(tmp_path / "k" / "extproc.key_secret")
    s = load_settings(
        [
            "--event-curve-secret-key",
            secret,
            "--event-curve-publishers",
            str(tmp_path / "pubs"),
            "--event-bind",
            "tcp://0.0.0.0:5557",
            "--replica-publish",
            "tcp://fwd:5557",
        ],
        {"EXTPROC_REPLICA_TTL": "2.5"},
    )
    assert s.replica_publish == ["tcp://fwd:5557"] and s.replica_ttl == 2.5
    assert not any("without CURVE" in w for w in s.startup_warnings())
    plain = load_settings(["--event-bind", "tcp://0.0.0.0:5557"], {})
    assert any("beyond loopback" in w and "without CURVE" in w for w in plain.startup_warnings())
    assert not any("CURVE" in w for w in load_settings([], {}).startup_warnings())
    with pytest.raises(SettingsError, match="go together"):
        load_settings(["--event-curve-secret-key", secret], {})
    with pytest.raises(SettingsError, match=r"invalid --event-curve-secret-key value .*no secret"):
        load_settings(
            ["--event-curve-secret-key", str(tmp_path / "k" / "extproc.key")],
            {"EXTPROC_EVENT_CURVE_PUBLISHERS": str(tmp_path / "pubs")},
        )
    with pytest.raises(SettingsError, match="invalid EXTPROC_REPLICA_INTERVAL value '0'"):
        load_settings([], {"EXTPROC_REPLICA_INTERVAL": "0"})
    bad = tmp_path / "classes.yaml"
    bad.write_text("default: a\nclasses:\n  a: {share: 0}\n")
    with pytest.raises(SettingsError, match=r"classes\.a\.share: 0 is out of range"):
        load_settings(["--classes-file", str(bad)], {})
    bad.write_text("default: a\nclasses: [\n")
    with pytest.raises(SettingsError, match="not valid YAML at line 3"):
        load_settings([], {"EXTPROC_CLASSES_FILE": str(bad)})


def test_worker_busy_statuses_default_list_and_off() -> None:
    assert load_settings([], {}).worker_busy_statuses == (429, 503)
    env = {"EXTPROC_WORKER_BUSY_STATUSES": " 503, 429 ,503,408 "}
    assert load_settings([], env).worker_busy_statuses == (408, 429, 503)
    for off in ("", "  ", "none", "None"):
        s = load_settings([], {"EXTPROC_WORKER_BUSY_STATUSES": off})
        assert s.worker_busy_statuses == ()
    # The flag wins over the variable, an empty flag included.
    assert load_settings(["--worker-busy-statuses", "500"], env).worker_busy_statuses == (500,)
    assert load_settings(["--worker-busy-statuses", ""], env).worker_busy_statuses == ()


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--worker-busy-statuses", "503,abc"], {}, "--worker-busy-statuses value '503,abc'"),
        (["--worker-busy-statuses", "99"], {}, "'99' is not one"),
        (["--worker-busy-statuses", "1000"], {}, "'1000' is not one"),
        (["--worker-busy-statuses", "503.0"], {}, "'503.0' is not one"),
        (["--worker-busy-statuses", "-503"], {}, "'-503' is not one"),
        (["--worker-busy-statuses", "429,,503"], {}, "'' is not one"),
        ([], {"EXTPROC_WORKER_BUSY_STATUSES": "200"}, "EXTPROC_WORKER_BUSY_STATUSES value '200'"),
        ([], {"EXTPROC_WORKER_BUSY_STATUSES": "429;503"}, "'429;503' is not one"),
    ],
)
def test_bad_worker_busy_statuses_name_the_source_and_value(
    argv: list[str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(SettingsError) as exc:
        load_settings(argv, env)
    assert message in str(exc.value)
    assert "expected" in str(exc.value)


def test_bad_worker_busy_statuses_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "extproc", "--worker-busy-statuses", "503,5xx"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "--worker-busy-statuses value '503,5xx'" in proc.stderr
    assert "'5xx' is not one" in proc.stderr


def test_latency_targets_by_flag_and_env_with_clear_errors() -> None:
    s = load_settings(
        ["--ttft-p99-target-ms", "500", "--active-prefill-tokens-threshold", "8000"],
        {"EXTPROC_ITL_P99_TARGET_MS": "40"},
    )
    assert (s.ttft_p99_target_ms, s.itl_p99_target_ms) == (500.0, 40.0)
    assert all_startup_warnings(s) == []
    for bad in ("0", "-3", "600001", "fast", "nan"):
        with pytest.raises(SettingsError) as err:
            load_settings(["--ttft-p99-target-ms", bad], {})
        assert "--ttft-p99-target-ms" in str(err.value) and repr(bad) in str(err.value)
    with pytest.raises(SettingsError) as err:
        load_settings([], {"EXTPROC_TTFT_SOURCE": "client"})
    assert "EXTPROC_TTFT_SOURCE" in str(err.value) and "gateway or engine" in str(err.value)


def test_a_target_without_any_threshold_starts_without_a_warning() -> None:
    # A target alone scales a full worker (tests/core/test_busy.py), nothing to warn about.
    assert all_startup_warnings(load_settings(["--ttft-p99-target-ms", "500"], {})) == []
