"""The Endpoint Picker protocol through the real Envoy, wired as a Kubernetes gateway wires an
InferencePool (envoy/envoy-epp.yaml: buffered ext_proc, ORIGINAL_DST cluster keyed on
x-gateway-destination-endpoint), with a Lua filter standing in for the gateway that writes
the endpoint subset hint (tests/support/envoy_wirings.py). Every case runs with buffered
bodies and with full-duplex streamed ones.

Echo workers a and b serve model ``m`` on 127.0.0.1 and report load; echo worker c never
announces itself (an endpoint known only from the gateway). Worker ``x`` serves ``m2`` and
announces a port nobody listens on, while the gateway names c's port on the same host.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc.devstack import (
    Envoy,
    Extproc,
    Publisher,
    checkout_file,
    free_port,
    http,
    metric_value,
    wait_until,
)
from extproc.handlers.processor import SERVED_HEADER
from extproc.handlers.replies import LB_NAMESPACE
from tests.support.envoy_wirings import (
    MAIN_FILTER,
    full_duplex,
    gateway_subset_hint,
    http_filters,
    override_host_pool,
)

CHAT = "/v1/chat/completions"
KV = 10  # blocks per worker; above 5 in use is busy (threshold 0.5)


class Gateway:
    def __init__(self, log_dir: Path, workers: dict[str, int], body_mode: str) -> None:
        self.workers = workers
        self.body_mode = body_mode
        self.ext = Extproc(
            log_dir,
            ["--protocol", "epp", "--worker-ttl", "300", "--active-decode-blocks-threshold", "0.5"],
        )
        self.access_log = log_dir / f"epp-access-{self.ext.grpc_port}.log"
        hint = gateway_subset_hint(str(self.access_log))

        def tweak(cfg: dict[str, Any]) -> None:
            hint(cfg)
            if body_mode == "duplex":
                full_duplex(cfg)

        self.envoy = Envoy(
            log_dir, self.ext, [], tweak=tweak, source=checkout_file("envoy/envoy-epp.yaml")
        )
        self.pub = Publisher(self.ext.event_endpoint)
        for name in ("a", "b"):
            self.pub.announce(self.ext, name, "m", self.endpoint(name), kv_total_blocks=KV)
        self.x_endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
        self.pub.announce(self.ext, "x", "m2", self.x_endpoint, kv_total_blocks=KV)

    def endpoint(self, name: str) -> str:
        return f"127.0.0.1:{self.workers[name]}"

    def load(self, **blocks: int) -> None:
        """Report these KV blocks in use and wait until the extproc shows them."""
        for wid, n in blocks.items():
            self.pub.load(wid, active_decode_blocks=n)

        def shown() -> bool:
            view = self.ext.workers()
            return all(
                view[wid]["state"] == ("busy" if n > KV // 2 else "free")
                and view[wid]["ranks"][0]["reported"]["active_decode_blocks"] == n
                for wid, n in blocks.items()
            )

        wait_until(shown, 10, f"loads {blocks} applied")

    def chat(
        self, subset: str | None = None, kind: str = "list", model: str = "m"
    ) -> tuple[int, dict[str, str], dict[str, Any]]:
        headers = {}
        if subset is not None:
            headers = {"x-test-subset": subset, "x-test-subset-kind": kind}
        body = {"model": model, "messages": [{"role": "user", "content": "hello"}]}
        status, hdrs, raw = http("POST", self.envoy.url + CHAT, body, headers)
        return status, hdrs, json.loads(raw) if raw else {}

    def close(self) -> None:
        self.pub.close()
        self.envoy.stop()
        self.ext.stop()


@pytest.fixture(scope="module", params=["buffered", "duplex"])
def gw(
    request: pytest.FixtureRequest, log_dir: Path, echo_workers: dict[str, int]
) -> Iterator[Gateway]:
    """The gateway with BUFFERED bodies (envoy-epp.yaml as it is) or FULL_DUPLEX_STREAMED
    ones (Istio's wiring, the default of Envoy AI Gateway)."""
    gateway = Gateway(log_dir, echo_workers, request.param)
    yield gateway
    gateway.close()


def _access_line(gw: Gateway, test_id: str) -> list[str]:
    """The access-log fields of the request sent with ``x-test-id: test_id``, once Envoy has
    written them (it flushes the file about once a second)."""

    def written() -> list[str] | None:
        if not gw.access_log.exists():
            return None
        for line in gw.access_log.read_text().splitlines():
            fields = line.split(" ")
            if fields[0] == test_id:
                return fields[1:]
        return None

    result: list[str] = wait_until(written, 10, f"the access-log line of {test_id}")
    return result


def test_routed_in_header_and_metadata_alike(gw: Gateway) -> None:
    gw.load(a=1, b=1)
    test_id = f"routed-{gw.body_mode}"
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    status, _, raw = http("POST", gw.envoy.url + CHAT, body, {"x-test-id": test_id})
    assert status == 200, raw
    seen = json.loads(raw)
    # The header the worker received and the metadata Envoy logged carry the same value:
    # the pick alone (ORIGINAL_DST reads one address; --epp-fallbacks is 0 by default).
    code, meta, upstream = _access_line(gw, test_id)
    assert code == "200"
    assert meta == seen["destination"] == upstream == gw.endpoint(seen["worker_id"])


@pytest.mark.parametrize("kind", ["list", "string"])
def test_the_subset_is_honoured_though_the_other_worker_is_less_loaded(
    gw: Gateway, kind: str
) -> None:
    """Envoy forwards the hint (metadata_options.forwarding_namespaces): without it the
    less-loaded b would win every time."""
    gw.load(a=4, b=0)
    for _ in range(10):
        status, _, body = gw.chat(gw.endpoint("a"), kind)
        assert status == 200, body
        assert body["worker_id"] == "a"
        assert body["destination"] == gw.endpoint("a")
    status, _, body = gw.chat()
    assert (status, body["worker_id"]) == (200, "b")


def test_every_subset_endpoint_busy_is_529_while_another_worker_is_free(gw: Gateway) -> None:
    gw.load(a=9, b=0)
    status, hdrs, body = gw.chat(gw.endpoint("a"))
    assert status == 529
    assert body == {"message": "Service temporarily overloaded", "type": "Overloaded", "code": 529}
    assert 1 <= int(hdrs["retry-after"]) <= 60
    assert hdrs["x-shed-reason"] == "active_decode_blocks_threshold"
    status, _, body = gw.chat(f"{gw.endpoint('a')},{gw.endpoint('b')}", "string")
    assert (status, body["worker_id"]) == (200, "b")


def test_an_unknown_endpoint_in_the_subset_is_routed_with_no_load_data(gw: Gateway) -> None:
    """c never sent an event; a and b are busy. (a and b share c's host, so c's address
    is not matched to either of them.)"""
    gw.load(a=9, b=9)
    assert gw.chat()[0] == 529
    subset = ",".join(gw.endpoint(n) for n in ("a", "b", "c"))
    for _ in range(5):
        status, _, body = gw.chat(subset)
        assert status == 200, body
        assert body["worker_id"] == "c"
        assert body["destination"] == gw.endpoint("c")
    assert "gateway:" + gw.endpoint("c") not in gw.ext.workers()


def test_a_worker_announcing_another_port_of_the_pod_stands_behind_it(gw: Gateway) -> None:
    """x announces 127.0.0.1:<nothing>; the gateway's subset names c's port on that host:
    the request goes to the gateway's address, and x's load decides."""
    gw.load(x=0)
    status, _, body = gw.chat(gw.endpoint("c"), model="m2")
    assert (status, body["worker_id"], body["destination"]) == (200, "c", gw.endpoint("c"))
    gw.load(x=9)
    status, hdrs, body = gw.chat(gw.endpoint("c"), model="m2")
    assert status == 529, body
    assert hdrs["x-shed-reason"] == "active_decode_blocks_threshold"
    gw.load(x=0)


MALFORMED = [("7", "number"), ("not-an-address,10.0.0.1:80", "list"), ("10.0.0.1", "string")]


@pytest.mark.parametrize(("subset", "kind"), MALFORMED)
def test_a_malformed_hint_is_treated_as_absent(gw: Gateway, subset: str, kind: str) -> None:
    gw.load(a=9, b=0)
    status, _, body = gw.chat(subset, kind)
    # As without a subset: the free worker of the model, never a crash or a 5xx.
    assert (status, body["worker_id"]) == (200, "b")
    assert gw.ext.proc.alive()


def test_malformed_hints_are_logged_once_not_per_request(gw: Gateway) -> None:
    """One line names the value and what was expected; the next ones within the minute are
    counted, not logged (the unit tests check the line of each shape)."""
    gw.load(a=0, b=0)
    before = metric_value(gw.ext.metrics(), "extproc_subset_hint_malformed_total") or 0
    for subset, kind in [*MALFORMED, ("garbage", "string")] * 5:
        assert gw.chat(subset, kind)[0] == 200
    assert metric_value(gw.ext.metrics(), "extproc_subset_hint_malformed_total") == before + 20
    lines = [ln for ln in gw.ext.proc.log().splitlines() if "ignoring the endpoint subset" in ln]
    assert len(lines) == 1, lines
    assert "WARNING" in lines[0]
    assert re.search(r"x-gateway-destination-endpoint-subset = (42\.0|\[.*\]|'.*'): ", lines[0])
    assert 'expected a list of "ip:port" strings' in lines[0]


def test_an_empty_subset_is_503(gw: Gateway) -> None:
    gw.load(a=0, b=0)
    status, _, body = gw.chat("", "string")
    assert status == 503
    assert body == {"message": "Service temporarily unavailable", "type": "Service Unavailable",
                    "code": 503}  # fmt: skip


def test_a_client_cannot_choose_the_pod(gw: Gateway) -> None:
    gw.load(a=9, b=0)
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    status, _, raw = http(
        "POST",
        gw.envoy.url + CHAT,
        body,
        {"x-gateway-destination-endpoint": gw.endpoint("a")},
    )
    assert status == 200
    assert json.loads(raw)["worker_id"] == "b"


@pytest.mark.parametrize(
    "service", ["liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"]
)
def test_the_health_services_the_protocol_names_serve(gw: Gateway, service: str) -> None:
    import grpc
    from grpc_health.v1 import health_pb2

    with grpc.insecure_channel(f"127.0.0.1:{gw.ext.grpc_port}") as channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        reply = check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_streamed_response_and_a_large_body_come_through_whole(gw: Gateway) -> None:
    """In full duplex every body chunk goes through the extproc and back."""
    gw.load(a=0, b=0)
    content = "x" * 300_000
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": content}]}
    status, hdrs, raw = http("POST", gw.envoy.url + CHAT, body, {"x-test-chunks": "5"})
    assert status == 200
    assert hdrs["content-type"].startswith("text/event-stream")
    events = [ln for ln in raw.decode().splitlines() if ln.startswith("data: ")]
    assert [json.loads(e[6:])["i"] for e in events[:-1]] == [0, 1, 2, 3, 4]
    assert events[-1] == "data: [DONE]"
    status, _, raw = http(
        "POST",
        gw.envoy.url + CHAT,
        {"model": "m", "messages": [{"role": "user", "content": content}]},
    )
    assert status == 200
    assert json.loads(raw)["body_len"] == len(
        json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})
    )


def test_the_estimate_returns_to_zero_after_every_request(gw: Gateway) -> None:
    gw.load(a=0, b=0)
    for _ in range(5):
        assert gw.chat()[0] == 200
        assert gw.chat(gw.endpoint("c"))[0] == 200

    def idle() -> bool:
        view = gw.ext.workers()
        return all(
            view[w]["ranks"][0]["router_estimate"]["requests_in_flight"] == 0 for w in ("a", "b")
        )

    wait_until(idle, 10, "no request in flight")


def test_envoy_runs_the_body_mode_the_case_says(gw: Gateway) -> None:
    dump = http("GET", f"http://127.0.0.1:{gw.envoy.admin_port}/config_dump")[2].decode()
    want = "FULL_DUPLEX_STREAMED" if gw.body_mode == "duplex" else "BUFFERED"
    assert f'"request_body_mode": "{want}"' in dump
    assert f'"response_body_mode": "{want}"' in dump


@pytest.fixture(scope="module")
def listing(log_dir: Path, echo_workers: dict[str, int]) -> Iterator[tuple[Extproc, Envoy]]:
    """--epp-fallbacks 2 before a data plane that takes the list (override_host)."""
    ext = Extproc(
        log_dir,
        ["--protocol", "epp", "--epp-fallbacks", "2", "--active-decode-blocks-threshold", "0.5"],
    )
    envoy = Envoy(
        log_dir,
        ext,
        [],
        tweak=override_host_pool([echo_workers["a"], echo_workers["b"]]),
        source=checkout_file("envoy/envoy-epp.yaml"),
    )
    yield ext, envoy
    envoy.stop()
    ext.stop()


def test_with_fallbacks_a_refusing_pick_is_retried_on_the_next_listed(
    listing: tuple[Extproc, Envoy], echo_workers: dict[str, int]
) -> None:
    ext, envoy = listing
    pub = Publisher(ext.event_endpoint)
    try:
        a, b = (f"127.0.0.1:{echo_workers[n]}" for n in ("a", "b"))
        pub.announce(ext, "a", "m", a, kv_total_blocks=KV)
        pub.announce(ext, "b", "m", b, kv_total_blocks=KV)
        pub.load("a", active_decode_blocks=0)
        pub.load("b", active_decode_blocks=1)
        wait_until(
            lambda: ext.workers()["b"]["ranks"][0]["reported"]["active_decode_blocks"] == 1,
            10,
            "b's load applied",
        )
        body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
        status, _, raw = http(
            "POST", envoy.url + CHAT, body, {"x-test-status": "529", "x-test-status-for": "a"}
        )
        assert status == 200, raw
        seen = json.loads(raw)
        # a was picked (least loaded), refused; Envoy went down the list to b. The header
        # carries the same list as the metadata.
        assert seen["worker_id"] == "b"
        assert seen["destination"] == f"{a},{b}"
    finally:
        pub.close()


# ----- the served host, named in the response's metadata ----------------------------------

# The test's stand-in for a gateway that names the host that served a response in the
# response's metadata (envoy.lb / x-gateway-destination-endpoint-served): the route adds the
# upstream host as a response header, and a Lua filter after ext_proc (so it sees the response
# first) moves it into the metadata, which the ext_proc filter forwards.
SERVED_TEST_HEADER = "x-test-served"
SERVED_LUA = f"""
function envoy_on_response(handle)
  local served = handle:headers():get("{SERVED_TEST_HEADER}")
  if served == nil then return end
  handle:headers():remove("{SERVED_TEST_HEADER}")
  handle:streamInfo():dynamicMetadata():set("{LB_NAMESPACE}", "{SERVED_HEADER}", served)
end
"""


def served_metadata(cfg: dict[str, Any]) -> None:
    """envoy/envoy-epp.yaml whose responses carry the served host in envoy.lb metadata."""
    filters = http_filters(cfg)
    main = next(f for f in filters if f["name"] == MAIN_FILTER)
    forwarding = main["typed_config"]["metadata_options"]["forwarding_namespaces"]
    forwarding["untyped"] = [*forwarding["untyped"], LB_NAMESPACE]
    filters.insert(
        filters.index(main) + 1,
        {
            "name": "envoy.filters.http.lua",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                "default_source_code": {"inline_string": SERVED_LUA},
            },
        },
    )
    listener = cfg["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]
    route["response_headers_to_add"] = [
        {"header": {"key": SERVED_TEST_HEADER, "value": "%UPSTREAM_HOST%"}}
    ]


@pytest.fixture(scope="module")
def served(log_dir: Path, echo_workers: dict[str, int]) -> Iterator[tuple[Extproc, Envoy]]:
    """--epp-fallbacks 2, a data plane that takes the list (override_host over echo workers
    a and b), and the served host in the response's metadata."""
    ext = Extproc(
        log_dir,
        ["--protocol", "epp", "--epp-fallbacks", "2", "--active-decode-blocks-threshold", "0.5",
         "--worker-ttl", "300"],
    )  # fmt: skip
    pool = override_host_pool([echo_workers["a"], echo_workers["b"]])

    def tweak(cfg: dict[str, Any]) -> None:
        pool(cfg)
        served_metadata(cfg)

    envoy = Envoy(log_dir, ext, [], tweak=tweak, source=checkout_file("envoy/envoy-epp.yaml"))
    yield ext, envoy
    envoy.stop()
    ext.stop()


def _served_elsewhere(ext: Extproc, model: str, served: str) -> float:
    labels = {"model": model, "served": served}
    return metric_value(ext.metrics(), "extproc_served_elsewhere_total", labels) or 0.0


def test_the_estimate_follows_the_host_served_named_in_the_metadata(
    served: tuple[Extproc, Envoy], echo_workers: dict[str, int]
) -> None:
    """a is picked, refuses with a 529, and Envoy retries on b: the response's metadata names
    b, so the estimate moves to b and a is skipped as a refusing worker."""
    ext, envoy = served
    pub = Publisher(ext.event_endpoint)
    try:
        a, b = (f"127.0.0.1:{echo_workers[n]}" for n in ("a", "b"))
        pub.announce(ext, "sa", "served", a, kv_total_blocks=KV)
        pub.announce(ext, "sb", "served", b, kv_total_blocks=KV)
        pub.load("sa", active_decode_blocks=0)
        pub.load("sb", active_decode_blocks=1)
        wait_until(
            lambda: ext.workers()["sb"]["ranks"][0]["reported"]["active_decode_blocks"] == 1,
            10,
            "sb's load applied",
        )
        body = {"model": "served", "messages": [{"role": "user", "content": "hello"}]}
        status, headers, raw = http(
            "POST", envoy.url + CHAT, body, {"x-test-status": "529", "x-test-status-for": "a"}
        )
        assert status == 200, raw
        assert json.loads(raw)["worker_id"] == "b"
        assert SERVED_TEST_HEADER not in {k.lower() for k in headers}
        assert _served_elsewhere(ext, "served", "worker") == 1
        assert _served_elsewhere(ext, "served", "unknown") == 0
        assert ext.workers()["sa"]["state"] == "overloaded"
        wait_until(
            lambda: all(
                ext.workers()[w]["ranks"][0]["router_estimate"]["requests_in_flight"] == 0
                for w in ("sa", "sb")
            ),
            10,
            "estimates back to 0",
        )
    finally:
        pub.close()


def test_a_worker_announced_by_host_name_matches_the_served_address(
    served: tuple[Extproc, Envoy], log_dir: Path, echo_workers: dict[str, int]
) -> None:
    """Worker ha announces ``localhost:<a's port>``; Envoy names the host that served by its
    IP. override_host cannot use a name, so a data plane whose pool is a alone serves there:
    every response is ha's own, so nothing moves and ha is never skipped."""
    ext, _ = served
    pool = override_host_pool([echo_workers["a"]])

    def tweak(cfg: dict[str, Any]) -> None:
        pool(cfg)
        served_metadata(cfg)

    envoy = Envoy(log_dir, ext, [], tweak=tweak, source=checkout_file("envoy/envoy-epp.yaml"))
    pub = Publisher(ext.event_endpoint)
    try:
        pub.announce(ext, "ha", "named", f"localhost:{echo_workers['a']}", kv_total_blocks=KV)
        a = f"127.0.0.1:{echo_workers['a']}"
        wait_until(lambda: a in ext.workers()["ha"]["addresses"], 10, "localhost resolved")
        body = {"model": "named", "messages": [{"role": "user", "content": "hello"}]}
        for _ in range(3):
            status, _, raw = http("POST", envoy.url + CHAT, body)
            assert status == 200, raw
            assert json.loads(raw)["worker_id"] == "a"
            assert ext.workers()["ha"]["state"] == "free"
        assert _served_elsewhere(ext, "named", "unknown") == 0
        assert _served_elsewhere(ext, "named", "worker") == 0
    finally:
        pub.close()
        envoy.stop()
