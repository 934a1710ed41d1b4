"""vLLM for the tests that run it: present, or a failure under CI and a skip with the reason
elsewhere."""

from __future__ import annotations

import os

import pytest

from extproc.devstack.vllm import VllmMissing, vllm_model, vllm_python


def require_vllm() -> None:
    """Call at module level: fail under CI (``CI`` set) when vLLM's virtualenv or the
    converted SmolLM2 is missing (``make vllm`` installs both), skip the module with the
    reason otherwise."""
    try:
        vllm_python()
        vllm_model()
        return
    except VllmMissing as exc:
        missing = str(exc)
    if os.environ.get("CI"):
        pytest.fail(f"vLLM is required under CI: {missing}", pytrace=False)
    pytest.skip(f"vLLM is not installed: {missing}", allow_module_level=True)
