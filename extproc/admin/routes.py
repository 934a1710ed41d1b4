"""What the admin API's JSON resources share: the error body and the GET/HEAD/POST shape."""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler

ALLOW = "GET, HEAD, POST"


def json_error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """``{"error": message}`` with ``status``."""
    return web.json_response({"error": message}, status=status, headers=headers)


def add_read_write(app: web.Application, path: str, get: Handler, post: Handler) -> None:
    """``path`` answers GET and HEAD with ``get``, POST with ``post``, anything else 405
    with an ``Allow`` header."""

    async def not_allowed(request: web.Request) -> web.Response:
        return json_error(
            405,
            f"method {request.method} is not allowed on {path}; allowed: {ALLOW}",
            {"Allow": ALLOW},
        )

    resource = app.router.add_resource(path)
    resource.add_route("GET", get)
    resource.add_route("HEAD", get)  # aiohttp sends the headers only
    resource.add_route("POST", post)
    resource.add_route("*", not_allowed)


class BodyUnreadable(Exception):
    """The request body could not be read; ``response`` is the JSON error to answer."""

    def __init__(self, response: web.Response) -> None:
        super().__init__(response.text)
        self.response = response


async def read_body(request: web.Request) -> bytes:
    """The raw body; BodyUnreadable with a 413 (too large) or 400 (not in the
    Content-Encoding it claims) JSON error."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise BodyUnreadable(json_error(413, f"request body too large: {exc.text}")) from None
    except web.RequestPayloadError as exc:  # e.g. Content-Encoding: gzip, body is not
        reason = str(exc).split("message:", 1)[-1].strip()
        response = json_error(400, f"request body cannot be read: {reason}")
        response.force_close()  # the rest of the body cannot be read either
        raise BodyUnreadable(response) from None
