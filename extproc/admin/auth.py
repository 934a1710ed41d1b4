"""Bearer-token guard for the admin API's writes (``POST /busy_threshold``).

Reads (GET, HEAD, OPTIONS) are always open. Every other method needs
``Authorization: Bearer <--admin-token>`` when a token is configured, and also when
the admin listener is not on loopback: without a token such a listener refuses
every write (401), since anyone who can reach it could otherwise change thresholds.
On loopback with no token, writes are open. The check runs before routing answers
405, so an unauthenticated PUT on a guarded listener is 401, not 405.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from extproc.core.loopback import is_loopback_host

__all__ = ["AdminAuth", "AuthFailure", "auth_middleware", "is_loopback_host"]

OPEN_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
CHALLENGE = {"WWW-Authenticate": "Bearer"}


class AuthFailure(Exception):
    """A write refused by the guard: 401 (no usable credentials) or 403 (wrong token)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class AdminAuth:
    """Who may write: anyone (``required`` false) or holders of ``token``."""

    token: str | None = None
    required: bool = False

    @classmethod
    def from_settings(cls, admin_host: str, admin_token: str | None) -> AdminAuth:
        token = admin_token or None
        return cls(token, token is not None or not is_loopback_host(admin_host))

    def check(self, method: str, authorization: str | None) -> None:
        """Return if the request may proceed; raise AuthFailure otherwise."""
        if not self.required or method.upper() in OPEN_METHODS:
            return
        if self.token is None:
            raise AuthFailure(
                401,
                "writes are refused: the admin API is not on loopback and no --admin-token "
                "(EXTPROC_ADMIN_TOKEN) is configured",
            )
        scheme, _, credentials = (authorization or "").strip().partition(" ")
        credentials = credentials.strip()
        if scheme.lower() != "bearer" or not credentials:
            raise AuthFailure(401, "Authorization header must be 'Bearer <admin token>'")
        given = credentials.encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, self.token.encode("utf-8", "surrogateescape")):
            raise AuthFailure(403, "wrong admin token in the Authorization header")


def auth_middleware(auth: AdminAuth) -> Middleware:
    """An aiohttp middleware that applies ``auth`` to every request."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            auth.check(request.method, request.headers.get("Authorization"))
        except AuthFailure as exc:
            headers = CHALLENGE if exc.status == 401 else None
            return web.json_response({"error": exc.message}, status=exc.status, headers=headers)
        return await handler(request)

    return guard
