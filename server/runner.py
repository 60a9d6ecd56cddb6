"""Run the app until SIGTERM/SIGINT, then drain: refuse new work (503), let in-flight
requests finish up to `drain_timeout_s`, end the rest with an error (a stream gets an error
event and `[DONE]`), shut the engine down, return 0. If the engine dies (`is_healthy()` turns
False; /health already answers 503), drain the same way and return 1, so a supervisor
restarts the process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from configs.schema import ServerConfig
from server.app import STATE, create_app
from server.engine_client import EngineClient

logger = logging.getLogger("jaxserve.server")
_CUT_GRACE_S = 2.0  # after a drain timeout: time for cut-off requests to send their last words


class _ServerLog(logging.LoggerAdapter):
    """aiohttp's low-level server logger, except that malformed HTTP (the client's fault, and
    noise on any exposed port) is one WARNING line without a traceback."""

    def exception(self, msg, *args, exc_info=True, **kwargs) -> None:
        if isinstance(exc_info, HttpProcessingError):
            first_line = next((line.strip() for line in str(exc_info.message).splitlines() if line.strip()), "")
            self.logger.warning(msg + ": malformed HTTP (%d %s)", *args, exc_info.code, first_line)
        else:
            self.logger.exception(msg, *args, exc_info=exc_info, **kwargs)


async def start_app(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str, int]:
    """Start serving `app`; returns the runner and the bound host and port (port 0 picks one).

    `handler_cancellation=True` cancels a handler whose client went away, so a non-streaming
    request aborts its engine work too, not only a streaming one.
    """
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=2.0,
        logger=_ServerLog(logging.getLogger("aiohttp.server"), {}),
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]
    return runner, bound_host, bound_port


async def drain_and_stop(runner: web.AppRunner, engine: EngineClient, timeout_s: float) -> bool:
    """Refuse new requests, wait for in-flight ones, stop the server and the engine.

    Returns True when every in-flight request finished within the timeout.
    """
    state = runner.app[STATE]
    state.draining = True
    logger.info("draining: %d requests in flight, waiting up to %.0f s", state.in_flight, timeout_s)
    drained = True
    try:
        await asyncio.wait_for(state.idle.wait(), timeout_s)
    except TimeoutError:
        drained = False
        logger.warning("drain timeout: %d requests still in flight are cut off", state.in_flight)
        state.cut.set()  # each ends with an error (streams: an error event, then [DONE])
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(state.idle.wait(), _CUT_GRACE_S)
    await runner.cleanup()
    await engine.shutdown()
    return drained


async def serve_async(
    engine: EngineClient,
    server_config: ServerConfig,
    stop: asyncio.Event | None = None,
    kv_transfer_token: str | None = None,
) -> int:
    """Serve until `stop` is set or SIGTERM/SIGINT arrives, then drain. Returns the exit code."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    runner, host, port = await start_app(
        create_app(engine, server_config, kv_transfer_token), server_config.host, server_config.port
    )
    logger.info("jaxserve ready at http://%s:%d (model %s)", host, port, engine.model_name)
    watcher = asyncio.create_task(_stop_when_unhealthy(engine, stop, server_config.unhealthy_linger_s))
    try:
        await stop.wait()
    finally:
        watcher.cancel()
        for sig in installed:
            loop.remove_signal_handler(sig)
        await drain_and_stop(runner, engine, server_config.drain_timeout_s)
    exit_code = 0 if engine.is_healthy() else 1
    logger.info("jaxserve stopped (exit code %d)", exit_code)
    return exit_code


async def _stop_when_unhealthy(
    engine: EngineClient, stop: asyncio.Event, linger_s: float = 0.0, period_s: float = 0.2
) -> None:
    while not stop.is_set():
        if not engine.is_healthy():
            logger.error(
                "the engine is no longer healthy: /health answers 503 for %.0f s, then draining and "
                "exiting with status 1",
                linger_s,
            )
            await asyncio.sleep(linger_s)  # let load balancers and operators see the 503
            stop.set()
            return
        await asyncio.sleep(period_s)


def serve(engine: EngineClient, server_config: ServerConfig, kv_transfer_token: str | None = None) -> int:
    """Blocking entry point for the CLI: serve, drain on SIGTERM/SIGINT, return 0.

    A multi-host follower (processes 1..N-1, runtime/parallel/multihost.py) serves no HTTP: it replays
    process 0's steps until process 0 stops it, and returns its exit code."""
    follow = getattr(engine, "follow", None)
    if follow is not None:
        logger.info("multi-host follower: no HTTP server; following process 0's steps")
        return follow()
    # The engine thread waits for the GIL whenever the event loop's thread holds it (streaming
    # thousands of SSE events a second); Python hands it over after the switch interval at the
    # latest. Measured (benchmarks/saturation.py --ours-variant, tiny dense bf16 mixed, 2-core CPU,
    # 2026-12-02, docs/benchmarks.md round 9, in git history at 3d0e372): 0.5 ms vs Python's 5 ms
    # 1.12x tokens/s, p99 TPOT 19.9 -> 14.6 ms.
    sys.setswitchinterval(server_config.gil_switch_interval_ms / 1e3)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(serve_async(engine, server_config, kv_transfer_token=kv_transfer_token))


def _loop_factory():
    """uvloop's event loop where it is installed (a dependency on Linux / macOS; vLLM serves on it
    too): the streaming path writes one SSE event per token per request, and libuv's transport
    writes cost less than asyncio's. The standard loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
