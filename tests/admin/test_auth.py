"""The admin API's write guard: the pure check, then real services on four kinds of listener."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc.admin.auth import AdminAuth, AuthFailure, is_loopback_host
from extproc.devstack import Extproc, http, wait_until

TOKEN = "secret"
READ = {"model": "m"}


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("localhost", True),
        ("LOCALHOST.", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.0.0.5", False),
        ("128.0.0.1", False),
        ("localhost.example.com", False),
        ("admin.internal", False),
    ],
)
def test_is_loopback_host(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


@pytest.mark.parametrize(
    ("host", "token", "method", "authorization", "status"),
    [
        ("127.0.0.1", None, "POST", None, None),
        ("127.0.0.1", "", "POST", None, None),  # an empty token is no token
        ("127.0.0.1", TOKEN, "POST", None, 401),
        ("127.0.0.1", TOKEN, "POST", f"Bearer {TOKEN}", None),
        ("0.0.0.0", TOKEN, "GET", None, None),
        ("0.0.0.0", TOKEN, "HEAD", None, None),
        ("0.0.0.0", TOKEN, "POST", None, 401),
        ("0.0.0.0", TOKEN, "POST", f"Basic {TOKEN}", 401),
        ("0.0.0.0", TOKEN, "POST", "Bearer", 401),
        ("0.0.0.0", TOKEN, "POST", "Bearer wrong", 403),
        ("0.0.0.0", TOKEN, "POST", f"Bearer {TOKEN}x", 403),
        ("0.0.0.0", TOKEN, "POST", "Bearer sécret", 403),
        ("0.0.0.0", TOKEN, "POST", f"Bearer {TOKEN}", None),
        ("0.0.0.0", TOKEN, "POST", f"bearer  {TOKEN} ", None),
        ("0.0.0.0", TOKEN, "PUT", None, 401),
        ("0.0.0.0", None, "POST", f"Bearer {TOKEN}", 401),
        ("0.0.0.0", None, "GET", None, None),
    ],
)
def test_check(
    host: str, token: str | None, method: str, authorization: str | None, status: int | None
) -> None:
    auth = AdminAuth.from_settings(host, token)
    if status is None:
        auth.check(method, authorization)
        return
    with pytest.raises(AuthFailure) as err:
        auth.check(method, authorization)
    assert err.value.status == status


# ----- real services ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def services(log_dir: Path) -> Iterator[dict[str, Extproc]]:
    """Four extprocs started together; each is reached on 127.0.0.1."""
    flags = {
        "wide": ["--admin-host", "0.0.0.0", "--admin-token", TOKEN],
        "wide-no-token": ["--admin-host", "0.0.0.0"],
        "loopback": [],
        "loopback-token": ["--admin-token", TOKEN],
    }
    started: dict[str, Extproc] = {}
    try:
        for name, args in flags.items():
            own_dir = log_dir / f"auth-{name}"  # each Extproc writes <dir>/extproc.log
            own_dir.mkdir(exist_ok=True)
            started[name] = Extproc(own_dir, args, wait_ready=False)
        for name, ext in started.items():
            wait_until(ext.ready, 15, f"extproc {name} ready")
        yield started
    finally:
        for ext in started.values():
            ext.stop()


def post(ext: Extproc, authorization: str | None = None) -> tuple[int, dict[str, str], Any]:
    headers = {"authorization": authorization} if authorization is not None else {}
    status, hdrs, body = http("POST", ext.admin + "/busy_threshold", READ, headers)
    return status, hdrs, json.loads(body)


def test_wide_listener_needs_the_token_for_post(services: dict[str, Extproc]) -> None:
    ext = services["wide"]
    status, hdrs, body = post(ext)
    assert (status, hdrs.get("www-authenticate")) == (401, "Bearer")
    assert "Bearer" in body["error"]
    status, hdrs, body = post(ext, "Bearer wrong")
    assert status == 403 and "wrong admin token" in body["error"]
    assert "www-authenticate" not in hdrs
    status, _, body = post(ext, f"Bearer {TOKEN}")
    assert status == 200 and body["model"] == "m"


def test_wide_listener_guards_other_writes_before_405(services: dict[str, Extproc]) -> None:
    url = services["wide"].admin + "/busy_threshold"
    assert http("PUT", url, READ)[0] == 401
    assert http("PUT", url, READ, {"authorization": f"Bearer {TOKEN}"})[0] == 405


@pytest.mark.parametrize("path", ["/busy_threshold", "/health", "/metrics", "/debug/workers"])
def test_reads_stay_open_on_a_wide_listener(services: dict[str, Extproc], path: str) -> None:
    for name in ("wide", "wide-no-token"):
        assert http("GET", services[name].admin + path)[0] == 200, (name, path)
        assert http("HEAD", services[name].admin + path)[0] == 200, (name, path)


def test_wide_listener_without_a_token_refuses_every_post(services: dict[str, Extproc]) -> None:
    ext = services["wide-no-token"]
    for authorization in (None, f"Bearer {TOKEN}", "Bearer "):
        status, hdrs, body = post(ext, authorization)
        assert (status, hdrs.get("www-authenticate")) == (401, "Bearer")
        assert "--admin-token" in body["error"]
    assert "without --admin-token" in ext.proc.log()


def test_default_loopback_listener_needs_no_token(services: dict[str, Extproc]) -> None:
    assert post(services["loopback"])[0] == 200
    assert post(services["loopback"], "Bearer anything")[0] == 200


def test_a_token_set_on_loopback_is_required_too(services: dict[str, Extproc]) -> None:
    ext = services["loopback-token"]
    assert post(ext)[0] == 401
    assert post(ext, "Bearer wrong")[0] == 403
    assert post(ext, f"Bearer {TOKEN}")[0] == 200
