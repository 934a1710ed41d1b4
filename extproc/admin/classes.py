"""``/classes``: the request classes in force, and changing one at runtime (docs/classes.md).

``GET /classes`` lists them. ``POST /classes`` with ``{"name": C, <settings to change>}``
changes class C: any of ``priority``, ``share`` (a number or a mapping per threshold),
``status`` (429, 503, 529 or null for the overload status), ``retry_after`` (1-60 or
null for the estimate), ``large_prompt`` (``{"above_tokens": N, "share": S}`` or null).
The same validation as the classes file and the same auth as ``/busy_threshold``: 415 for
a non-JSON content type, 400 for bad JSON, 422 for a bad value (naming the key and the
value), 404 for a class that is not configured. The answer is the class's full entry.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from extproc.admin.routes import BodyUnreadable, add_read_write, json_error, read_body
from extproc.admin.thresholds import ThresholdUpdateError, decode_body
from extproc.core.classes import ClassConfigError, ClassRegistry

PATH = "/classes"
HIDDEN = "(set, not shown)"


def table_view(registry: ClassRegistry) -> dict[str, Any]:
    table = registry.table
    marker = table.trusted_marker
    return {
        "header": table.header,
        "default": table.default,
        # The marker's value is a secret shared with Envoy: said to be set, never shown.
        "trusted_marker": None
        if marker is None
        else {"header": marker[0], "value": None if marker[1] is None else HIDDEN},
        "classes": [c.as_dict() for c in table.classes],
    }


def add_routes(app: web.Application, registry: ClassRegistry) -> None:
    """Register GET/HEAD/POST ``/classes``; other methods get 405 with ``Allow``."""

    async def get(_: web.Request) -> web.Response:
        return web.json_response(table_view(registry))

    async def post(request: web.Request) -> web.Response:
        try:
            body = decode_body(request.headers.get("Content-Type"), await read_body(request))
        except BodyUnreadable as exc:
            return exc.response
        except ThresholdUpdateError as exc:
            return json_error(exc.status, exc.message)
        if not isinstance(body, dict):
            return json_error(422, f"request body must be a JSON object, got {type(body).__name__}")
        name = body.get("name")
        if not isinstance(name, str):
            return json_error(422, f"name: {name!r} is not a class name (a string)")
        changes = {k: v for k, v in body.items() if k != "name"}
        try:
            updated = registry.update_class(name, changes)
        except KeyError:
            names = ", ".join(c.name for c in registry.table.classes)
            return json_error(404, f"class {name!r} is not configured; classes: {names}")
        except ClassConfigError as exc:
            return json_error(422, str(exc))
        return web.json_response(updated.as_dict())

    add_read_write(app, PATH, get, post)
