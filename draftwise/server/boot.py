"""The server before its engine is ready: listening from the first moment, /health saying so.

`BootApp(wait, make)` is the ASGI app `draftwise serve` runs: uvicorn binds its port at once, and until the engine
has loaded its model every request is answered here — /health 503 `{"state": "starting"}` with Retry-After, any
other path 503 `engine_unavailable` ("the engine is starting") with Retry-After. Meanwhile `wait()` (blocking:
the engine process's model load) runs on a thread; then `make()` builds the real app (app.create_app) on the event
loop, its lifespan is entered (the runner starts reading the engine), and from then on every request goes to it.
A load that fails is answered as /health 503 `failed` naming the cause, and the server is told to exit
(`failed` holds the error; the CLI raises it once uvicorn has stopped). Knows nothing of routes, the engine or
argv: the CLI passes the two callables in; shutdown.py reads `state.drain` / `state.runner` through `state`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from types import SimpleNamespace

from draftwise.server.errors import error_body

log = logging.getLogger("draftwise.server")

STARTING_RETRY_AFTER_S = 5  # what a client is told to wait while the model loads


class BootApp:
    def __init__(self, wait, make, on_ready=None, abandon=None):
        self._wait, self._make = wait, make  # wait(): blocks until the engine is ready; make(): the FastAPI app
        self._on_ready = on_ready  # (app) -> None, once the real app serves (the CLI prints its lines)
        self._abandon = abandon  # () -> None: stop the loading engine (shutdown before it was ready)
        self.app = None  # the real app, once built and started
        self.failed: BaseException | None = None  # why the engine could not start
        self.server = None  # the uvicorn.Server running this (shutdown.serve sets it): told to exit on a failure
        self._task: asyncio.Task | None = None
        self._lifespan = None  # the real app's lifespan context, entered
        self._t0 = time.monotonic()

    @property
    def state(self):
        """The real app's state once it serves; before, a drain with nothing to wait for."""
        if self.app is not None:
            return self.app.state

        async def drain(timeout: float) -> None:
            return None

        return SimpleNamespace(drain=drain, runner=SimpleNamespace(in_flight=0))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan_loop(receive, send)
            return
        if self.app is not None:
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # websockets: nothing served here
            return
        await self._answer_503(scope, send)

    async def _answer_503(self, scope, send) -> None:
        if self.failed is not None:
            message, state, headers = f"the engine could not start: {self.failed}", "failed", []
        else:
            message, state = "the engine is starting (loading the model)", "starting"
            headers = [(b"retry-after", str(STARTING_RETRY_AFTER_S).encode())]
        body = error_body(503, message, code="engine_unavailable")
        if scope.get("path") == "/health":
            body["state"] = state
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode())] + headers})
        await send({"type": "http.response.body", "body": data})

    async def _lifespan_loop(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self._task = asyncio.get_running_loop().create_task(self._boot())
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self._shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _boot(self) -> None:
        """Wait for the engine (on a thread), build the real app, enter its lifespan, hand it the requests."""
        try:
            await asyncio.to_thread(self._wait)
            app = self._make()
            ctx = app.router.lifespan_context(app)
            await ctx.__aenter__()
            self._lifespan, self.app = ctx, app
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 — the server cannot serve: say why, then exit
            log.error("the engine could not start: %s", e)
            if self.server is not None:
                self.server.should_exit = True
            self.failed = e  # last: whoever sees it set sees the exit asked for too
            return
        log.info("the engine is ready %.1f s after the server started listening", time.monotonic() - self._t0)
        if self._on_ready is not None:
            self._on_ready(app)

    async def _shutdown(self) -> None:
        task = self._task
        if task is not None and not task.done():
            if self._abandon is not None:
                self._abandon()  # the engine is still loading: stop it (the waiting thread then returns)
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 — cancelled, or the engine's end
                pass
        if self._lifespan is not None:
            ctx, self._lifespan = self._lifespan, None
            await ctx.__aexit__(None, None, None)
