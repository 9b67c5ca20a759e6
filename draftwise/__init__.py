"""draftwise: a local LLM engine built around speculative decoding.

Public API in vLLM's shape: `LLM`, `SamplingParams`, `RequestOutput`."""
from draftwise.api import LLM, RequestOutput, SamplingParams  # noqa: F401

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"
