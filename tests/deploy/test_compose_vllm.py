"""``docker-compose.yml``'s vLLM worker (profile ``vllm``): valid, a member of Envoy's worker
pool, its two commands exist and accept their flags, and its image copies what exists.

No container runs here (vLLM's image is about 4 GB); ``tests/integration/test_vllm.py`` runs
the same engine and agent as processes.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import PurePosixPath

import pytest
import yaml

from extproc.devstack import ROOT
from extproc.devstack.vllm import VllmMissing, vllm_python
from tests.deploy.test_compose import (
    COMPOSE,
    _argv,
    _docker_compose,
    _endpoints,
    _flags,
    _help_lists,
    _services,
)

DOCKERFILE = ROOT / "deploy" / "vllm" / "Dockerfile"
SAMPLES = {
    "\"$(hostname -i | cut -d ' ' -f 1):8000\"": "172.18.0.8:8000",
    '"vllm-$(hostname)"': "vllm-0123456789ab",
}


def _commands() -> tuple[list[str], list[str]]:
    """The service's two commands as argv: the engine and the agent (the parts of its
    ``bash -c`` script before ``&``; the rest supervises them)."""
    argv = [str(a) for a in _services()["vllm"]["command"]]
    assert argv[:2] == ["bash", "-c"], argv
    script = argv[2]
    for shell, sample in SAMPLES.items():
        script = script.replace(shell, sample)
    engine, agent, supervision = script.split(" & ", 2)
    assert "wait -n" in supervision and "kill -TERM $(jobs -p)" in supervision, supervision
    assert supervision.startswith("trap ") and " TERM INT;" in supervision, supervision
    engine_argv, agent_argv = shlex.split(engine), shlex.split(agent)
    for part in (engine_argv, agent_argv):
        assert not any("$" in a for a in part), part
    return engine_argv, agent_argv


def test_vllm_profile_is_valid() -> None:
    _docker_compose("-f", str(COMPOSE), "--profile", "vllm", "config", "-q")


def test_vllm_service_is_a_profile_in_the_worker_pool() -> None:
    service = _services()["vllm"]
    assert service["profiles"] == ["vllm"]
    assert service["build"] == {"context": ".", "dockerfile": "deploy/vllm/Dockerfile"}
    assert service["restart"] == "unless-stopped" and service["init"] is True
    assert service["healthcheck"]["test"]
    assert service["networks"]["default"]["aliases"] == ["worker"]
    assert "ports" not in service
    # Without a KV cache size vLLM on CPU takes most of the machine's memory.
    assert str(service["environment"]["VLLM_CPU_KVCACHE_SPACE"]) == "1"


def test_vllm_agent_watches_its_engine_and_announces_a_pool_member() -> None:
    from extproc.settings import load_settings
    from llmworker.agent import parse_args

    engine, agent = _commands()
    assert engine[:3] == ["python", "-m", "extproc.devstack.vllm"], engine
    assert agent[:3] == ["python", "-m", "llmworker.agent"], agent
    settings, _ = parse_args(agent[3:], environ={})
    port = int(engine[engine.index("--port") + 1])
    assert settings.engine == "vllm"
    assert str(settings.engine_url) == f"http://127.0.0.1:{port}"
    assert settings.model == engine[engine.index("--served-model-name") + 1] == "smollm2"
    assert settings.endpoint == f"172.18.0.8:{port}"
    compose_cfg = yaml.safe_load((ROOT / "envoy" / "envoy-compose.yaml").read_text())
    assert _endpoints(compose_cfg)["workers"][1] == [("worker", port)]
    assert engine[engine.index("--host") + 1] == "0.0.0.0"
    # vLLM does not print max_num_seqs: the agent is told the engine's.
    assert settings.max_num_seqs == int(engine[engine.index("--max-num-seqs") + 1])
    assert "--enforce-eager" in engine  # compiling the model would add 80-110 s to each start
    ext = load_settings(_argv(_services()["extproc"])[3:])
    event_port = ext.event_bind[0].rsplit(":", 1)[1]
    assert settings.publish == (f"tcp://extproc:{event_port}",)


def test_vllm_engine_command_accepts_its_flags() -> None:
    engine, _ = _commands()
    try:
        python = vllm_python()
    except VllmMissing as exc:
        if os.environ.get("CI"):
            pytest.fail(f"vLLM is required under CI: {exc}", pytrace=False)
        pytest.skip(f"vLLM is not installed: {exc}")
    assert python.is_file()
    # The command the container runs: it starts vLLM's server from its own virtualenv.
    help_text = subprocess.run(
        [sys.executable, "-m", "extproc.devstack.vllm", "--help=all"],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    ).stdout  # fmt: skip
    assert "--served-model-name" in help_text, help_text[-2000:]
    for flag in _flags(engine[3:]):
        assert _help_lists(help_text, flag), f"vLLM's api_server --help=all has no {flag}"


def test_vllm_dockerfile_copies_what_exists_and_installs_apart() -> None:
    text = DOCKERFILE.read_text()
    sources = [
        src
        for line in text.splitlines()
        if line.startswith("COPY ")
        for src in line.split()[1:-1]
        if not src.startswith("--")
    ]
    assert sources, "no COPY in deploy/vllm/Dockerfile"
    kept = [
        PurePosixPath(line[1:].rstrip("/"))
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    for src in sources:
        assert (ROOT / src).exists(), f"deploy/vllm/Dockerfile copies {src}, which does not exist"
        path = PurePosixPath(src.rstrip("/"))
        assert any(path == k or k in path.parents for k in kept), f".dockerignore excludes {src}"
    assert "VLLM_VENV=/opt/vllm" in text
    assert "-r deploy/vllm/requirements.txt" in text
    assert "pip uninstall -y torchvision torchaudio torchcodec" in text
    assert "/opt/vllm/models/smollm2-135m-instruct-bf16" in text
