"""Wire the parts together and run them on one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
from collections.abc import Callable

from aiohttp import web

from extproc.admin.app import Readiness, build_app
from extproc.admin.auth import AdminAuth
from extproc.admin.state import RuntimeState, StateFileError
from extproc.core.allowlist import WorkerAllowList
from extproc.core.busy import BusyThresholds
from extproc.core.classes import ClassRegistry, ClassTable
from extproc.core.latency import LatencyControl
from extproc.core.peers import PeerEstimates
from extproc.core.pool import WorkerPool
from extproc.core.scheduling import MAX_FALLBACKS, Scheduler
from extproc.events.curve import REFUSED_REASONS, CurveClient, CurveServer, load_key_pair
from extproc.events.replica import ReplicaPublisher
from extproc.events.resolver import EndpointResolver
from extproc.events.subscriber import EventBindError, EventSubscriber
from extproc.handlers.body_budget import MIB, BodyBudget
from extproc.handlers.processor import PROCESS_PATH, SERVICE_NAME, ExtProcHandler
from extproc.handlers.router_queue import RouterQueue
from extproc.metrics.registry import Metrics
from extproc.openai.request import PromptTokenizer
from extproc.settings import Settings, all_startup_warnings, load_class_table
from extproc.transport.grpcio import GrpcioServer
from extproc.transport.h2server import GrpcServer
from extproc.transport.health import StatusOf, health_methods

log = logging.getLogger("extproc")


class StartupError(Exception):
    """A part could not start; the service exits with ``code`` after logging the message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _hold_port(host: str, port: int) -> list[socket.socket]:
    """Bind every address of ``host:port`` without listening: connections are refused, and
    neither another server nor an outgoing connection's ephemeral port can take it."""
    held: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _, addr in socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        ):
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            sock = socket.socket(family, kind, proto)
            held.append(sock)
            # As gRPC does: a previous process's TIME_WAIT connections do not block the port,
            # a live listener does.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
    except OSError:
        for sock in held:
            sock.close()
        raise
    return held


def build_pool(settings: Settings) -> WorkerPool:
    return WorkerPool(
        BusyThresholds(
            settings.active_decode_blocks_threshold,
            settings.active_prefill_tokens_threshold,
            settings.active_prefill_tokens_threshold_frac,
            settings.ttft_p99_target_ms,
            settings.itl_p99_target_ms,
        ),
        kv_mode=settings.kv_mode,
        track_output_blocks=settings.router_track_output_blocks,
        worker_ttl=settings.worker_ttl,
        allow=WorkerAllowList.from_entries(settings.worker_allow),
        queue_threshold=settings.router_queue_threshold,
    )


def replica_id(settings: Settings) -> str:
    """The configured id, or one that is new at every start (host, pid, random)."""
    return settings.replica_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


# The background tasks the service runs, each a step repeated on a period.
SWEEPER = "sweeper"
LATENCY_CONTROLLER = "latency_controller"
BACKGROUND_TASKS = (SWEEPER, LATENCY_CONTROLLER)


async def run_every(name: str, interval: float, step: Callable[[], None], metrics: Metrics) -> None:
    """Run ``step`` every ``interval`` seconds until cancelled. A step that raises is
    counted in extproc_background_errors_total{task=name}, the first failure is logged with
    its traceback, and the next step runs on time: one bad step never stops the task."""
    failures = metrics.background_errors.labels(name)
    logged = False
    while True:
        await asyncio.sleep(interval)
        try:
            step()
        except Exception:
            failures.inc()
            if not logged:
                logged = True
                log.exception(
                    "background task %s failed; it keeps running (later failures are counted "
                    "in extproc_background_errors_total, not logged)",
                    name,
                )


def _sweep(pool: WorkerPool, peers: PeerEstimates | None) -> None:
    """Remove the workers and replicas silent past their TTL."""
    for worker_id in pool.expire():
        log.info("worker %s removed: silent for more than %.1fs", worker_id, pool.worker_ttl)
    if peers is not None:
        for rid in peers.expire():
            log.info("replica %s dropped: silent for more than %.1fs", rid, peers.ttl)


def _health_status(readiness: Readiness) -> StatusOf:
    """The gRPC health services: ``liveness`` (the process answers), and ``readiness``,
    the ext_proc service and the whole server (``""``), serving while ``/ready`` says so
    (the names the Endpoint Picker protocol asks for)."""

    def status_of(service: str) -> bool | None:
        if service == "liveness":
            return True
        if service in ("readiness", SERVICE_NAME, ""):
            return readiness.ready
        return None

    return status_of


# The latency controller's period: one move per second at most, each judged on the
# samples of the requests dispatched since the previous one (docs/latency-target.md).
LATENCY_TICK_SECONDS = 1.0


def _control_latency(control: LatencyControl) -> None:
    """Move the limits of the workers of models with a latency target; one log line per
    change of direction of a worker's limit, not per step."""
    for turn in control.tick():
        log.info(
            "latency limit of worker %s (%s%s) now %s: x%.2f of its thresholds; %s",
            turn.worker_id,
            turn.model,
            f", class {turn.request_class}" if turn.request_class else "",
            "falling" if turn.direction < 0 else "rising",
            turn.scale,
            turn.reason,
        )


async def serve(settings: Settings, stop: asyncio.Event | None = None) -> int:
    """Run until ``stop`` is set or SIGINT/SIGTERM; returns the exit code."""
    for warning in all_startup_warnings(settings):
        log.warning(warning)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        async with contextlib.AsyncExitStack() as parts:
            await _run(settings, stop, parts)
    except StartupError as exc:
        log.error("%s", exc)
        return exc.code
    return 0


async def _run(settings: Settings, stop: asyncio.Event, parts: contextlib.AsyncExitStack) -> None:
    """Start every part (each registers its own stop on ``parts``), then wait for ``stop``."""
    pool = build_pool(settings)
    queue = (
        RouterQueue(settings.router_queue_timeout)
        if settings.router_queue_threshold is not None
        else None
    )
    if queue is not None:
        pool.on_capacity = queue.notify
    metrics = Metrics()
    for task in BACKGROUND_TASKS:
        metrics.background_errors.labels(task)  # 0 from the start
    metrics.attach(pool, queue.depth if queue is not None else None)
    readiness = Readiness()

    classes = ClassRegistry(
        load_class_table(settings.classes_file) if settings.classes_file else ClassTable(), pool
    )
    latency = LatencyControl(pool, classes=classes, source=settings.ttft_source)
    metrics.watch_latency(latency)
    if settings.state_file:
        state = RuntimeState(settings.state_file, pool, classes)
        try:
            applied = state.load()
        except StateFileError as exc:
            raise StartupError(2, str(exc)) from None
        if applied:
            log.info("%d runtime change(s) applied from %s", applied, settings.state_file)
        state.watch()
    auth = AdminAuth.from_settings(settings.admin_host, settings.admin_token)
    runner = web.AppRunner(
        build_app(pool, metrics, readiness, auth, classes, latency), access_log=None
    )
    await runner.setup()
    parts.push_async_callback(runner.cleanup)
    site = web.TCPSite(runner, settings.admin_host, settings.admin_port)
    try:
        await site.start()
    except OSError as exc:
        admin = f"{settings.admin_host}:{settings.admin_port}"
        raise StartupError(1, f"cannot listen for the admin API on {admin}: {exc}") from None

    pool.replica.replica_id = replica_id(settings)
    sharing = bool(settings.replica_publish)
    peers = PeerEstimates(pool, settings.replica_ttl) if sharing else None
    curve_server = curve_client = None
    if settings.event_curve_secret_key and settings.event_curve_publishers:
        for reason in REFUSED_REASONS:
            metrics.refused[reason]
        curve_server = CurveServer(
            settings.event_curve_secret_key,
            settings.event_curve_publishers,
            lambda reason: metrics.refused[reason].inc(),
        )
        # Replicas share the server key pair; each publishes to the others as a client.
        public, secret = load_key_pair(settings.event_curve_secret_key)
        curve_client = CurveClient(public, secret, public)
    subscriber = EventSubscriber(
        pool, metrics, curve=curve_server, peers=peers, classes=classes if sharing else None
    )
    try:
        await subscriber.start(settings.event_bind, settings.event_connect)
    except EventBindError as exc:
        raise StartupError(1, str(exc)) from None
    parts.callback(subscriber.close)
    # Measurements reach the latency controller from where they are taken; the pool only
    # receives the limits it sets.
    subscriber.on_engine_ttft = latency.observe_engine
    # Endpoints announced by host name are looked up off the request path, so that a host
    # Envoy names by its address (the served host) matches them.
    resolver = EndpointResolver(pool)
    subscriber.on_announced = resolver.announced
    parts.push_async_callback(resolver.close)
    readiness.events_bound = True
    if sharing:
        replicas = ReplicaPublisher(
            pool,
            settings.replica_publish,
            interval=settings.replica_interval,
            curve=curve_client,
            on_sent=lambda topic: metrics.replica_topic[topic].inc(),
            classes=classes,
        )
        await replicas.start()
        parts.push_async_callback(replicas.close)

    try:
        tokenizer = PromptTokenizer(settings.tokenizer) if settings.tokenizer else None
    except ValueError as exc:
        raise StartupError(2, str(exc)) from None
    handler = ExtProcHandler(
        pool,
        Scheduler(
            pool,
            settings.router_mode,
            queue_threshold=settings.router_queue_threshold,
            max_fallbacks=settings.epp_fallbacks if settings.protocol == "epp" else MAX_FALLBACKS,
        ),
        metrics,
        overload_status=settings.overload_status,
        worker_busy_statuses=settings.worker_busy_statuses,
        queue=queue,
        tokenizer=tokenizer,
        classes=classes,
        protocol=settings.protocol,
        latency=latency,
        body_budget=BodyBudget(settings.request_body_budget_mib * MIB),
    )
    address = f"{settings.grpc_host}:{settings.grpc_port}"
    if settings.startup_grace > 0:
        # A restarted extproc knows no worker until each publisher reconnects and sends its
        # config again. Until then every decision would be a 503; with the gRPC port
        # refusing connections, Envoy fails open instead (failure_mode_allow) and /ready
        # says not yet. The port is held (bound, not listening) so that nothing else takes
        # it meanwhile, and a port in use is an error now rather than after the grace.
        try:
            held = _hold_port(settings.grpc_host, settings.grpc_port)
        except OSError as exc:
            raise StartupError(1, f"cannot listen for ext_proc gRPC on {address}: {exc}") from None
        log.info("listening for worker events for %.1fs before serving ext_proc",
                 settings.startup_grace)  # fmt: skip
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), settings.startup_grace)
        finally:
            for sock in held:
                sock.close()
        if stop.is_set():
            return
        log.info("%d worker(s) known after the startup grace", len(pool.workers))
    health = _health_status(readiness)
    server: GrpcServer | GrpcioServer
    if settings.grpc_server == "grpcio":
        server = GrpcioServer(PROCESS_PATH, handler.open_session, health)
    else:
        server = GrpcServer(PROCESS_PATH, handler.open_session, methods=health_methods(health))
    try:
        await server.start(settings.grpc_host, settings.grpc_port)
    except (OSError, RuntimeError) as exc:
        raise StartupError(1, f"cannot listen for ext_proc gRPC on {address}: {exc}") from None
    parts.push_async_callback(server.stop, 2.0)
    if isinstance(server, GrpcServer):
        grpc_server = server
        metrics.watch_grpc(lambda: len(grpc_server.connections), lambda: grpc_server.closed_for)
    readiness.grpc_serving = True
    parts.callback(setattr, readiness, "grpc_serving", False)
    interval = min(0.5, settings.worker_ttl / 10, settings.replica_ttl / 4)
    sweeper = asyncio.create_task(
        run_every(SWEEPER, interval, lambda: _sweep(pool, peers), metrics), name=SWEEPER
    )
    parts.callback(sweeper.cancel)
    controller = asyncio.create_task(
        run_every(
            LATENCY_CONTROLLER, LATENCY_TICK_SECONDS, lambda: _control_latency(latency), metrics
        ),
        name=LATENCY_CONTROLLER,
    )
    parts.callback(controller.cancel)
    log.info(
        "serving ext_proc on %s (%s server), %s protocol, admin on http://%s:%s, events on %s; "
        "router mode %s; thresholds decode=%s prefill=%s prefill_frac=%s; latency target "
        "ttft=%s itl=%s ms (%s-measured); overload status %s; worker busy statuses %s; "
        "replica %s%s",
        address,
        settings.grpc_server,
        settings.protocol,
        settings.admin_host,
        settings.admin_port,
        ", ".join(subscriber.endpoints + settings.event_connect),
        settings.router_mode,
        settings.active_decode_blocks_threshold,
        settings.active_prefill_tokens_threshold,
        settings.active_prefill_tokens_threshold_frac,
        settings.ttft_p99_target_ms,
        settings.itl_p99_target_ms,
        settings.ttft_source,
        settings.overload_status,
        ",".join(map(str, settings.worker_busy_statuses)) or "off",
        pool.replica.replica_id,
        f" sharing via {', '.join(settings.replica_publish)}" if sharing else " (not sharing)",
    )
    await stop.wait()
    log.info("shutting down")
