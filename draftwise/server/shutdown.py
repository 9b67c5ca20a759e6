"""Graceful shutdown: a uvicorn.Server whose first SIGTERM / SIGINT drains the app before uvicorn stops.

On the first signal the app stops admitting (new requests get 503, /health says 503), requests in flight get up to
`shutdown_timeout` seconds to finish, and whatever is still running then is ended with an error (a stream gets an
error event and `data: [DONE]`); only then does uvicorn close its sockets and wait (FLUSH_S at most) for those
last responses to be written. A second signal exits at once, as plain uvicorn does. Knows the app only through
`app.state.drain` and `app.state.runner` (app.py); nothing of argv.
"""
from __future__ import annotations

import asyncio
import logging

import uvicorn

log = logging.getLogger("draftwise.server")

FLUSH_S = 5.0  # after the drain: how long uvicorn waits for the last responses to be written


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app, shutdown_timeout: float):
        super().__init__(config)
        self.app, self.shutdown_timeout = app, shutdown_timeout
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig, frame) -> None:
        """Signal handler (or a plain call from another thread, as tests do): the first one drains."""
        if self.draining or self._loop is None:
            return super().handle_exit(sig, frame)
        self.draining = True
        self._captured_signals.append(sig)  # as uvicorn does: re-raised once the server has stopped
        log.info("shutting down: draining requests in flight (up to %g s)", self.shutdown_timeout)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        try:
            await self.app.state.drain(self.shutdown_timeout)
            runner = self.app.state.runner
            deadline = self._loop.time() + FLUSH_S  # the ended requests' error events reach their routes
            while runner.in_flight and self._loop.time() < deadline:
                await asyncio.sleep(0.02)
        except Exception:  # never let a failed drain keep the server up
            log.exception("drain failed")
        finally:
            self.should_exit = True


def serve(app, host: str, port: int, shutdown_timeout: float, log_level: str = "info") -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=FLUSH_S)
    server = GracefulServer(config, app, shutdown_timeout)
    if hasattr(app, "server"):  # boot.BootApp: told to exit when its engine cannot start
        app.server = server
    server.run()
