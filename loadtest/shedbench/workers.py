"""The LLM workers behind Envoy: started beside the extproc, scraped for their load, stopped.

A benchmark talks to its workers only through :class:`Workers`: their HTTP ports (for
Envoy's cluster), :meth:`Workers.load`, the engines' queue and cache read from their
own pages, :meth:`Workers.ttft_buckets`, the TTFT the engines report, and
:meth:`Workers.slowdown`, one worker made slower for a while. :class:`SimWorkers`: two
simulated vLLM-like engines that publish their load to the extproc. :class:`LlamaWorkers`: two
llama.cpp ``llama-server`` processes serving SmolLM2-135M on this CPU, each with the sidecar
agent (``--engine llamacpp``) publishing its load; a real engine has no knob for its speed, so
its slowdown pauses and resumes the server process (SIGSTOP/SIGCONT) on a duty cycle
(:class:`DutyCycle`). :func:`workers_for` picks the class a :class:`Config` names.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol

import aiohttp

from extproc.devstack import (
    AgentProcess,
    Extproc,
    SimProcess,
    cli_flags,
    free_port,
    metric_samples,
    metric_sums,
    wait_until,
)
from extproc.devstack.llamacpp import LlamaServer
from llmworker.llamacpp import SLOTS_PATH, parse_llamacpp
from loadtest.shedbench.config import LLAMACPP, MODEL, Config


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

    @property
    def drain_timeout(self) -> float:
        """Seconds the workers may take to be empty after their clients went away."""
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

    async def preempted(self, session: aiohttp.ClientSession) -> dict[str, float]:
        """Per worker id: the requests its engine has preempted so far (a counter), for
        the engines that count them (an engine that never preempts is left out)."""
        ...

    async def slowdown(self, session: aiohttp.ClientSession, index: int, factor: float) -> None:
        """Make worker ``index`` (in the order of :attr:`ports`) ``factor`` times slower
        (1: its normal pace)."""
        ...

    def processes(self) -> dict[str, list[int]]:
        """Their PIDs by part (``engines``, ``agents``), for the CPU they use."""
        ...

    def stop(self) -> None: ...


Buckets = list[tuple[float, float]]
TTFT_HISTOGRAM = "vllm:time_to_first_token_seconds"


class SimWorkers:
    """Two simulated engines (``python -m llmworker.sim``) that publish load to the extproc."""

    count = 2
    drain_timeout = 30.0  # a cancelled stream aborts at once

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

    async def preempted(self, session: aiohttp.ClientSession) -> dict[str, float]:
        out: dict[str, float] = {}
        for wid, port in zip(self.ids, self._ports, strict=True):
            async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                out[wid] = metric_sums(await resp.text()).get("vllm:num_preemptions_total", 0.0)
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

    def processes(self) -> dict[str, list[int]]:
        return {"engines": [p.pid for p in self.procs]}

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


class LlamaWorkers:
    """Two ``llama-server`` (SmolLM2-135M, ``--parallel max_num_seqs``, a context of
    ``kv_total_blocks x block_size`` tokens, one CPU thread each), each with its agent.

    The agent scrapes ``/metrics`` and ``/slots`` every :attr:`SCRAPE` seconds and publishes
    the load to the extproc; Envoy sends requests to the engines' own ports.
    """

    count = 2
    # Requests whose clients left are dropped only as a slot takes them (measured through
    # Envoy: a backlog of 28 drained in 9 s), so a cell at 10x without thresholds leaves
    # minutes of them behind without this much time.
    drain_timeout = 180.0
    THREADS = 1  # one CPU thread per engine: two engines share this 2-core machine
    SCRAPE = 0.1  # the agents' --interval, seconds

    def __init__(self, cfg: Config, ext: Extproc, log_dir: Path) -> None:
        self.cfg = cfg
        self.servers: list[LlamaServer] = []
        self.agents: list[AgentProcess] = []
        self._duty: dict[int, DutyCycle] = {}
        try:
            for i in range(1, self.count + 1):
                server = LlamaServer(
                    log_dir,
                    name=f"llama-{i}",
                    ctx=cfg.kv_total_blocks * cfg.block_size,
                    parallel=cfg.max_num_seqs,
                    threads=self.THREADS,
                    alias=MODEL,
                    extra=["--batch-size", str(cfg.max_num_batched_tokens),
                           "--ubatch-size", str(cfg.max_num_batched_tokens),
                           # No prompt cache in RAM: the thresholds-on cell sends the same
                           # bodies as the thresholds-off one and must pay for its prompts.
                           "--cache-ram", "0"],
                )  # fmt: skip
                self.servers.append(server)
                self.agents.append(
                    AgentProcess(
                        [
                            "--engine", LLAMACPP, "--engine-url", server.url, "--model", MODEL,
                            "--endpoint", server.endpoint, "--worker-id", f"llama-{i}",
                            "--block-size", str(cfg.block_size),
                            "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
                            "--interval", str(self.SCRAPE), "--publish", ext.event_endpoint,
                            "--log-level", "WARNING",
                        ],
                        log_dir=log_dir,
                        name=f"agent-llama-{i}",
                    )
                )  # fmt: skip
            wait_until(lambda: len(ext.workers()) == self.count, 60, "both agents announced")
        except BaseException:
            self.stop()
            raise

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    @property
    def ids(self) -> list[str]:
        return [f"llama-{i}" for i in range(1, len(self.servers) + 1)]

    async def ttft_buckets(self, session: aiohttp.ClientSession) -> dict[str, Buckets]:
        """llama-server prints no TTFT histogram: no engine-reported source."""
        return {}

    async def preempted(self, session: aiohttp.ClientSession) -> dict[str, float]:
        """llama-server gives each request a slot of its own context: it never preempts."""
        return {}

    async def slowdown(self, session: aiohttp.ClientSession, index: int, factor: float) -> None:
        """Pause and resume the server on a :class:`DutyCycle`: it runs 1/``factor`` of
        the time, so everything it does takes ``factor`` times as long."""
        if not 1.0 <= factor <= 100.0:
            raise ValueError(f"slowdown factor: {factor!r} is not a factor from 1 to 100")
        old = self._duty.pop(index, None)
        if old is not None:
            await old.stop()
        if factor > 1.0:
            self._duty[index] = DutyCycle(self.servers[index].pid, factor)

    async def load(self, session: aiohttp.ClientSession) -> EngineLoad:
        running = waiting = 0.0
        usage: list[float] = []
        for server in self.servers:
            async with session.get(server.url + "/metrics") as resp:
                snap = parse_llamacpp(await resp.text(), await _slots_text(session, server))
            rank = snap.ranks[0]
            running += rank.num_running or 0
            waiting += rank.num_waiting or 0  # deferred, and in a slot before the first token
            usage.append((rank.kv_used_tokens or 0) / (rank.kv_total_tokens or 1))
        return EngineLoad(
            running=running,
            waiting=waiting,
            kv_usage=sum(usage) / len(usage),
            preemptions=0.0,  # llama.cpp does not preempt: a request keeps its slot
        )

    def processes(self) -> dict[str, list[int]]:
        return {"engines": [s.pid for s in self.servers], "agents": [a.pid for a in self.agents]}

    def stop(self) -> None:
        for duty in self._duty.values():
            duty.resume()  # a stopped process would not see the SIGTERM until resumed
        for agent in self.agents:
            agent.stop()
        for server in self.servers:
            server.stop()


class DutyCycle:
    """A process paused (SIGSTOP) and resumed (SIGCONT) every :attr:`PERIOD` seconds,
    running 1/``factor`` of each period, until :meth:`stop`; it is left running.

    The period is short against a request (llama-server takes about 30 ms per token and
    hundreds for a prompt on this CPU), so each request is slowed evenly rather than some
    stalled whole; the engine sees nothing but a slower CPU, and its own clock, its
    ``/metrics`` and ``/slots`` answers, keep running (answered when it runs again).
    """

    PERIOD = 0.1

    def __init__(self, pid: int, factor: float) -> None:
        self.pid = pid
        self.run_for = self.PERIOD / factor
        self.task = asyncio.create_task(self._cycle())

    async def _cycle(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.run_for)
                os.kill(self.pid, signal.SIGSTOP)
                await asyncio.sleep(self.PERIOD - self.run_for)
                os.kill(self.pid, signal.SIGCONT)
        finally:
            self.resume()

    def resume(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def _slots_text(session: aiohttp.ClientSession, server: LlamaServer) -> str:
    async with session.get(server.url + SLOTS_PATH) as resp:
        return await resp.text()


def workers_for(cfg: Config, ext: Extproc, log_dir: Path) -> Workers:
    """The workers ``cfg.engine`` names."""
    if cfg.engine == LLAMACPP:
        return LlamaWorkers(cfg, ext, log_dir)
    return SimWorkers(cfg, ext, log_dir)


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


async def wait_idle(
    session: aiohttp.ClientSession, workers: Workers, timeout: float | None = None
) -> None:
    """Until every engine has nothing running or waiting (cancelled streams abort); at most
    ``timeout`` seconds (default: the workers' ``drain_timeout``)."""
    timeout = workers.drain_timeout if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = await workers.load(session)
        if m.running + m.waiting == 0:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the workers did not drain within {timeout:.0f} s")
