"""Wire the parts together and run them on one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket

from aiohttp import web

from extproc.admin.app import Readiness, build_app
from extproc.admin.auth import AdminAuth
from extproc.admin.state import RuntimeState, StateFileError
from extproc.background import (
    CURVE_REFUSALS,
    H2_KEEPALIVE,
    REPLICA_PUBLISHER,
    SWEEPER,
    Guard,
    run_every,
)
from extproc.background import TASKS as BACKGROUND_TASKS
from extproc.core.allowlist import WorkerAllowList
from extproc.core.busy import BusyThresholds
from extproc.core.classes import ClassRegistry, ClassTable
from extproc.core.latency import DeadlineAdmission
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


def _sweep(
    pool: WorkerPool, peers: PeerEstimates | None, admission: DeadlineAdmission | None = None
) -> None:
    """Remove the workers and replicas silent past their TTL, and the estimates of the
    workers that left (by TTL or ``bye``)."""
    for worker_id in pool.expire():
        log.info("worker %s removed: silent for more than %.1fs", worker_id, pool.worker_ttl)
    if admission is not None:
        admission.prune()
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
    metrics = Metrics()
    for task in BACKGROUND_TASKS:
        metrics.background_errors.labels(task)  # 0 from the start
    metrics.attach(pool, queue.depth if queue is not None else None)
    readiness = Readiness()

    classes = ClassRegistry(
        load_class_table(settings.classes_file) if settings.classes_file else ClassTable(), pool
    )
    # Deadline admission: its estimates are fed from where the measurements are taken (load
    # reports here, the request's life in handlers/inflight.py).
    admission = DeadlineAdmission(pool, classes)
    metrics.watch_admission(admission)
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
        build_app(pool, metrics, readiness, auth, classes, admission), access_log=None
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
            guard=Guard(CURVE_REFUSALS, metrics.background_errors),
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
    # The engine's own TTFT buckets go to deadline admission's diagnostics.
    subscriber.on_engine_ttft = admission.engine_ttft
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
            guard=Guard(REPLICA_PUBLISHER, metrics.background_errors),
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
        admission=admission,
        body_budget=BodyBudget(settings.request_body_budget_mib * MIB),
    )
    # Where a slot may free or a measurement arrives, the handler hears of it: the router
    # queue and the held requests are woken, deadline admission's estimates fed.
    pool.on_capacity = handler.capacity_changed
    pool.on_load = handler.load_reported
    classes.listeners.append(handler.classes_changed)
    parts.callback(handler.close)
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
        server = GrpcServer(
            PROCESS_PATH,
            handler.open_session,
            methods=health_methods(health),
            keepalive_guard=Guard(H2_KEEPALIVE, metrics.background_errors),
        )
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
        run_every(
            SWEEPER, interval, lambda: _sweep(pool, peers, admission), metrics.background_errors
        ),
        name=SWEEPER,
    )
    parts.callback(sweeper.cancel)
    log.info(
        "serving ext_proc on %s (%s server), %s protocol, admin on http://%s:%s, events on %s; "
        "router mode %s; thresholds decode=%s prefill=%s prefill_frac=%s; TTFT target "
        "%s ms (deadline admission; itl target %s ms shown only); overload status %s; "
        "worker busy statuses %s; "
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
        settings.overload_status,
        ",".join(map(str, settings.worker_busy_statuses)) or "off",
        pool.replica.replica_id,
        f" sharing via {', '.join(settings.replica_publish)}" if sharing else " (not sharing)",
    )
    await stop.wait()
    log.info("shutting down")
