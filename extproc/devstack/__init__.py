"""The local stack: one harness that starts the real parts as child processes.

``python -m extproc.devstack`` (``make demo``) runs Envoy, the extproc and two simulated
workers on localhost:8000 (:mod:`extproc.devstack.workers`: a worker kind and its slot,
restarted after it exits). The tests and the benchmarks under ``loadtest/`` start their
stacks with the same pieces:

- :mod:`extproc.devstack.procs`: :class:`Proc` (log file, stop by PID), :func:`free_port`,
  :func:`wait_until`, :func:`http`, :class:`Extproc`, :class:`Envoy` (a config rendered
  from ``envoy/``), :class:`SimProcess` / :class:`AgentProcess` (the worker side, as
  subprocesses), :func:`start_echo_worker`;
- :mod:`extproc.devstack.publisher`: a raw event :class:`Publisher`;
- :mod:`extproc.devstack.prom`: :func:`metric_value`, :func:`metric_samples`,
  :func:`metric_sums` (prometheus_client's text parser).

Configs under ``envoy/`` come from a checkout of the repository; without one,
:class:`CheckoutNeeded` says so.
"""

from extproc.devstack.procs import (
    PYTHON,
    ROOT,
    AgentProcess,
    CheckoutNeeded,
    Envoy,
    Extproc,
    Proc,
    ProcessExited,
    SimProcess,
    WaitTimeout,
    answers,
    async_wait_until,
    checkout_file,
    cli_flags,
    envoy_binary,
    free_port,
    get_json,
    http,
    python_module,
    render_envoy_config,
    run_sim,
    start_echo_worker,
    wait_until,
)
from extproc.devstack.prom import metric_samples, metric_sums, metric_value
from extproc.devstack.publisher import Publisher

__all__ = [
    "PYTHON",
    "ROOT",
    "AgentProcess",
    "CheckoutNeeded",
    "Envoy",
    "Extproc",
    "Proc",
    "ProcessExited",
    "Publisher",
    "SimProcess",
    "WaitTimeout",
    "answers",
    "async_wait_until",
    "checkout_file",
    "cli_flags",
    "envoy_binary",
    "free_port",
    "get_json",
    "http",
    "metric_samples",
    "metric_sums",
    "metric_value",
    "python_module",
    "render_envoy_config",
    "run_sim",
    "start_echo_worker",
    "wait_until",
]
