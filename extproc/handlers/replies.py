"""Serialized ext_proc replies: built once, sent as bytes.

Replies that do not depend on the request are module constants; :class:`Replies` holds
those that depend on startup settings (the overload status, one per Retry-After value)
or on a little state (one routing reply per worker endpoint and fallbacks, the model
list), each serialized once and reused.
"""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2

from extproc.core.classes import RequestClass
from extproc.core.scheduling import Outcome, Rejected
from extproc.openai.errors import error_body

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
MAX_RETRIES_HEADER = "x-envoy-max-retries"
# Statuses Envoy retries besides the route's own (retry_on: retriable-status-codes): the
# worker statuses that mean "busy". Envoy drops a client's copy of the header (external
# requests) and never forwards it upstream; the extproc sets or removes it on every route.
RETRIABLE_STATUSES_HEADER = "x-envoy-retriable-status-codes"
# Routing replies kept (one per endpoint and fallback list); cleared when exceeded.
ROUTE_CACHE = 4096
MAX_RETRY_AFTER = 60
# Every overload reply says why: the check that fired and the request's class.
SHED_REASON_HEADER = "x-shed-reason"
SHED_CLASS_HEADER = "x-shed-class"
# Deadline admission's rejection: its reason, and the predicted wait in milliseconds (the
# OpenAI SDKs read it before Retry-After).
DEADLINE_REASON = "deadline"
RETRY_AFTER_MS_HEADER = "retry-after-ms"
# The OpenAI SDKs' override of their retry rule: "false", no retry at all.
SHOULD_RETRY_HEADER = "x-should-retry"
# Deadline replies kept (one per status, wait in ms and class); cleared when exceeded.
DEADLINE_CACHE = 4096
DEFAULT_CLASS = "default"
_PM = processing_mode_pb2.ProcessingMode


def _serialize(msg: ep.ProcessingResponse) -> bytes:
    return msg.SerializeToString()


def _header(key: str, value: str | bytes) -> base_pb2.HeaderValue:
    raw = value if isinstance(value, bytes) else value.encode()
    return base_pb2.HeaderValue(key=key, raw_value=raw)


def immediate(
    status: int, body: bytes, headers: dict[str, str] | None = None, details: str = ""
) -> bytes:
    """A serialized local reply: status, JSON body, content-type and extra headers."""
    mutation = base_pb2.HeaderValueOption
    set_headers = [mutation(header=_header("content-type", "application/json"))]
    for k, v in (headers or {}).items():
        set_headers.append(mutation(header=_header(k, v)))
    return _serialize(
        ep.ProcessingResponse(
            immediate_response=ep.ImmediateResponse(
                status=http_status_pb2.HttpStatus(code=status),
                headers=ep.HeaderMutation(set_headers=set_headers),
                body=body,
                details=details,
            )
        )
    )


def routing_reply(
    endpoint: str,
    fallbacks: tuple[str, ...] = (),
    phase: str = "request_body",
    busy_statuses: tuple[int, ...] = (),
) -> bytes:
    """Continue upstream to ``endpoint``: envoy.lb metadata and the destination header.

    ``fallbacks`` follow the pick in the metadata (``a,b,c``): Envoy's override_host
    policy tries them in order when the route retries a worker-side rejection.
    ``x-envoy-max-retries`` caps the retries at the hosts listed, so a retry never
    falls through to the cluster's fallback policy (a worker of another model).
    ``busy_statuses`` go in ``x-envoy-retriable-status-codes``, so Envoy retries them as
    it retries a 529; with none the header is removed. ``phase`` is the message
    answered: ``request_body``, or ``request_headers`` when the decision was made on the
    headers (the model forwarded as metadata).
    """
    overwrite = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    meta = struct_pb2.Struct()
    meta.update({LB_NAMESPACE: {DESTINATION_HEADER: ",".join((endpoint, *fallbacks))}})
    set_headers = [
        base_pb2.HeaderValueOption(
            header=_header(DESTINATION_HEADER, endpoint), append_action=overwrite
        ),
        base_pb2.HeaderValueOption(
            header=_header(MAX_RETRIES_HEADER, str(len(fallbacks))), append_action=overwrite
        ),
    ]
    remove_headers: list[str] = []
    if busy_statuses:
        statuses = ",".join(map(str, busy_statuses))
        set_headers.append(
            base_pb2.HeaderValueOption(
                header=_header(RETRIABLE_STATUSES_HEADER, statuses), append_action=overwrite
            )
        )
    else:
        remove_headers.append(RETRIABLE_STATUSES_HEADER)
    common = ep.CommonResponse(
        header_mutation=ep.HeaderMutation(set_headers=set_headers, remove_headers=remove_headers)
    )
    if phase == "request_headers":
        return _serialize(
            ep.ProcessingResponse(
                request_headers=ep.HeadersResponse(response=common), dynamic_metadata=meta
            )
        )
    return _serialize(
        ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=meta)
    )


def epp_routing_reply(
    endpoint: str, fallbacks: tuple[str, ...] = (), phase: str = "request_body"
) -> bytes:
    """Continue upstream to ``endpoint`` as the Endpoint Picker protocol says: the same
    value, the pick then ``fallbacks`` comma-separated, in the request header and in the
    envoy.lb dynamic metadata (the protocol forbids them to differ), with the route cache
    cleared as the reference picker does, for routes that match on the header. Retries
    are the gateway's: no ``x-envoy-*`` header is set."""
    value = ",".join((endpoint, *fallbacks))
    meta = struct_pb2.Struct()
    meta.update({LB_NAMESPACE: {DESTINATION_HEADER: value}})
    overwrite = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    common = ep.CommonResponse(
        header_mutation=ep.HeaderMutation(
            set_headers=[
                base_pb2.HeaderValueOption(
                    header=_header(DESTINATION_HEADER, value), append_action=overwrite
                )
            ]
        ),
        clear_route_cache=True,
    )
    if phase == "request_headers":
        return _serialize(
            ep.ProcessingResponse(
                request_headers=ep.HeadersResponse(response=common), dynamic_metadata=meta
            )
        )
    return _serialize(
        ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=meta)
    )


def extend_timeout(seconds: int) -> bytes:
    """Tell Envoy to wait ``seconds`` for the next reply (a request in the router queue)."""
    return _serialize(
        ep.ProcessingResponse(override_message_timeout=duration_pb2.Duration(seconds=seconds))
    )


CONTINUE_REQUEST_HEADERS = _serialize(ep.ProcessingResponse(request_headers=ep.HeadersResponse()))
CONTINUE_REQUEST_BODY = _serialize(ep.ProcessingResponse(request_body=ep.BodyResponse()))
CONTINUE_RESPONSE_HEADERS = _serialize(ep.ProcessingResponse(response_headers=ep.HeadersResponse()))
CONTINUE_RESPONSE_BODY = _serialize(ep.ProcessingResponse(response_body=ep.BodyResponse()))
# The reply that lets each kind of message through unchanged, by the request's oneof name.
CONTINUES = {
    "request_headers": CONTINUE_REQUEST_HEADERS,
    "request_body": CONTINUE_REQUEST_BODY,
    "response_headers": CONTINUE_RESPONSE_HEADERS,
    "response_body": CONTINUE_RESPONSE_BODY,
    "request_trailers": _serialize(ep.ProcessingResponse(request_trailers=ep.TrailersResponse())),
    "response_trailers": _serialize(ep.ProcessingResponse(response_trailers=ep.TrailersResponse())),
}


def _send_body(response_body_mode: int) -> bytes:
    """Continue, and send the body: the headers did not carry what the decision needs.

    The processing mode of a request decided on its body (the exact mode): whatever the
    filter's configured request body mode, Envoy buffers the body and sends it.
    """
    return _serialize(
        ep.ProcessingResponse(
            request_headers=ep.HeadersResponse(),
            mode_override=_PM(
                request_header_mode=_PM.SEND,
                request_body_mode=_PM.BUFFERED,
                response_header_mode=_PM.SEND,
                response_body_mode=response_body_mode,
                request_trailer_mode=_PM.SKIP,
                response_trailer_mode=_PM.SKIP,
            ),
        )
    )


def _hold(response_body_mode: int) -> bytes:
    """Continue the response headers of a routed response that is not over, decided
    without the body. Envoy would close the stream after the last message it expects
    (the response headers), so it is asked for the response trailers too; the stream,
    and the request's estimate, last until the response ends, fails, or the client goes
    away."""
    return _serialize(
        ep.ProcessingResponse(
            response_headers=ep.HeadersResponse(),
            mode_override=_PM(
                request_header_mode=_PM.SEND,
                request_body_mode=_PM.NONE,
                response_header_mode=_PM.SEND,
                response_body_mode=response_body_mode,
                request_trailer_mode=_PM.SKIP,
                response_trailer_mode=_PM.SEND,
            ),
        )
    )


# A mode override replaces the filter's whole processing mode, so each override that
# continues a routed request comes in two forms: for a filter whose response body mode
# is NONE (or any mode but STREAMED), and for one that streams the response body
# (announced in the stream's ``protocol_config``), where the override keeps it streamed:
# generated tokens are counted from it.
SEND_BODY = _send_body(_PM.NONE)
SEND_BODY_STREAMED = _send_body(_PM.STREAMED)
CONTINUE_RESPONSE_HEADERS_HOLD = _hold(_PM.NONE)
CONTINUE_RESPONSE_HEADERS_HOLD_STREAMED = _hold(_PM.STREAMED)
# Pass-through paths: drop a client-supplied destination header, stop processing.
PASSTHROUGH = _serialize(
    ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(
            response=ep.CommonResponse(
                header_mutation=ep.HeaderMutation(remove_headers=[DESTINATION_HEADER])
            )
        ),
        mode_override=_PM(
            request_body_mode=_PM.NONE,
            response_header_mode=_PM.SKIP,
            response_body_mode=_PM.NONE,
            request_trailer_mode=_PM.SKIP,
            response_trailer_mode=_PM.SKIP,
        ),
    )
)
# The same for a filter in FULL_DUPLEX_STREAMED mode, which takes no mode override: the
# body then comes through the stream and is sent back (streamed_body).
PASSTHROUGH_DUPLEX = _serialize(
    ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(
            response=ep.CommonResponse(
                header_mutation=ep.HeaderMutation(remove_headers=[DESTINATION_HEADER])
            )
        )
    )
)


def streamed_body(kind: str, body: bytes, end_of_stream: bool) -> bytes:
    """Send ``body`` on, unchanged, as a FULL_DUPLEX_STREAMED filter expects it back: the
    reply to a ``request_body`` or ``response_body`` message (``kind``)."""
    common = ep.CommonResponse(
        body_mutation=ep.BodyMutation(
            streamed_response=ep.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
        )
    )
    if kind == "request_body":
        return _serialize(ep.ProcessingResponse(request_body=ep.BodyResponse(response=common)))
    return _serialize(ep.ProcessingResponse(response_body=ep.BodyResponse(response=common)))


NO_WORKERS = immediate(503, error_body("Service temporarily unavailable", 503))
MODEL_NOT_FOUND = immediate(404, error_body("Model not found", 404))
INTERNAL_ERROR = immediate(
    500, error_body("Internal error in the load-shedding processor", 500), details="extproc_error"
)


def bad_request(message: str) -> bytes:
    """400 with the flat error body naming what is wrong with the request."""
    return immediate(400, error_body(message, 400))


class Replies:
    """The replies that depend on settings or state, each serialized once."""

    def __init__(
        self, overload_status: int, busy_statuses: tuple[int, ...] = (), protocol: str = "envoy"
    ) -> None:
        self.overload_status = overload_status
        self.busy_statuses = busy_statuses
        self.protocol = protocol
        self._overloads: dict[tuple[int, int, str, str], bytes] = {}
        self._deadlines: dict[tuple[int, int, int, str, bool], bytes] = {}
        self._extensions: dict[int, bytes] = {}
        self._routes: dict[tuple[str, ...], bytes] = {}
        self._models: tuple[tuple[str, ...], bytes] | None = None

    def overload(
        self, retry_after: int, check: str | None = None, cls: RequestClass | None = None
    ) -> bytes:
        """The overload reply: the class's status (default: the overload status) and its
        Retry-After (default: ``retry_after``), and the headers that say why:
        ``x-shed-reason`` (the check that fired) and ``x-shed-class``. Built once per
        combination (statuses x 60 x checks x classes at most)."""
        status = self.overload_status if cls is None or cls.status is None else cls.status
        retry = retry_after if cls is None or cls.retry_after is None else cls.retry_after
        name = DEFAULT_CLASS if cls is None else cls.name
        key = (status, retry, check or "", name)
        reply = self._overloads.get(key)
        if reply is None:
            headers = {"retry-after": str(retry), SHED_CLASS_HEADER: name}
            if check:
                headers[SHED_REASON_HEADER] = check
            body = error_body("Service temporarily overloaded", status)
            reply = self._overloads[key] = immediate(status, body, headers)
        return reply

    def deadline(
        self,
        retry_after: int,
        retry_after_ms: int,
        cls: RequestClass | None = None,
        final: bool = False,
    ) -> bytes:
        """The overload reply of deadline admission: no worker is predicted to give a
        first token within the target. The class's status as in :meth:`overload`; the
        retry headers come from the predicted wait (``Retry-After`` whole seconds 1-60,
        ``retry-after-ms`` at least 1), whatever the class configures; ``x-shed-reason:
        deadline``. ``final``: no retry can meet its user's target any more, and
        ``x-should-retry: false`` says so to the OpenAI SDKs, which then do not retry."""
        status = self.overload_status if cls is None or cls.status is None else cls.status
        name = DEFAULT_CLASS if cls is None else cls.name
        retry = max(1, min(MAX_RETRY_AFTER, retry_after))
        ms = max(1, retry_after_ms)
        key = (status, retry, ms, name, final)
        reply = self._deadlines.get(key)
        if reply is None:
            if len(self._deadlines) >= DEADLINE_CACHE:
                self._deadlines.clear()
            headers = {
                "retry-after": str(retry),
                RETRY_AFTER_MS_HEADER: str(ms),
                SHED_CLASS_HEADER: name,
                SHED_REASON_HEADER: DEADLINE_REASON,
            }
            if final:
                headers[SHOULD_RETRY_HEADER] = "false"
            body = error_body("Service temporarily overloaded", status)
            reply = self._deadlines[key] = immediate(status, body, headers)
        return reply

    def extension(self, seconds: int) -> bytes:
        """Tell Envoy to wait ``seconds`` for the next reply (a held request)."""
        reply = self._extensions.get(seconds)
        if reply is None:
            reply = self._extensions[seconds] = extend_timeout(seconds)
        return reply

    def rejected(self, decision: Rejected, cls: RequestClass | None = None) -> bytes:
        """The local reply of a rejection decision."""
        if decision.outcome is Outcome.OVERLOADED:
            return self.overload(decision.retry_after, decision.check, cls)
        return NO_WORKERS if decision.outcome is Outcome.NO_WORKERS else MODEL_NOT_FOUND

    def route(
        self, endpoint: str, fallbacks: tuple[str, ...], phase: str = "request_body"
    ) -> bytes:
        """The routing reply to ``endpoint`` with ``fallbacks`` in the protocol spoken
        (``envoy`` or ``epp``), cached per combination."""
        key = (phase, endpoint, *fallbacks)
        reply = self._routes.get(key)
        if reply is None:
            if len(self._routes) >= ROUTE_CACHE:
                self._routes.clear()
            if self.protocol == "epp":
                reply = epp_routing_reply(endpoint, fallbacks, phase)
            else:
                reply = routing_reply(endpoint, fallbacks, phase, self.busy_statuses)
            self._routes[key] = reply
        return reply

    def models(self, models: tuple[str, ...]) -> bytes:
        """``GET /v1/models`` answered from the discovered models."""
        cached = self._models
        if cached is None or cached[0] != models:
            body = json.dumps(
                {
                    "object": "list",
                    "data": [{"id": m, "object": "model", "owned_by": "extproc"} for m in models],
                },
                separators=(",", ":"),
            ).encode()
            cached = self._models = (models, immediate(200, body))
        return cached[1]
