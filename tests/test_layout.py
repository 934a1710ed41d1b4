"""The package layout's import rules: data flows one way, and the router never imports the
worker side. Read from the source with ``ast``, so a lazy import inside a function or under
``TYPE_CHECKING`` counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Plane -> the planes it may import. Events in -> core -> handlers -> transport; admin and
# metrics read the core. The entry point, the wiring and the settings may import anything
# of the router; nothing of the router may import llmworker. The settings-table machinery
# (flags over environment variables) serves the router and llmworker alike, so it imports
# nothing of either. The background-task guard (count a failure, log the first, go on) serves
# every plane that runs a task, and imports nothing of the router.
ALLOWED: dict[str, set[str]] = {
    "extproc.core": {"extproc.core"},
    "extproc.openai": {"extproc.openai"},
    "extproc.events": {"extproc.events", "extproc.core", "extproc.metrics", "extproc.background"},
    "extproc.metrics": {"extproc.metrics", "extproc.core"},
    "extproc.handlers": {
        "extproc.handlers",
        "extproc.core",
        "extproc.openai",
        "extproc.metrics",
        "extproc.background",
    },
    "extproc.transport": {"extproc.transport", "extproc.background"},
    "extproc.admin": {
        "extproc.admin",
        "extproc.core",
        "extproc.metrics",
        "extproc.openai",
        "extproc.background",
    },
    "extproc.devstack": {"extproc.devstack", "extproc.events", "extproc.core"},
    "extproc": {"extproc"},  # __main__, service, settings: the wiring
    "extproc.settings_table": set(),
    "extproc.background": set(),
    "llmworker": {
        "llmworker",
        "extproc.events",
        "extproc.openai",
        "extproc.core.endpoint",
        "extproc.settings_table",
    },
}
# Third-party or standard modules the pure core must not use: no I/O, no protobuf, no loop.
FLAT = {"extproc", "extproc.__main__", "extproc.service", "extproc.settings"}
# Inside the core the arrows point down too: the pool (workers and their load) is built on
# the busy rule, endpoints and this replica's versions, and imports nothing above it; the
# decision, the request classes and the other replicas' estimates sit on the pool.
CORE_BELOW_POOL = {
    "extproc.core.allowlist",
    "extproc.core.busy",
    "extproc.core.endpoint",
    "extproc.core.loopback",
    "extproc.core.replica",
    "extproc.core.worker",
}
CORE_FORBIDDEN = ("asyncio", "socket", "grpc", "google", "envoy", "zmq", "aiozmq", "aiohttp")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _plane(module: str) -> str:
    """The most specific key of ALLOWED that contains ``module``."""
    best = ""
    for plane in ALLOWED:
        if (module == plane or module.startswith(plane + ".")) and len(plane) > len(best):
            best = plane
    return best


def _within(name: str, allowed: set[str]) -> bool:
    return any(name == a or name.startswith(a + ".") for a in allowed)


SOURCES = sorted(p for d in ("extproc", "llmworker") for p in (ROOT / d).rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_flow(path: Path) -> None:
    module = _module_name(path)
    plane = _plane(module)
    assert plane, f"{module} is in no plane of the layout; add it to ALLOWED"
    if plane == "extproc":
        assert module in FLAT, f"{module}: only {sorted(FLAT)} stay flat; put it in a plane"
    ours = [n for n in _imports(path) if n.split(".")[0] in ("extproc", "llmworker")]
    wrong = [n for n in ours if not _within(n, ALLOWED[plane])]
    assert not wrong, f"{module} ({plane}) imports {wrong}; it may import {sorted(ALLOWED[plane])}"
    if plane == "extproc.core":
        io = [n for n in _imports(path) if n.split(".")[0] in CORE_FORBIDDEN]
        assert not io, f"{module} is pure core but imports {io}"


POOL_AND_BELOW = [p for p in SOURCES if _module_name(p) in CORE_BELOW_POOL | {"extproc.core.pool"}]


@pytest.mark.parametrize("path", POOL_AND_BELOW, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_pool_and_what_it_stands_on_import_nothing_above_them(path: Path) -> None:
    module = _module_name(path)
    above = [
        n
        for n in _imports(path)
        if n.startswith("extproc.core.") and not _within(n, CORE_BELOW_POOL)
    ]
    assert not above, f"{module} imports {above}; it may import {sorted(CORE_BELOW_POOL)}"


def test_the_checker_catches_a_wrong_import() -> None:
    """A reversed import is reported (the rule above is not vacuous)."""
    assert not _within("extproc.handlers.processor", ALLOWED["extproc.core"])
    assert not _within("llmworker.sim", ALLOWED[_plane("extproc.devstack.procs")])
    assert _plane("extproc.service") == "extproc"
    assert _within("extproc.events.schema", ALLOWED["llmworker"])
    assert _within("extproc.settings_table", ALLOWED["llmworker"])
    assert not _within("extproc.settings", ALLOWED["llmworker"])
    assert _plane("extproc.settings_table") == "extproc.settings_table"
    assert not _within("extproc.core.busy", ALLOWED["extproc.settings_table"])
    assert len(SOURCES) > 30
    assert len(POOL_AND_BELOW) == len(CORE_BELOW_POOL) + 1
    assert not _within("extproc.core.scheduling", CORE_BELOW_POOL)
