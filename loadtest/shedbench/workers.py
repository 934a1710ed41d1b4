"""The LLM workers behind Envoy: started beside the extproc, scraped for their load, stopped.

A benchmark talks to its workers only through :class:`Workers`: their HTTP ports (for
Envoy's cluster), :meth:`Workers.load`, the engines' queue and cache read from their
Prometheus metrics, :meth:`Workers.ttft_buckets`, the TTFT the engines report, and
:meth:`Workers.slowdown`, one worker made slower for a while. :class:`SimWorkers`, two
simulated vLLM-like engines that publish their load to the extproc, is the one
implementation; another engine (llama.cpp's ``llama-server`` behind the sidecar agent, say)
is another class with the same members. Its slowdown is the one member that needs a choice
of its own: a real engine has no knob for its speed, so it would restrict the server's
threads, or pause and resume the process (SIGSTOP/SIGCONT) on a duty cycle that makes it
``factor`` times slower; until then it may raise NotImplementedError.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol

import aiohttp

from extproc.devstack import (
    Extproc,
    SimProcess,
    cli_flags,
    free_port,
    metric_samples,
    metric_sums,
    wait_until,
)
from loadtest.shedbench.config import MODEL, Config


@dataclass(frozen=True)
class EngineLoad:
    """The engines' own view, summed over the workers (``kv_usage``: their mean, 0-1)."""

    running: float
    waiting: float
    kv_usage: float
    preemptions: float


class Workers(Protocol):
    """LLM workers serving :data:`MODEL`, announced to the extproc, stopped by :meth:`stop`."""

    @property
    def ports(self) -> list[int]:
        """Their HTTP ports on 127.0.0.1."""
        ...

    async def load(self, session: aiohttp.ClientSession) -> EngineLoad:
        """Scrape every worker once."""
        ...

    @property
    def ids(self) -> list[str]:
        """Their worker ids, in the order of :attr:`ports`."""
        ...

    async def ttft_buckets(self, session: aiohttp.ClientSession) -> dict[str, Buckets]:
        """Per worker id: the engine's own TTFT histogram, cumulative counts by upper bound
        in seconds (``inf`` last), summed over its ranks."""
        ...

    async def slowdown(self, session: aiohttp.ClientSession, index: int, factor: float) -> None:
        """Make worker ``index`` (in the order of :attr:`ports`) ``factor`` times slower
        (1: its normal pace)."""
        ...

    def stop(self) -> None: ...


Buckets = list[tuple[float, float]]
TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds"


class SimWorkers:
    """Two simulated engines (``python -m llmworker.sim``) that publish load to the extproc."""

    count = 2

    def __init__(self, cfg: Config, ext: Extproc, log_dir: Path) -> None:
        self.cfg = cfg
        self.procs: list[SimProcess] = []
        self._ports: list[int] = []
        try:
            for i in range(1, self.count + 1):
                port = free_port()
                args = self.args(i, port, ext.event_endpoint)
                self.procs.append(SimProcess(args, log_dir=log_dir, name=f"sim-{i}"))
                self._ports.append(port)
            for sim, port in zip(self.procs, self._ports, strict=True):
                wait_until(partial(sim.healthy, port), 20, f"simulated worker on :{port}")
            wait_until(lambda: len(ext.workers()) == self.count, 15, "both workers announced")
        except BaseException:
            self.stop()
            raise

    def args(self, i: int, port: int, publish: str) -> list[str]:
        c = self.cfg
        return cli_flags(
            host="127.0.0.1",
            port=port,
            model=MODEL,
            worker_id=f"sim-{i}",
            publish=publish,
            kv_total_blocks=c.kv_total_blocks,
            block_size=c.block_size,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            dp_size=1,
            speedup=c.speedup,
            log_level="WARNING",
        )

    @property
    def ports(self) -> list[int]:
        return self._ports

    @property
    def ids(self) -> list[str]:
        return [f"sim-{i}" for i in range(1, len(self._ports) + 1)]

    async def ttft_buckets(self, session: aiohttp.ClientSession) -> dict[str, Buckets]:
        out: dict[str, Buckets] = {}
        for wid, port in zip(self.ids, self._ports, strict=True):
            async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                text = await resp.text()
            counts: dict[float, float] = {}
            for s in metric_samples(text):
                if s.name == TTFT_HISTOGRAM + "_bucket":
                    le = float(s.labels["le"])
                    counts[le] = counts.get(le, 0.0) + float(s.value)
            out[wid] = sorted(counts.items())
        return out

    async def slowdown(self, session: aiohttp.ClientSession, index: int, factor: float) -> None:
        url = f"http://127.0.0.1:{self._ports[index]}/sim/slowdown"
        async with session.post(url, json={"factor": factor}) as resp:
            if resp.status != 200:
                raise RuntimeError(f"POST {url} -> {resp.status}: {await resp.text()}")

    async def load(self, session: aiohttp.ClientSession) -> EngineLoad:
        total: dict[str, float] = {}
        for port in self._ports:
            async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                for name, value in metric_sums(await resp.text()).items():
                    total[name] = total.get(name, 0.0) + value
        return EngineLoad(
            running=total.get("vllm:num_requests_running", 0.0),
            waiting=total.get("vllm:num_requests_waiting", 0.0),
            kv_usage=total.get("vllm:kv_cache_usage_perc", 0.0) / len(self._ports),
            preemptions=total.get("vllm:num_preemptions_total", 0.0),
        )

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


@dataclass
class EngineSamples:
    """Queue samples taken while a cell runs, and the preemption counter around it."""

    waiting: list[float] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    preemptions: float = 0.0


async def sample(
    session: aiohttp.ClientSession, workers: Workers, seconds: float, samples: EngineSamples
) -> None:
    """Every 0.25 s for ``seconds``: the engines' waiting and running requests and KV use."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        m = await workers.load(session)
        samples.waiting.append(m.waiting)
        samples.running.append(m.running)
        samples.kv_usage.append(m.kv_usage)
        await asyncio.sleep(0.25)


async def wait_idle(session: aiohttp.ClientSession, workers: Workers, timeout: float) -> None:
    """Until every engine has nothing running or waiting (cancelled streams abort)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = await workers.load(session)
        if m.running + m.waiting == 0:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the workers did not drain within {timeout:.0f} s")
