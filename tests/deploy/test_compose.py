"""``docker-compose.yml``: valid, and everything it runs exists and accepts its flags.

No container runs here. The compose file is checked by ``docker-compose config -q``; each
command of the project's image is taken apart and its module's ``--help`` must list every
flag, and the values must pass the module's own parsing; the Envoy config it mounts must
match ``envoy/envoy.yaml`` apart from addresses, and point at the compose services on the
ports their commands use.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.devstack import ROOT, envoy_binary

COMPOSE = ROOT / "docker-compose.yml"
ENVOY_LOCAL = ROOT / "envoy" / "envoy.yaml"
OUR_IMAGE = "envoy-llm-shedder:local"
# What the shell in the worker's command computes at start, for these checks.
SHELL_VALUES = {
    "\"$(hostname -i | cut -d ' ' -f 1):8000\"": "172.18.0.5:8000",
    '"worker-$(hostname)"': "worker-0123456789ab",
}


def _interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """Compose's ``${VAR:-default}`` with the given variables, and ``$$`` -> ``$``."""
    env = env or {}

    def value(m: re.Match[str]) -> str:
        return env.get(m.group(1)) or (m.group(2) or "")

    text = re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", value, text)
    return text.replace("$$", "$")


def _compose() -> dict[str, Any]:
    return yaml.safe_load(_interpolate(COMPOSE.read_text()))


def _services() -> dict[str, dict[str, Any]]:
    return _compose()["services"]


def _argv(service: dict[str, Any]) -> list[str]:
    """The command as argv, with ``sh -c '...'`` taken apart (the shell's values filled in)."""
    cmd = service["command"]
    argv = shlex.split(cmd) if isinstance(cmd, str) else [str(a) for a in cmd]
    if argv[:2] == ["sh", "-c"]:
        script = argv[2]
        for shell, sample in SHELL_VALUES.items():
            script = script.replace(shell, sample)
        assert "$" not in script, f"unexpected shell expansion left in {script!r}"
        argv = shlex.split(script)
        if argv[0] == "exec":
            argv = argv[1:]
    return argv


def _flags(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def _help_lists(help_text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


def _docker_compose(*args: str) -> str:
    """``docker-compose <args>`` from the repo (skips without it); its stdout."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose not installed (Debian: apt-get install -y docker-compose)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    proc = subprocess.run(
        [binary, *args], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_compose_config_is_valid() -> None:
    _docker_compose("-f", str(COMPOSE), "config", "-q")
    # The profiles are valid too.
    for profile in ("loadtest", "llamacpp", "vllm"):
        _docker_compose("-f", str(COMPOSE), "--profile", profile, "config", "-q")
    services = _docker_compose("-f", str(COMPOSE), "--profile", "loadtest", "config", "--services")
    # docker-compose 1.29 lists every service here, whatever the profile.
    assert set(services.split()) == {
        "extproc",
        "worker",
        "llamacpp",
        "vllm",
        "envoy",
        "locust",
        "prometheus",
        "grafana",
    }


def _classes_override() -> str:
    """The docker-compose.override.yml of docs/COMPOSE.md, "Request classes"."""
    text = (ROOT / "docs" / "COMPOSE.md").read_text()
    section = text.split("## Request classes", 1)[1]
    return section.split("```yaml\n", 1)[1].split("```", 1)[0]


def test_classes_override_in_the_docs_is_valid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from extproc.settings import load_settings

    extproc = yaml.safe_load(_classes_override())["services"]["extproc"]
    source, target, mode = extproc["volumes"][0].split(":")
    assert (ROOT / source).is_file() and mode == "ro"
    assert extproc["environment"] == {"EXTPROC_CLASSES_FILE": target}
    # The extproc loads the mounted file (here from where the mount takes it).
    for key in list(os.environ):
        if key.startswith(("DYN_", "EXTPROC_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("EXTPROC_CLASSES_FILE", str(ROOT / source))
    assert load_settings([]).classes_file == str(ROOT / source)
    override = tmp_path / "docker-compose.override.yml"
    override.write_text(_classes_override())
    config = _docker_compose("-f", str(COMPOSE), "-f", str(override), "config")
    merged = yaml.safe_load(config)["services"]["extproc"]
    assert merged["environment"]["EXTPROC_CLASSES_FILE"] == target
    assert merged["environment"]["DYN_ROUTER_MODE"] == "kv"  # the base file's, kept


def test_services_are_healthchecked_restarted_and_workers_scale() -> None:
    services = _services()
    assert {"extproc", "worker", "envoy", "locust"} <= set(services)
    for name in ("extproc", "worker", "envoy"):
        assert services[name].get("healthcheck", {}).get("test"), f"{name}: no health check"
        assert services[name].get("restart") in ("unless-stopped", "always", "on-failure")
    assert services["locust"].get("profiles") == ["loadtest"]
    worker = services["worker"]
    # --scale worker=N: no fixed host port, no fixed container name.
    assert "ports" not in worker and "container_name" not in worker
    assert services["extproc"]["image"] == worker["image"] == OUR_IMAGE
    assert services["extproc"]["build"] == worker["build"] == "."


@pytest.mark.parametrize(
    ("service", "module"),
    [("extproc", "extproc"), ("worker", "llmworker.sim")],
)
def test_python_command_exists_and_accepts_its_flags(service: str, module: str) -> None:
    argv = _argv(_services()[service])
    assert argv[:3] == ["python", "-m", module], argv
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    flags = _flags(argv[3:])
    assert flags, argv
    for flag in flags:
        assert _help_lists(proc.stdout, flag), f"`python -m {module} --help` has no {flag}"


def test_worker_command_parses() -> None:
    from llmworker.sim import parse_args

    settings, _ = parse_args(_argv(_services()["worker"])[3:])
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)
    assert settings.advertise == "172.18.0.5:8000"
    assert settings.publish == ("tcp://extproc:5557",)


def test_extproc_command_and_environment_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    from extproc.settings import load_settings

    service = _services()["extproc"]
    for key in list(os.environ):
        if key.startswith(("DYN_", "EXTPROC_")):
            monkeypatch.delenv(key)
    for key, value in service["environment"].items():
        monkeypatch.setenv(key, str(value))
    settings = load_settings(_argv(service)[3:])
    assert settings.grpc_host == settings.admin_host == "0.0.0.0"
    assert settings.event_bind == ["tcp://0.0.0.0:5557"]
    # Every threshold is off unless the environment sets it.
    assert settings.active_decode_blocks_threshold is None
    assert settings.active_prefill_tokens_threshold_frac is None


def test_envoy_image_is_the_release_the_tests_use() -> None:
    out = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True, timeout=30)
    version = re.search(r"/(\d+\.\d+\.\d+)/", out.stdout)
    assert version, out.stdout
    assert _services()["envoy"]["image"] == f"envoyproxy/envoy:v{version.group(1)}"


def test_envoy_command_and_mounted_config() -> None:
    envoy = _services()["envoy"]
    argv = _argv(envoy)
    assert argv[0] == "envoy"
    help_text = subprocess.run(
        [envoy_binary(), "--help"], capture_output=True, text=True, timeout=30
    ).stdout
    for flag in _flags(argv):
        assert _help_lists(help_text, flag), f"envoy --help has no {flag}"
    config_in_container = argv[argv.index("-c") + 1]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1)[::-1] for v in envoy["volumes"])
    source = ROOT / mounts[config_in_container]
    assert source == ROOT / "envoy" / "envoy-compose.yaml"
    assert source.is_file()


def _without_addresses(cfg: dict[str, Any]) -> dict[str, Any]:
    cfg = copy.deepcopy(cfg)
    for listener in cfg["static_resources"]["listeners"]:
        listener.pop("address")
    for cluster in cfg["static_resources"]["clusters"]:
        cluster.pop("type", None)
        cluster.pop("cluster_type", None)
        cluster.pop("load_assignment")
    return cfg


def _endpoints(cfg: dict[str, Any]) -> dict[str, tuple[str, list[tuple[str, int]]]]:
    out = {}
    for cluster in cfg["static_resources"]["clusters"]:
        eps = [
            ep["endpoint"]["address"]["socket_address"]
            for group in cluster["load_assignment"]["endpoints"]
            for ep in group["lb_endpoints"]
        ]
        kind = cluster.get("type") or cluster["cluster_type"]["name"]
        out[cluster["name"]] = (
            kind,
            [(a["address"], int(a["port_value"])) for a in eps],
        )
    return out


def test_compose_envoy_config_matches_the_local_one_but_for_addresses() -> None:
    services = _services()
    envoy_argv = _argv(services["envoy"])
    mounted = next(v.split(":")[0] for v in services["envoy"]["volumes"] if "envoy" in v)
    compose_cfg = yaml.safe_load((ROOT / mounted).read_text())
    local_cfg = yaml.safe_load(ENVOY_LOCAL.read_text())
    assert _without_addresses(compose_cfg) == _without_addresses(local_cfg), (
        "envoy/envoy-compose.yaml has drifted from envoy/envoy.yaml: apply the same change"
    )
    assert "-c" in envoy_argv

    # The clusters point at the compose services, on the ports their commands use.
    from extproc.settings import load_settings
    from llmworker.sim import parse_args

    ext = load_settings(_argv(services["extproc"])[3:])
    sim, _ = parse_args(_argv(services["worker"])[3:])
    eps = _endpoints(compose_cfg)
    dns = "envoy.clusters.dns"
    assert eps["extproc"] == (dns, [("extproc", ext.grpc_port)])
    assert eps["extproc_admin"] == (dns, [("extproc", ext.admin_port)])
    assert eps["workers"] == (dns, [("worker", sim.port)])
    assert sim.advertise is not None and sim.advertise.endswith(f":{sim.port}")
    event_port = ext.event_bind[0].rsplit(":", 1)[1]
    assert sim.publish == (f"tcp://extproc:{event_port}",)
    # Envoy listens where compose publishes it.
    listener = compose_cfg["static_resources"]["listeners"][0]["address"]["socket_address"]
    published = [p.rsplit(":", 1)[1] for p in services["envoy"]["ports"]]
    assert (listener["address"], str(listener["port_value"])) == ("0.0.0.0", published[0])


def test_locust_service_runs_the_repo_locustfile() -> None:
    locust = _services()["locust"]
    argv = _argv(locust)
    target = argv[argv.index("-f") + 1]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in locust["volumes"]}
    mount_dir = next(m for m in mounts if target.startswith(m + "/"))
    source = ROOT / mounts[mount_dir] / target[len(mount_dir) + 1 :]
    assert source == ROOT / "loadtest" / "locustfile.py" and source.is_file()
    assert argv[argv.index("--host") + 1] == "http://envoy:8000"
    if shutil.which("locust", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("locust is not installed: pip install -e '.[loadtest]'")
    # locust's --help does not load the locustfile (no custom options listed): parse the
    # command with locust's own parser instead, the locustfile's options added, in a child
    # process (locust monkey-patches the standard library with gevent).
    code = """
import json, sys
from locust.argument_parser import get_parser
sys.path.insert(0, sys.argv[1])
import locustfile  # registers its command-line options
opts = get_parser().parse_args(json.loads(sys.argv[2]))
print(json.dumps({"locustfile": opts.locustfile, "host": opts.host, "model": opts.model}))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code, str(source.parent), json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert parsed["host"] == "http://envoy:8000"
    assert parsed["model"] == "sim-model"


def test_dockerfile_copies_what_exists() -> None:
    text = (ROOT / "Dockerfile").read_text()
    sources = [
        src
        for line in text.splitlines()
        if line.startswith("COPY ")
        for src in line.split()[1:-1]
        if not src.startswith("--")
    ]
    assert sources, "no COPY in the Dockerfile"
    for src in sources:
        assert (ROOT / src).exists(), f"Dockerfile copies {src}, which does not exist"
    kept = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
            if line.startswith("!")}  # fmt: skip
    for src in sources:
        assert src.rstrip("/") in kept, f".dockerignore excludes {src}, which the Dockerfile copies"


# --- the llama.cpp worker (profile llamacpp) ----------------------------------------------


def _llamacpp_commands() -> tuple[list[str], list[str]]:
    """The llama.cpp service's two commands as argv: the engine and the agent.

    Its ``bash -c`` script starts both in the background, stops the other when one exits and
    passes SIGTERM on; the commands are the two parts before ``&``."""
    service = _services()["llamacpp"]
    argv = [str(a) for a in service["command"]]
    assert argv[:2] == ["bash", "-c"], argv
    script = argv[2]
    for shell, sample in {
        "\"$(hostname -i | cut -d ' ' -f 1):8000\"": "172.18.0.7:8000",
        '"llamacpp-$(hostname)"': "llamacpp-0123456789ab",
    }.items():
        script = script.replace(shell, sample)
    engine, agent, supervision = script.split(" & ", 2)
    assert "wait -n" in supervision and "kill -TERM $(jobs -p)" in supervision, supervision
    assert supervision.startswith("trap ") and " TERM INT;" in supervision, supervision
    engine_argv, agent_argv = shlex.split(engine), shlex.split(agent)
    for part in (engine_argv, agent_argv):
        assert not any("$" in a for a in part), part
    return engine_argv, agent_argv


def test_llamacpp_service_is_a_profile_in_the_worker_pool() -> None:
    service = _services()["llamacpp"]
    assert service["profiles"] == ["llamacpp"]
    assert service["build"] == {"context": ".", "target": "llamacpp"}
    assert service["restart"] == "unless-stopped" and service["init"] is True
    assert service["healthcheck"]["test"]
    # Envoy's "workers" cluster is the DNS name "worker": the alias makes it a member.
    assert service["networks"]["default"]["aliases"] == ["worker"]
    assert "ports" not in service
    text = (ROOT / "Dockerfile").read_text()
    assert "FROM shedder AS llamacpp" in text
    assert text.rstrip().splitlines()[-1] == "FROM shedder"  # the default image stays lean


def test_llamacpp_service_commands_exist_and_accept_their_flags() -> None:
    engine, agent = _llamacpp_commands()
    assert engine[:3] == ["python", "-m", "extproc.devstack.llamacpp"], engine
    assert agent[:3] == ["python", "-m", "llmworker.agent"], agent
    from extproc.devstack.llamacpp import EngineMissing, engine_command

    try:
        command = engine_command()
    except EngineMissing as exc:
        if os.environ.get("CI"):
            pytest.fail(f"the real engine is required under CI: {exc}", pytrace=False)
        pytest.skip(f"the real engine is not installed: {exc}")
    engine_help = subprocess.run(
        [*command, "--help"], capture_output=True, text=True, timeout=30, cwd=ROOT
    ).stdout
    for flag in _flags(engine[3:]):
        assert _help_lists(engine_help, flag), f"the engine's --help has no {flag}"
    agent_help = subprocess.run(
        [sys.executable, "-m", "llmworker.agent", "--help"],
        capture_output=True, text=True, timeout=30, cwd=ROOT,
    ).stdout  # fmt: skip
    for flag in _flags(agent[3:]):
        assert _help_lists(agent_help, flag), f"`python -m llmworker.agent --help` has no {flag}"


def test_llamacpp_agent_watches_its_engine_and_announces_a_pool_member() -> None:
    from extproc.settings import load_settings
    from llmworker.agent import parse_args

    engine, agent = _llamacpp_commands()
    settings, _ = parse_args(agent[3:], environ={})
    port = int(engine[engine.index("--port") + 1])
    assert settings.engine == "llamacpp"
    assert str(settings.engine_url) == f"http://127.0.0.1:{port}"
    assert settings.model == engine[engine.index("--alias") + 1] == "smollm2"
    assert "--metrics" in engine  # the agent stops at start without it
    # The address it announces is what Envoy resolves "worker" to, on the cluster's port.
    assert settings.endpoint == f"172.18.0.7:{port}"
    compose_cfg = yaml.safe_load((ROOT / "envoy" / "envoy-compose.yaml").read_text())
    assert _endpoints(compose_cfg)["workers"][1] == [("worker", port)]
    assert engine[engine.index("--host") + 1] == "0.0.0.0"
    ext = load_settings(_argv(_services()["extproc"])[3:])
    event_port = ext.event_bind[0].rsplit(":", 1)[1]
    assert settings.publish == (f"tcp://extproc:{event_port}",)
