"""The status page (``/status``, ``/status.json``): its JSON in-process, and the rendered page
in Debian's headless chromium against the real stack (Envoy -> extproc -> echo workers), and
with a TTFT target against a simulated engine with one slot (deadline admission).

``UPDATE_SCREENSHOT=1`` rewrites docs/status-page.png and docs/status-page-deadline.png from
the browser tests.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from extproc.admin.app import Readiness, build_app
from extproc.admin.auth import AdminAuth
from extproc.admin.status import DecisionHistory
from extproc.core.busy import TTFT_TARGET, BusyThresholds
from extproc.core.pool import WorkerPool
from extproc.devstack import Publisher, free_port, get_json, http, wait_until
from extproc.metrics.registry import Metrics
from tests.conftest import Stack
from tests.integration.test_latency_target import LONG, SHORT, sim_stack

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


# ----- in-process: the JSON, the history sampler, the read-only page ---------------------


def _pool() -> WorkerPool:
    pool = WorkerPool(BusyThresholds(active_decode_blocks=0.5))
    pool.announce("w1", model="m", endpoint="127.0.0.1:1", kv_total_blocks=100)
    pool.announce("w2", model="m", endpoint="127.0.0.1:2", kv_total_blocks=100)
    pool.report_load("w1", active_decode_blocks=80)
    pool.report_load("w2", active_decode_blocks=10)
    return pool


def test_history_counts_per_second_deltas_by_outcome() -> None:
    metrics = Metrics()
    history = DecisionHistory(metrics, seconds=3, clock=lambda: 100.0)
    history.sample()  # the base: no point yet
    assert list(history.points) == []
    metrics.outcome["routed"].inc(5)
    metrics.outcome["overloaded"].inc(2)
    metrics.outcome["deadline"].inc(1)
    metrics.rejections.labels("m", "chat_completions").inc(2)
    metrics.rejections.labels("m", "completions").inc(1)
    metrics.rejections.labels("n", "completions").inc(1)
    history.sample()
    history.sample()
    assert list(history.points) == [
        {
            "t": 100.0,
            "decisions": {"routed": 5, "overloaded": 2, "deadline": 1},
            "rejected": 4,
            "rejected_by_model": {"m": 3, "n": 1},
        },
        {"t": 100.0, "decisions": {}, "rejected": 0, "rejected_by_model": {}},
    ]
    for _ in range(5):
        history.sample()
    assert len(history.points) == 3  # a ring: the oldest go


async def test_status_json_and_page_are_reads_open_under_a_token() -> None:
    pool = _pool()
    app = build_app(pool, Metrics(), Readiness(), AdminAuth("s3cret", required=True))
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/status.json")
        assert resp.status == 200
        body = await resp.json()
        assert body["overload_status"] == 529
        assert body["models"] == [
            {
                "model": "m",
                "thresholds": {
                    "active_decode_blocks_threshold": 0.5,
                    "active_prefill_tokens_threshold": None,
                    "active_prefill_tokens_threshold_frac": None,
                },
                "workers": 2,
                "overloaded": False,
                "router_queue_depth": 0,
            }
        ]
        by_id = {w["worker_id"]: w for w in body["workers"]}
        assert by_id["w1"]["display_state"] == "busy"
        assert by_id["w1"]["ranks"][0]["fired"] == "active_decode_blocks_threshold"
        assert by_id["w1"]["ranks"][0]["busy_limits"]["active_decode_blocks_threshold"] == 50
        assert by_id["w2"]["display_state"] == "free"
        page = await client.get("/status")
        assert page.status == 200
        assert page.content_type == "text/html"
        html = await page.text()
        # Air-gapped and read-only: nothing loaded from elsewhere, no form, no write call.
        assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in html
        assert "<form" not in html.lower()
        assert "POST" not in html and "method:" not in html
        root = await client.get("/", allow_redirects=False)
        assert (root.status, root.headers["Location"]) == (302, "/status")
        # The write stays guarded exactly as before.
        write = await client.post("/busy_threshold", json={"model": "m"})
        assert write.status == 401


async def test_every_worker_busy_marks_the_model_rejecting_and_stale_load_shows() -> None:
    now = [1000.0]
    pool = WorkerPool(BusyThresholds(active_decode_blocks=0.5), worker_ttl=60, clock=lambda: now[0])
    pool.announce("w1", model="m", endpoint="127.0.0.1:1", kv_total_blocks=10)
    pool.report_load("w1", active_decode_blocks=9)
    app = build_app(pool, Metrics(), Readiness())
    async with TestClient(TestServer(app)) as client:
        body = await (await client.get("/status.json")).json()
        assert body["models"][0]["overloaded"] is True
        now[0] += 30  # no load event for 30 s: past the 5 s staleness bound
        body = await (await client.get("/status.json")).json()
        worker = body["workers"][0]
        assert worker["display_state"] == "stale"
        assert worker["display_why"].startswith("no load events for 30 s")


async def test_metrics_carry_busy_limits_model_states_and_load_age() -> None:
    pool = _pool()
    pool.announce("w3", model="m", endpoint="127.0.0.1:3")
    metrics = Metrics()
    metrics.attach(pool)
    async with TestClient(TestServer(build_app(pool, metrics, Readiness()))) as client:
        text = await (await client.get("/metrics")).text()
    lines = set(text.splitlines())
    limit = 'extproc_worker_busy_limit{check="active_decode_blocks_threshold",dp_rank="0"'
    assert f'{limit},worker_id="w1",worker_type="decode"}} 50.0' in lines
    assert not any('worker_id="w3"' in x for x in lines if x.startswith(limit))  # no kv total
    assert 'extproc_model_workers{model="m",state="busy"} 1.0' in lines
    assert 'extproc_model_workers{model="m",state="free"} 2.0' in lines
    assert 'extproc_model_workers{model="m",state="overloaded"} 0.0' in lines
    assert 'extproc_worker_load_age_seconds{model="m",worker_id="w3"} +Inf' in lines


# ----- the rendered page in a real browser ------------------------------------------------


@pytest.fixture
def browser() -> Any:
    """Function-scoped: Playwright's sync API runs an event loop, which must be gone before
    the module's async tests run."""
    if not os.path.exists(CHROMIUM):
        print(f"SKIP reason: {CHROMIUM} not found (apt-get install chromium)")
        pytest.skip(f"{CHROMIUM} not found: apt-get install chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("SKIP reason: playwright is not installed (pip install -e '.[test]')")
        pytest.skip("playwright is not installed: pip install -e '.[test]'")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def stack(make_stack: Any) -> Stack:
    return make_stack(["--active-decode-blocks-threshold", "0.5", "--worker-ttl", "30"])


def _send(url: str, model: str, count: int) -> list[int]:
    return [http("POST", url + CHAT, chat(model), timeout=5)[0] for _ in range(count)]


@pytest.mark.slow
def test_rendered_page_shows_busy_worker_with_reason_and_moving_rejection_chart(
    stack: Stack, browser: Any, tmp_path: Path
) -> None:
    pub, ext, url = stack.pub, stack.ext, stack.envoy.url
    wait_until(stack.envoy.ready, 15, "envoy ready")
    pub.announce(ext, "gpu-a", "llama", stack.endpoint("a"), kv_total_blocks=100)
    pub.announce(ext, "gpu-b", "llama", stack.endpoint("b"), kv_total_blocks=100)
    pub.load("gpu-a", active_decode_blocks=90, active_prefill_tokens=12)
    pub.load("gpu-b", active_decode_blocks=20)
    wait_until(lambda: ext.workers()["gpu-a"]["state"] == "busy", 10, "gpu-a busy")

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    def on_console(msg: Any) -> None:
        if msg.type == "error":
            errors.append(msg.text)

    page.on("console", on_console)
    requested: list[str] = []
    page.on("request", lambda req: requested.append(req.url))
    page.goto(ext.admin + "/status")
    # Fresh load reports: data older than 5 s shows as stale, and starting a browser can be slow.
    pub.load("gpu-a", active_decode_blocks=90, active_prefill_tokens=12)
    pub.load("gpu-b", active_decode_blocks=20)
    row = page.locator('tr.worker[data-worker-id="gpu-a"]')
    row.wait_for(timeout=10_000)
    page.wait_for_function(
        "document.querySelector('tr.worker[data-worker-id=\"gpu-a\"]')?.dataset.state === 'busy'",
        timeout=10_000,
    )
    assert row.locator(".state").inner_text() == "busy"
    assert "active_decode_blocks_threshold" in row.locator(".why").inner_text()
    assert "90 / 50" in row.inner_text()  # effective decode blocks against the limit
    assert "no TTFT target on its model" in row.locator("td.dl").inner_text()
    free_row = page.locator('tr.worker[data-worker-id="gpu-b"]')
    assert free_row.get_attribute("data-state") == "free"

    # Traffic with one worker free: routed, nothing rejected.
    assert set(_send(url, "llama", 10)) == {200}
    before = int(page.locator("#chart").get_attribute("data-rejected-total") or "0")
    # Every worker busy: overload replies, and the chart's rejections must grow.
    pub.load("gpu-b", active_decode_blocks=95)
    wait_until(lambda: ext.workers()["gpu-b"]["state"] == "busy", 10, "gpu-b busy")
    statuses = _send(url, "llama", 25)
    assert statuses.count(529) == 25, statuses
    page.wait_for_function(
        f"+document.getElementById('chart').dataset.rejectedTotal >= {before + 25}",
        timeout=10_000,
    )
    assert page.locator("#chart rect.o-overloaded").count() >= 1
    # Fresh reports again: a worker whose last one is older than 5 s shows as stale, not
    # busy, and the model as accepting (seen on a slow machine by this point of the test).
    pub.load("gpu-a", active_decode_blocks=90, active_prefill_tokens=12)
    pub.load("gpu-b", active_decode_blocks=95)
    page.wait_for_function(
        "document.querySelector('#models tr[data-model=\"llama\"]')"
        "?.innerText.includes('rejecting')",
        timeout=10_000,
    )
    assert int(page.locator("#rejected-last-minute").inner_text()) >= 25
    assert get_json(ext.admin + "/status.json")["models"][0]["overloaded"] is True

    # A screenshot with both states and some history on it.
    pub.load("gpu-a", active_decode_blocks=90, active_prefill_tokens=12)
    pub.load("gpu-b", active_decode_blocks=30)
    wait_until(lambda: ext.workers()["gpu-b"]["state"] == "free", 10, "gpu-b free")
    _send(url, "llama", 15)
    page.wait_for_function(
        "document.querySelector('tr.worker[data-worker-id=\"gpu-b\"]')?.dataset.state === 'free'",
        timeout=5_000,
    )
    shot = tmp_path / "status-page.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if os.environ.get("UPDATE_SCREENSHOT") == "1":
        shutil.copy(shot, ROOT / "docs" / "status-page.png")
    assert not errors, errors
    # Nothing but the page and its JSON: works air-gapped.
    assert {u.split("?")[0] for u in requested} <= {
        ext.admin + "/status",
        ext.admin + "/status.json",
    }, requested
    page.close()


def test_status_json_shows_a_target_its_held_requests_and_where_it_is_unreachable() -> None:
    from extproc.admin.status import status_view
    from extproc.core.latency import DeadlineAdmission

    pool = WorkerPool(BusyThresholds(ttft_p99_target_ms=50.0))
    pool.announce("w", model="slo", endpoint="127.0.0.1:9")
    pool.announce("v", model="slo", endpoint="127.0.0.1:10")
    admission = DeadlineAdmission(pool)
    worker = pool.workers["w"]
    for i in range(6):  # 200 ms to the first byte on an idle worker: above 50 ms
        admission.dispatched(i, worker, 100, 10.0 * i, 10.0 * i)
        admission.first_byte(i, worker, 10.0 * i + 0.2)
        admission.ended(i, worker, 10.0 * i + 1.0, 5)
    admission.ttft_measured("slo", 0.03, 0.05)
    metrics = Metrics()
    view = status_view(pool, metrics, DecisionHistory(metrics, seconds=3), 529, admission)
    latency = view["models"][0]["latency"]
    assert latency["ttft_p99_target_ms"] == 50.0
    assert latency["target_unreachable"] == ["w"]  # "v" has no measurement: no verdict
    assert (latency["held_requests"], latency["target_met_share"]) == (0, 1.0)
    assert (latency["admitted_met_target"], latency["admitted_missed_target"]) == (1, 0)
    by_id = {w["worker_id"]: w for w in view["workers"]}
    assert by_id["w"]["deadline"]["target"].startswith("target unreachable: an idle worker")
    assert "target" not in by_id["v"]["deadline"]


def _page(browser: Any, url: str) -> tuple[Any, list[str], list[str]]:
    """A page on ``url`` with its script errors and the URLs it requested."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors: list[str] = []
    requested: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("request", lambda req: requested.append(req.url))
    page.goto(url)
    return page, errors, requested


# A generation that holds the engine's only slot for about 5 s: the page refreshes every
# second, so it sees the request held behind it.
LONGER = {**LONG, "max_tokens": 250}


def _wait_text(page: Any, selector: str, text: str, timeout_ms: int = 10_000) -> None:
    page.wait_for_function(
        "([sel, text]) => (document.querySelector(sel)?.innerText || '').includes(text)",
        arg=[selector, text],
        timeout=timeout_ms,
    )


def _complete(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str]]:
    """One streamed completion through Envoy, read to its end: (status, headers)."""
    status, headers, _ = http("POST", url + "/v1/completions", body, timeout=30)
    return status, headers


def _in_flight(stack: Any) -> bool:
    return int(stack.ext.workers()["sim"]["deadline"]["in_flight"]) >= 1


@pytest.mark.slow
def test_rendered_page_shows_the_target_held_requests_share_met_and_predictions(
    browser: Any, tmp_path: Path
) -> None:
    """A simulated engine with one slot through the real Envoy: a request rejected at once
    with a 300 ms target, then with a 10 s target one held behind a long generation; the
    page shows the model's target, the held request (model and worker), the share met with
    its counts, the deadline rejection, the worker's predicted wait and TTFT, prefill cost,
    completion rate; then a 1 ms target shows "target unreachable" with the idle TTFT."""
    with sim_stack(tmp_path) as st, ThreadPoolExecutor(2) as pool:
        url = st.envoy.url
        page, errors, requested = _page(browser, st.ext.admin + "/status")
        model_row = 'tr[data-model="m"]'
        worker_row = 'tr.worker[data-worker-id="sim"]'
        for _ in range(2):  # the router measures the worker's service time and prefill
            assert _complete(url, LONG)[0] == 200

        def measured() -> bool:
            view = st.ext.workers()["sim"]["deadline"]
            return view["completion_rate_per_s"] is not None and view["in_flight"] == 0

        wait_until(measured, 10, "the completions measured")
        # Without a target the page shows the predictions alone.
        _wait_text(page, worker_row, "no TTFT target on its model")

        assert st.post({"model": "m", TTFT_TARGET: 300})[0] == 200
        long = pool.submit(_complete, url, LONG)
        wait_until(lambda: _in_flight(st), 10, "the long request in flight")
        refused = _complete(url, SHORT)
        assert (refused[0], refused[1]["x-shed-reason"]) == (529, "deadline")
        assert long.result()[0] == 200
        assert _complete(url, SHORT)[0] == 200  # the slot free: it fits, and meets it

        assert st.post({"model": "m", TTFT_TARGET: 10_000})[0] == 200
        long = pool.submit(_complete, url, LONGER)
        wait_until(lambda: _in_flight(st), 10, "the long request in flight")
        short = pool.submit(_complete, url, SHORT)
        _wait_text(page, model_row, "1 held")
        _wait_text(page, worker_row, "1 held · 1 in flight")
        cell = page.locator(f"{model_row} td.latency").inner_text()
        assert "TTFT target 10000 ms" in cell, cell
        assert "met 100.0 %" in cell, cell  # the admitted ones so far met their target
        assert int(page.locator("#t-deadline").inner_text()) == 1
        assert int(page.locator(f"{model_row} td.rejected").inner_text()) == 1
        assert page.locator("#chart rect.o-deadline").count() >= 1
        dl = page.locator(f"{worker_row} td.dl").inner_text()
        for part in (
            "predicted wait ",
            "prefill ",
            " ms / 1k tokens",
            "completions ",
            " % of the prefill ahead",
        ):
            assert part in dl, (part, dl)
        assert "not measured" not in dl  # the completion rate is measured
        assert "from the engine's slots" in dl and "target unreachable" not in dl
        shot = tmp_path / "status-page-deadline.png"
        page.screenshot(path=str(shot), full_page=True)
        assert (long.result()[0], short.result()[0]) == (200, 200)

        # Every admitted streamed request with a target met it: 4 of 4 (the warm-up had
        # no target; the rejected one was not admitted).
        _wait_text(page, model_row, "(4 of 4)")
        _wait_text(page, model_row, "0 held")

        # A target below what an idle worker measures: unreachable, with its idle TTFT.
        assert st.post({"model": "m", TTFT_TARGET: 1})[0] == 200
        _wait_text(page, worker_row, "target unreachable (idle worker: ")
        assert st.ext.workers()["sim"]["deadline"]["idle_ttft_ms"] > 1
        assert page.locator(f"{model_row} .badge.s-busy").inner_text() == "target unreachable"
        assert "target unreachable (1 ms) on sim" in page.locator("#warnings").inner_text()

        # A worker that reports no slots and no waiting count: the page names what it goes
        # without and that it is predicted from the gateway's timings alone.
        pub = Publisher(st.ext.event_endpoint)
        try:
            pub.announce(st.ext, "gw", "m", f"127.0.0.1:{free_port()}")  # sent nothing
            pub.load("gw", active_decode_blocks=0)
            gw_row = 'tr.worker[data-worker-id="gw"]'
            _wait_text(page, gw_row, "predicted from the gateway's timings alone")
            gw = page.locator(f"{gw_row} td.dl .missing").inner_text()
            for name in ("num_requests_waiting", "request_active_slots", "request_total_slots"):
                assert name in gw, gw
            assert "completions not measured" in page.locator(f"{gw_row} td.dl").inner_text()
        finally:
            pub.close()
        assert shot.stat().st_size > 10_000
        if os.environ.get("UPDATE_SCREENSHOT") == "1":
            shutil.copy(shot, ROOT / "docs" / "status-page-deadline.png")
        assert not errors, errors
        assert {u.split("?")[0] for u in requested} <= {
            st.ext.admin + "/status",
            st.ext.admin + "/status.json",
        }, requested
        page.close()
