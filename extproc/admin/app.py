"""The admin HTTP server (aiohttp). Reads the same pool the request path reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from extproc.admin.auth import AdminAuth, auth_middleware
from extproc.admin.classes import add_routes as add_class_routes
from extproc.admin.diagnostics import workers_view
from extproc.admin.series import StatusCollector
from extproc.admin.status import add_routes as add_status_routes
from extproc.admin.thresholds import add_routes as add_threshold_routes
from extproc.core.classes import ClassRegistry
from extproc.core.latency import DeadlineAdmission
from extproc.core.pool import WorkerPool
from extproc.metrics.registry import Metrics


@dataclass
class Readiness:
    """Set by the service as its parts come up."""

    grpc_serving: bool = False
    events_bound: bool = False
    missing: list[str] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.grpc_serving and self.events_bound


def build_app(
    pool: WorkerPool,
    metrics: Metrics,
    readiness: Readiness,
    auth: AdminAuth | None = None,
    classes: ClassRegistry | None = None,
    latency: DeadlineAdmission | None = None,
) -> web.Application:
    app = web.Application(middlewares=[auth_middleware(auth or AdminAuth())])

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "healthy", "workers": pool.counts()})

    async def ready(_: web.Request) -> web.Response:
        if readiness.ready:
            return web.json_response({"status": "ready"})
        waiting = [
            name
            for name, ok in (("grpc", readiness.grpc_serving), ("events", readiness.events_bound))
            if not ok
        ]
        return web.json_response({"status": "not ready", "waiting_for": waiting}, status=503)

    async def metrics_view(_: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def debug_workers(_: web.Request) -> web.Response:
        names = classes.table.variant_names() if classes is not None else None
        return web.json_response(workers_view(pool, names, metrics, latency))

    app.router.add_get("/debug/workers", debug_workers)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics_view)
    add_threshold_routes(app, pool)
    if classes is not None:
        add_class_routes(app, classes)
    add_status_routes(app, pool, metrics, latency)
    metrics.registry.register(StatusCollector(pool))
    return app
