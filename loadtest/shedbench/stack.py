"""Envoy -> extproc -> workers on free 127.0.0.1 ports, all children of this process."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from extproc.devstack import Envoy, Extproc, checkout_file, http
from loadtest.shedbench.config import MODEL, Config
from loadtest.shedbench.workers import Workers, workers_for

THRESHOLDS = (
    "active_decode_blocks_threshold",
    "active_prefill_tokens_threshold",
    "active_prefill_tokens_threshold_frac",
)

WorkersFactory = Callable[[Config, Extproc, Path], Workers]


class Stack:
    """The extproc, the workers (announced to it) and Envoy in front of them."""

    def __init__(
        self,
        cfg: Config,
        log_dir: Path,
        extproc_args: Sequence[str] = (),
        workers: WorkersFactory = workers_for,
        envoy_tweak: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        args = ["--log-level", "WARNING", *extproc_args]
        if cfg.track_output_blocks:
            args.append("--router-track-output-blocks")
        self.ext = Extproc(log_dir, args)
        self.envoy: Envoy | None = None
        self.workers: Workers | None = None
        try:
            self.workers = workers(cfg, self.ext, log_dir)
            self.envoy = Envoy(
                log_dir, self.ext, self.workers.ports, envoy_tweak, source=self.envoy_config
            )
        except BaseException:
            self.close()
            raise

    @property
    def envoy_config(self) -> Path:
        """Output tokens are observed only with the observer config (docs/envoy.md)."""
        name = "envoy-track-output.yaml" if self.cfg.track_output_blocks else "envoy.yaml"
        return checkout_file(f"envoy/{name}")

    @property
    def url(self) -> str:
        assert self.envoy is not None
        return self.envoy.url + "/v1/chat/completions"

    @property
    def engines(self) -> Workers:
        assert self.workers is not None
        return self.workers

    def thresholds(self, on: bool) -> None:
        """The configured busy thresholds (``on``), or none, set with ``POST /busy_threshold``."""
        body: dict[str, Any] = {"model": MODEL}
        c = self.cfg
        values = (c.decode_threshold, c.prefill_threshold, c.prefill_frac_threshold)
        body["disable"] = [
            n for n, v in zip(THRESHOLDS, values, strict=True) if not on or v is None
        ]
        if on:
            body.update({n: v for n, v in zip(THRESHOLDS, values, strict=True) if v is not None})
        status, _, reply = http("POST", self.ext.admin + "/busy_threshold", body)
        if status != 200:
            raise RuntimeError(f"POST /busy_threshold -> {status}: {reply!r}")

    def processes(self) -> dict[str, list[int]]:
        """The stack's PIDs by part: the workers', ``extproc`` and ``envoy``."""
        parts = dict(self.engines.processes())
        parts["extproc"] = [self.ext.proc.pid]
        if self.envoy is not None:
            parts["envoy"] = [self.envoy.proc.pid]
        return parts

    def describe(self) -> str:
        envoy = self.envoy.url if self.envoy is not None else "-"
        return f"envoy {envoy}, workers {self.engines.ports}"

    def close(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        if self.workers is not None:
            self.workers.stop()
        self.ext.stop()


@contextlib.contextmanager
def started_stack(
    cfg: Config, extproc_args: Sequence[str] = (), prefix: str = "overload-"
) -> Iterator[Stack]:
    """A :class:`Stack` with its logs in a temporary folder, closed on the way out."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        stack = Stack(cfg, Path(tmp), extproc_args)
        try:
            yield stack
        finally:
            stack.close()
