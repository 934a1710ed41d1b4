"""The real llama.cpp engine for the tests that run it: present, or a failure under CI and a
skip with the reason elsewhere."""

from __future__ import annotations

import os

import pytest

from extproc.devstack.llamacpp import EngineMissing, engine_command, smollm2_model


def require_engine(also_missing: str | None = None) -> None:
    """Call at module level: fail under CI (``CI`` set) when the engine (xllamacpp, or the
    binary ``LLAMA_SERVER`` names) or the SmolLM2 model is not installed (or
    ``also_missing`` names something else that is not), skip the module with the reason
    otherwise."""
    try:
        engine_command()
        smollm2_model()
        missing = also_missing
    except EngineMissing as exc:
        missing = str(exc)
    if missing is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"the real engine is required under CI: {missing}", pytrace=False)
    pytest.skip(f"the real engine is not installed: {missing}", allow_module_level=True)
