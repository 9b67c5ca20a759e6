"""draftwise: a local LLM engine built around speculative decoding.

Public API in vLLM's shape: `LLM`, `SamplingParams`, `RequestOutput` (imported lazily so that
`import draftwise.config` stays light)."""
__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"


def __getattr__(name):
    if name in __all__:
        from draftwise import api

        return getattr(api, name)
    raise AttributeError(name)
