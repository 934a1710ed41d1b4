"""The real vLLM's dtype follows the CPU: bf16 where the CPU has AVX-512, float32 where not
(pure: the flags are plain text; ``tests/integration/test_vllm.py`` checks the engine's log)."""

from __future__ import annotations

import pytest

from extproc.devstack.vllm import compute_dtype, server_args, with_dtype

AVX2_ONLY = (
    "processor\t: 0\nmodel name\t: AMD EPYC\n"
    "flags\t\t: fpu sse2 avx f16c avx2 fma bmi2\n\n"
    "processor\t: 1\nflags\t\t: fpu sse2 avx f16c avx2 fma bmi2\n"
)


@pytest.mark.parametrize(
    ("cpuinfo", "dtype"),
    [
        (AVX2_ONLY, "float32"),
        (AVX2_ONLY.replace("avx2 fma", "avx2 avx512f avx512bw fma"), "bfloat16"),
        (AVX2_ONLY.replace("avx2 fma", "avx2 amx_bf16 fma"), "bfloat16"),
        ("", "float32"),  # unreadable: taken as a CPU without AVX-512
        ("flagsx: avx512f\nmodel name: avx512f\n", "float32"),  # only the flags line counts
    ],
)
def test_compute_dtype_follows_the_cpu_flags(cpuinfo: str, dtype: str) -> None:
    assert compute_dtype(cpuinfo) == dtype


def test_server_args_name_this_cpus_dtype_unless_given() -> None:
    args = server_args(host="127.0.0.1", port=8000)
    assert args[args.index("--dtype") + 1] == compute_dtype()
    given = server_args(host="127.0.0.1", port=8000, dtype="bfloat16")
    assert given[given.index("--dtype") + 1] == "bfloat16"
    assert given.count("--dtype") == 1


def test_the_compose_workers_flags_get_this_cpus_dtype_unless_they_name_one() -> None:
    assert with_dtype(["--port", "8000"]) == ["--dtype", compute_dtype(), "--port", "8000"]
    assert with_dtype(["--dtype", "half", "--port", "1"]) == ["--dtype", "half", "--port", "1"]
    assert with_dtype(["--dtype=half"]) == ["--dtype=half"]
