"""Sampling: per-request parameters and logits -> processed probabilities -> token ids.

Owns SamplingParams (the vLLM-shaped request knobs) and the one place where temperature, top-k and top-p
turn logits into a distribution. Verification (spec_decode/verify.py) calls the same `process_logits` on both
draft and target so the two distributions are processed identically. Knows nothing of models or caches.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftwise.config import ConfigError

MAX_TEMPERATURE = 100.0  # higher is indistinguishable from uniform sampling over the kept tokens
# below this a temperature is greedy (vLLM's _SAMPLING_EPS): logits / 1e-40 overflow to inf and softmax gives NaN
GREEDY_BELOW = 1e-5
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # the range torch.Generator.manual_seed accepts


@dataclass
class SamplingParams:
    """Request-level sampling knobs with vLLM's names and defaults (temperature 1.0, max_tokens 16)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    include_stop_str_in_output: bool = False  # keep the matched stop string at the end of the text (vLLM)
    skip_special_tokens: bool = True  # leave special tokens out of the text (vLLM)
    # what the output must match (vLLM's shape): a structured.Constraint, or a dict like vLLM's
    # StructuredOutputsParams ({"json": schema} / {"regex": ...} / {"choice": [...]} / {"grammar": ...} /
    # {"json_object": true}, + disable_any_whitespace, whitespace_pattern); parsed and checked here, None = free
    structured_outputs: object | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float))
                or not 0 <= self.temperature <= MAX_TEMPERATURE):  # NaN fails the comparison too
            raise ConfigError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ConfigError(f"seed must be an integer in [-2^63, 2^64 - 1], got {self.seed!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (or -1 for off), got {self.top_k!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.n != 1:
            raise ConfigError("only n=1 is supported")
        if self.structured_outputs is not None:
            from draftwise.structured.constraint import Constraint, parse_structured_outputs

            if not isinstance(self.structured_outputs, Constraint):  # a constraint is checked when compiled
                self.structured_outputs = parse_structured_outputs(self.structured_outputs)  # ConfigError names it

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def process_logits(
    logits: torch.Tensor,  # [..., vocab_size]
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:  # [..., vocab_size] float32 probabilities
    """Temperature, then top-k, then top-p (nucleus), then softmax. Temperature 0 (or below GREEDY_BELOW, where
    dividing would overflow to inf and give NaN probabilities) gives a one-hot argmax."""
    logits = logits.float()
    if not temperature >= GREEDY_BELOW:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(
    probs: torch.Tensor,  # [num_rows, vocab_size]
    generator: torch.Generator | None,
) -> torch.Tensor:  # [num_rows] int64
    """Draw one token per row. Uses inverse-CDF on a uniform from `generator` so a seed fully determines it."""
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    cdf = cdf / cdf[:, -1:]
    # right=True: the first index whose cdf exceeds u, so a zero-probability token is never drawn (with the
    # default left side, u == 0.0 picked token 0 even when top-k/top-p had masked it out)
    ids = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    return ids.clamp_(max=probs.shape[-1] - 1)


def make_generator(seed: int | None, fallback_seed: int, device: str = "cpu") -> torch.Generator:
    """A per-request generator: the request's seed when given, else one derived from the engine's seed."""
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else fallback_seed)
    return g
