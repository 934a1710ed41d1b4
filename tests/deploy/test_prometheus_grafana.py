"""deploy/: the alert rules (promtool), the Grafana dashboard and its provisioning, and both
checked against a real Prometheus (Debian's package) scraping the real stack.

The live test runs Prometheus on loopback with a 1 s scrape interval and a copy of the
alert rules whose ``for:`` durations are cut to 2 s (the shipped file's are minutes), drives
traffic of three request classes through Envoy (the shipped classes example and the
tier routes of envoy/envoy.yaml; one class shed while the others are admitted), forces
every worker busy (``POST /busy_threshold`` with
``active_decode_blocks_threshold`` 0.0 while every worker reports load), then evaluates every
dashboard query and every alert expression through the HTTP API. A second live test does the
same for deadline admission's panels and alerts, on a simulated engine with one slot and a
TTFT target: a request held for the slot, one rejected at once with the deadline reply.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
import urllib.parse
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from extproc.core.busy import TTFT_TARGET
from extproc.devstack import ROOT, Proc, free_port, get_json, http, wait_until
from tests.conftest import Stack
from tests.integration.test_latency_target import (
    LONG,
    SHORT,
    occupied,
    request,
    sim_stack,
    warm_up,
)

DEPLOY = ROOT / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
RULE_TESTS = sorted((DEPLOY / "prometheus" / "tests").glob("*.test.yml"))
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "extproc.json"
COMPOSE = ROOT / "docker-compose.yml"
CLASSES = DEPLOY / "classes.example.yaml"
CHAT = "/v1/chat/completions"
MODEL = "llama"
# Metric names in PromQL: ours, Dynamo's, Envoy's, and Prometheus' own ``up``; a name
# followed by a matcher operator is a label, not a metric.
SELECTOR = re.compile(r"\b((?:extproc|dynamo|envoy)_[A-Za-z0-9_]+|up)\b(?!\s*[=!~])(\{[^}]*\})?")
OUTER_BY = re.compile(r"\s*\w+\s+by\s*\(([^)]*)\)")
# Series of deadline admission: they exist only for models with a TTFT target (the held
# wait: once something was held). The test with a target checks them.
DEADLINE_SERIES = {
    "extproc_predicted_ttft_seconds_bucket",
    "extproc_ttft_target_met_total",
    "extproc_held_requests",
    "extproc_held_wait_seconds_bucket",
    "extproc_ttft_target_seconds",
    "extproc_deadline_rejections_total",
}
# Series that exist only while something happens; their names are still checked against
# the extproc's /metrics (``# TYPE`` lines exist from startup).
ONLY_WHILE_ACTIVE = {"extproc_router_queue_depth", *DEADLINE_SERIES}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        reason = f"{name} not found (Debian: apt-get install prometheus)"
        print(f"SKIP reason: {reason}")
        pytest.skip(reason)
    return path


def _alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def _dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every panel target, rows' nested panels included."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    stack = list(dash["panels"])
    while stack:
        panel = stack.pop(0)
        stack.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def _substitute(expr: str, rate_interval: str = "1m") -> str:
    """The dashboard's template variables as Grafana would fill them ("All" models)."""
    return expr.replace("$__rate_interval", rate_interval).replace("$model", ".*")


# ----- promtool ----------------------------------------------------------------------------


def test_alert_rules_pass_promtool_check() -> None:
    proc = subprocess.run(
        [_tool("promtool"), "check", "rules", str(ALERTS)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(_alert_rules())} rules found" in proc.stdout


def test_every_alert_has_a_unit_test_file_with_a_firing_and_a_quiet_case() -> None:
    tested: dict[str, list[dict[str, Any]]] = {}
    for path in RULE_TESTS:
        doc = yaml.safe_load(path.read_text())
        for case in doc["tests"]:
            for check in case.get("alert_rule_test", []):
                tested.setdefault(check["alertname"], []).append(check)
    for rule in _alert_rules():
        checks = tested.get(rule["alert"])
        assert checks, f"no promtool test for alert {rule['alert']}"
        assert any(c["exp_alerts"] for c in checks), f"{rule['alert']}: never expected to fire"
        assert any(not c["exp_alerts"] for c in checks), f"{rule['alert']}: no quiet case"


@pytest.mark.parametrize("path", RULE_TESTS, ids=[p.name for p in RULE_TESTS])
def test_alert_unit_tests(path: Path) -> None:
    proc = subprocess.run(
        [_tool("promtool"), "test", "rules", path.name],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=path.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ----- dashboard and compose wiring --------------------------------------------------------


def test_dashboard_is_provisioned_from_the_repo_files() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dash["panels"]:
        if panel["type"] != "row":
            assert panel["targets"], f"panel {panel['title']!r} has no query"
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    retired = re.compile(
        r"extproc_latency_|extproc_worker_latency_limit|extproc_(engine_)?ttft_p99_seconds"
    )
    assert not [e for _, e in _dashboard_queries() if retired.search(e)], "retired series"
    variables = {v["name"] for v in dash["templating"]["list"]}
    used = {m for _, e in _dashboard_queries() for m in re.findall(r"\$(\w+)", e)}
    assert used <= variables | {"__rate_interval"}, used - variables
    titles = " / ".join(p["title"].lower() for p in dash["panels"])
    for subject in (
        "rejections per model and endpoint",
        "decisions by outcome",
        "decision latency",
        "effective load / limit",
        "events dropped",
        "workers by state",
        "router queue depth",
        "router queue wait",
        "requests per class",
        "rejection ratio per class",
        "predicted ttft p50 and p99 per model",
        "share of admitted requests that met the ttft target",
        "held requests per model",
        "held wait p50 and p99",
        "deadline rejections per second",
        "background task errors",
    ):
        assert subject in titles, subject

    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["observability"]
        for volume in services[name]["volumes"]:
            source = volume.split(":", 1)[0]
            assert (ROOT / source).exists(), f"{name} mounts {source}, which does not exist"
    datasource = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    assert datasource["type"] == "prometheus"
    prom_cfg = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    assert prom_cfg["rule_files"] == ["/etc/prometheus/alerts.yml"]
    assert (
        "./deploy/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro"
        in (services["prometheus"]["volumes"])
    )


def test_compose_config_is_valid_with_the_observability_profile() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        print("SKIP reason: docker-compose not installed")
        pytest.skip("docker-compose not installed (Debian: apt-get install -y docker-compose)")
    for extra in ([], ["--profile", "observability"]):
        proc = subprocess.run(
            [binary, "-f", str(COMPOSE), *extra, "config", "-q"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert proc.returncode == 0, (extra, proc.stdout + proc.stderr)


# ----- a real Prometheus against the real stack --------------------------------------------


class Prometheus:
    """Debian's prometheus on 127.0.0.1 with a temp TSDB, stopped by PID."""

    def __init__(self, workdir: Path, scrape: dict[str, str], rules: Path) -> None:
        self.port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {
                    "job_name": job,
                    "metrics_path": urllib.parse.urlsplit(url).path,
                    "static_configs": [{"targets": [urllib.parse.urlsplit(url).netloc]}],
                }
                for job, url in scrape.items()
            ],
        }
        cfg = workdir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config))
        self.proc = Proc(
            "prometheus",
            [
                _tool("prometheus"),
                f"--config.file={cfg}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            workdir,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        assert self.proc.alive(), self.proc.log()[-2000:]
        return http("GET", self.url + "/-/ready", timeout=1)[0] == 200

    def query(self, expr: str) -> list[dict[str, Any]]:
        status, _, body = http(
            "GET", self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        )
        doc = json.loads(body)
        assert status == 200 and doc["status"] == "success", (expr, status, doc)
        return doc["data"]["result"]

    def alerts(self) -> list[dict[str, Any]]:
        return get_json(self.url + "/api/v1/alerts")["data"]["alerts"]

    def stop(self) -> int | None:
        return self.proc.stop()


def _exposed_names(text: str) -> set[str]:
    """Sample names and ``# TYPE`` names (series that exist only while active) in a scrape."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            names.add(name)
            # The sample names a family has once it has samples.
            if kind == "histogram":
                names.update(name + suffix for suffix in ("_bucket", "_sum", "_count"))
            elif kind == "counter":
                names.add(name + "_total")
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def _fast_rules(dest: Path) -> Path:
    """The shipped rules with every ``for:`` cut to 2 s, so a test can see them fire."""
    doc = yaml.safe_load(ALERTS.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "2s"
    path = dest / "alerts-fast.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def stack(make_stack: Any) -> Stack:
    return make_stack(
        [
            "--active-decode-blocks-threshold",
            "0.5",
            "--active-prefill-tokens-threshold",
            "1000",
            "--active-prefill-tokens-threshold-frac",
            "1.0",
            "--worker-ttl",
            "30",
            "--classes-file",
            str(CLASSES),
        ]
    )


def _send(url: str, count: int, tier: str | None = None) -> list[int]:
    """Statuses of ``count`` requests; ``tier`` picks the class on Envoy's x-api-tier routes
    (premium: critical, batch: sheddable; none: the default class, standard)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-api-tier": tier} if tier else {}
    return [http("POST", url + CHAT, body, headers, timeout=5)[0] for _ in range(count)]


def _firing(prom: Prometheus, name: str) -> list[dict[str, Any]]:
    return [a for a in prom.alerts() if a["labels"]["alertname"] == name]


@pytest.mark.slow
def test_dashboard_queries_and_alerts_against_a_real_prometheus(
    stack: Stack, tmp_path: Path
) -> None:
    _tool("prometheus")
    started = time.monotonic()
    pub, ext, url = stack.pub, stack.ext, stack.envoy.url
    wait_until(stack.envoy.ready, 15, "envoy ready")
    prom = Prometheus(
        tmp_path,
        {
            "extproc": ext.admin + "/metrics",
            "envoy": f"http://127.0.0.1:{stack.envoy.admin_port}/stats/prometheus",
        },
        _fast_rules(tmp_path),
    )
    try:
        wait_until(prom.ready, 20, "prometheus ready")
        for worker, name in (("gpu-a", "a"), ("gpu-b", "b")):
            pub.announce(
                ext,
                worker,
                MODEL,
                stack.endpoint(name),
                kv_total_blocks=100,
                max_num_batched_tokens=64,
            )
            pub.load(worker, active_decode_blocks=10, active_prefill_tokens=5)
        pub.send("load", b"\xc1")  # dropped: bad_encoding
        assert set(_send(url, 20)) == {200}
        assert set(_send(url, 5, "premium")) == {200}
        # Only sheddable busy: its share cut so that 10 blocks in use are above its limit.
        status, _, body = http("POST", ext.admin + "/classes", {"name": "sheddable", "share": 0.1})
        assert status == 200, body
        assert _send(url, 5, "batch") == [429] * 5  # the example's status for sheddable
        assert set(_send(url, 5)) == {200}

        # Every worker busy: decode threshold 0.0 while each reports 10 blocks in use.
        status, _, body = http(
            "POST",
            ext.admin + "/busy_threshold",
            {"model": MODEL, "active_decode_blocks_threshold": 0.0},
        )
        assert status == 200, body
        wait_until(lambda: ext.workers()["gpu-b"]["state"] == "busy", 10, "every worker busy")
        assert all(w["state"] == "busy" for w in ext.workers().values())
        assert _send(url, 20) == [529] * 20

        def scraped() -> bool:
            got = prom.query('extproc_decisions_total{outcome="overloaded"} >= 20')
            by_class = prom.query(
                'count by (class) (extproc_requests_by_class_total{outcome="overloaded"})'
            )
            return (
                bool(got)
                and bool(prom.query("envoy_http_ext_proc_streams_started > 0"))
                and len(by_class) == 2  # sheddable, then standard
            )

        wait_until(scraped, 15, "Prometheus has scraped the rejections")

        def all_busy_fires() -> list[dict[str, Any]]:
            return [a for a in _firing(prom, "ExtprocAllWorkersBusy") if a["state"] == "firing"]

        fired = wait_until(all_busy_fires, 20, "ExtprocAllWorkersBusy firing")
        assert fired[0]["labels"]["model"] == MODEL
        # The dropped event fires its alert too; nothing made Envoy fail open.
        wait_until(lambda: _firing(prom, "ExtprocEventsDropped"), 10, "ExtprocEventsDropped")
        assert _firing(prom, "ExtprocEventsDropped")[0]["labels"]["reason"] == "bad_encoding"
        assert not _firing(prom, "ExtprocFailingOpen")

        exposed = _exposed_names(
            ext.metrics()
            + http("GET", f"http://127.0.0.1:{stack.envoy.admin_port}/stats/prometheus")[2].decode()
        )
        # Every dashboard query returns series, each carrying its by-labels.
        problems = []
        for title, raw in _dashboard_queries():
            expr = _substitute(raw)
            names = {m.group(1) for m in SELECTOR.finditer(expr)}
            assert names, (title, expr)
            for name in names:
                if name != "up" and name not in exposed:
                    problems.append(f"{title}: {name} is not exposed")
            if names & ONLY_WHILE_ACTIVE:
                prom.query(expr)  # must still parse and evaluate
                continue
            result = prom.query(expr)
            if not result:
                problems.append(f"{title}: no series for {expr}")
            outer = OUTER_BY.match(expr)  # sum by (a, b) (...): each series has a and b
            wanted = {x.strip() for x in outer.group(1).split(",")} if outer else set()
            for series in result:
                missing = wanted - set(series["metric"])
                if missing:
                    problems.append(f"{title}: series without {missing}: {series}")
        assert not problems, "\n".join(problems)
        # The per-class panel sees each class with what happened to it.
        per_class = next(e for title, e in _dashboard_queries() if "per class:" in title)
        seen = {
            (s["metric"]["class"], s["metric"]["outcome"])
            for s in prom.query(_substitute(per_class))
        }
        assert seen == {
            ("critical", "routed"),
            ("standard", "routed"),
            ("standard", "overloaded"),
            ("sheddable", "overloaded"),
        }
        values = get_json(prom.url + "/api/v1/label/model/values?match[]=extproc_model_workers")[
            "data"
        ]
        assert MODEL in values  # the dashboard's $model variable

        # Every alert expression evaluates, and each selector in it matches series (those
        # of deadline admission: in the test with a target).
        for rule in _alert_rules():
            prom.query(rule["expr"])
            for match in SELECTOR.finditer(rule["expr"]):
                if match.group(1) in DEADLINE_SERIES:
                    continue
                selector = match.group(0)
                assert prom.query(f"count({selector})"), (rule["alert"], selector)
    finally:
        prom.stop()
    assert time.monotonic() - started < 60


def _deadline_queries() -> list[tuple[str, str]]:
    """The dashboard queries of deadline admission's series (the deadline outcome too)."""
    return [
        (title, expr)
        for title, expr in _dashboard_queries()
        if {m.group(1) for m in SELECTOR.finditer(expr)} & DEADLINE_SERIES
        or 'outcome="deadline"' in expr
    ]


@pytest.mark.slow
async def test_deadline_admission_panels_and_alerts_against_a_real_prometheus(
    tmp_path: Path,
) -> None:
    """A simulated engine with one slot, measured by two long requests; then with a 10 s
    target a second request waits held in the router for the slot, and with a 300 ms target
    one is rejected at once. Every panel on deadline admission's series then has data in a
    Prometheus scraping the extproc, and the alerts on them evaluate on real series."""
    _tool("prometheus")
    queries = _deadline_queries()
    titles = {title for title, _ in queries}
    assert len(titles) == 5, titles  # predicted TTFT, share met, held, held wait, rejections
    with sim_stack(tmp_path) as st:
        prom = Prometheus(tmp_path, {"extproc": st.ext.admin + "/metrics"}, _fast_rules(tmp_path))
        try:
            wait_until(prom.ready, 20, "prometheus ready")
            url = st.envoy.url
            timeout = aiohttp.ClientTimeout(total=30)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                await warm_up(session, st)
                assert st.post({"model": "m", TTFT_TARGET: 10_000})[0] == 200
                long = asyncio.ensure_future(request(session, url, LONG))
                await occupied(st)
                short = asyncio.ensure_future(request(session, url, SHORT))

                def held() -> bool:
                    return st.metric("extproc_held_requests", {"model": "m"}) == 1

                await asyncio.to_thread(wait_until, held, 5, "the short request held")
                # Prometheus sees it held before the slot frees (~2 s).
                await asyncio.to_thread(
                    wait_until,
                    lambda: prom.query('extproc_held_requests{model="m"} == 1'),
                    5,
                    "Prometheus scraped the held request",
                )
                assert [r.status for r in await asyncio.gather(long, short)] == [200, 200]

                assert st.post({"model": "m", TTFT_TARGET: 300})[0] == 200
                # Two rejections, Prometheus scraping between them: the deadline outcome's
                # series is born with the first (at 1), which rate() cannot see.
                for count in (1, 2):
                    long = asyncio.ensure_future(request(session, url, LONG))
                    await occupied(st)
                    refused = await request(session, url, SHORT)
                    assert refused.status == 529
                    assert refused.headers["x-shed-reason"] == "deadline"
                    await asyncio.to_thread(
                        wait_until,
                        lambda n=count: prom.query(
                            f'extproc_decisions_total{{outcome="deadline"}} >= {n}'
                        ),
                        5,
                        f"Prometheus scraped deadline rejection {count}",
                    )
                    assert (await long).status == 200
                assert (await request(session, url, SHORT)).status == 200

            def scraped() -> bool:
                return bool(
                    prom.query('extproc_decisions_total{outcome="deadline"} >= 2')
                    and prom.query("extproc_held_wait_seconds_count >= 1")
                    and prom.query('extproc_ttft_target_met_total{model="m", met="true"} >= 3')
                )

            wait_until(scraped, 15, "Prometheus has scraped the deadline decisions")
            # Every panel's query returns series with their by-labels, and numbers: the
            # window (5 m) covers the whole run.
            problems = []
            for title, raw in queries:
                expr = _substitute(raw, "5m")
                result = prom.query(expr)
                if not result:
                    problems.append(f"{title}: no series for {expr}")
                outer = OUTER_BY.match(expr)
                wanted = {x.strip() for x in outer.group(1).split(",")} if outer else set()
                for series in result:
                    if wanted - set(series["metric"]):
                        problems.append(f"{title}: series without {wanted}: {series}")
                    if series["value"][1] in ("NaN", "+Inf", "-Inf"):
                        problems.append(f"{title}: {series['value'][1]} for {expr}")
            assert not problems, "\n".join(problems)
            by_title = {
                title: prom.query(_substitute(raw, "5m"))
                for title, raw in queries
                if "p99" not in raw or "held wait" in title.lower()
            }
            met = next(v for t, v in by_title.items() if "share" in t.lower())
            assert met[0]["metric"]["model"] == "m" and 0 < float(met[0]["value"][1]) <= 1
            rejected = next(v for t, v in by_title.items() if "deadline rejections" in t.lower())
            assert float(rejected[0]["value"][1]) > 0

            # The alerts on deadline admission's series evaluate and their selectors match.
            for rule in _alert_rules():
                names = {m.group(1) for m in SELECTOR.finditer(rule["expr"])}
                if not names & DEADLINE_SERIES:
                    continue
                prom.query(rule["expr"])
                for match in SELECTOR.finditer(rule["expr"]):
                    assert prom.query(f"count({match.group(0)})"), (rule["alert"], match[0])
            assert not _firing(prom, "ExtprocBackgroundTaskFailing")
        finally:
            prom.stop()
