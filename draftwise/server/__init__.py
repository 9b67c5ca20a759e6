"""OpenAI-compatible HTTP server over the engine: app.py (routes), runner.py (admission and the engine's pipe),
engine_host.py (the engine process), protocol.py (request/response shapes), metrics.py (Prometheus), errors.py
(OpenAI error bodies), cli.py.

`create_app` is imported lazily so that `draftwise --help` does not pay for FastAPI."""

__all__ = ["create_app"]


def __getattr__(name):
    if name == "create_app":
        from draftwise.server.app import create_app

        return create_app
    raise AttributeError(name)
