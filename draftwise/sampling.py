"""Sampling: per-request parameters and logits -> processed probabilities -> token ids.

Owns SamplingParams (the vLLM-shaped request knobs), the history-dependent logit transform (`adjust_logits`:
logit_bias, min_tokens, repetition / frequency / presence penalties, vLLM's order and definitions), the one
place where temperature, min-p, top-k and top-p turn logits into a distribution (`process_logits`), and the
target's per-token log-probabilities (`token_logprobs`). The engine and the draft proposer call the same
`adjust_logits` on every row with that row's own history (the guesses before it included), and verification
(spec_decode/verify.py) the same `process_logits` on draft and target, so both are transformed identically.

Randomness: a request's generator (`make_generator`) is a `PositionalGenerator`, a torch.Generator (sequential
draws: the draft model's own guesses) that also answers `uniforms(position, purpose, n)`, a pure function of
(seed, output position, purpose, index) — a counter-based stream (splitmix64 over the four), so what the target
draws for output position i does not depend on how many numbers were drawn before it: a request resumed from
its prompt plus the tokens it already emitted (the server's replay after an engine restart) draws the same
numbers at the same positions. `inverse_cdf` turns a row and a uniform into a token, the one way every sample is
drawn. Knows nothing of models, caches or text.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from draftwise.config import ConfigError
from draftwise.kernels import glue

MAX_TEMPERATURE = 100.0  # higher is indistinguishable from uniform sampling over the kept tokens
# below this a temperature is greedy (vLLM's _SAMPLING_EPS): logits / 1e-40 overflow to inf and softmax gives NaN
GREEDY_BELOW = 1e-5
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # the range torch.Generator.manual_seed accepts
MAX_LOGPROBS = 20  # top log-probabilities per token (OpenAI's top_logprobs limit)
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI)
MAX_LOGIT_BIAS = 100.0  # logit_bias values lie in [-100, 100] (OpenAI)


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
    # the history-dependent transform (adjust_logits): penalties over the output (presence, frequency) or over
    # prompt + output (repetition: > 1 discourages), a fixed additive bias per token id, and min_tokens (EOS and
    # stop_token_ids masked until that many tokens are out; stop strings still apply)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability (after temperature)
    # per emitted token, the target's log-probability and this many top alternatives (token_logprobs); None: none
    logprobs: int | None = None

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
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ConfigError(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v!r}")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not 0 < rp <= MAX_TEMPERATURE:
            raise ConfigError(f"repetition_penalty must be a number in (0, {MAX_TEMPERATURE:g}], got {rp!r}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p!r}")
        self.logit_bias = _check_logit_bias(self.logit_bias)
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or not (
                0 <= self.min_tokens <= self.max_tokens):
            raise ConfigError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ConfigError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.structured_outputs is not None:
            from draftwise.structured.constraint import Constraint, parse_structured_outputs

            if not isinstance(self.structured_outputs, Constraint):  # a constraint is checked when compiled
                self.structured_outputs = parse_structured_outputs(self.structured_outputs)  # ConfigError names it

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def samples(self) -> list["SamplingParams"]:
        """The params of each of the n samples: n = 1 each, seed + index (wrapping within the seed range), so a
        seeded request is reproducible sample by sample; without a seed each sample draws its own."""
        if self.n == 1:
            return [self]
        span = SEED_MAX - SEED_MIN + 1
        return [replace(self, n=1, seed=None if self.seed is None else (self.seed + i - SEED_MIN) % span + SEED_MIN)
                for i in range(self.n)]

    def stop_ids(self, eos_token_ids) -> set[int]:
        """The ids that end this request's output (what min_tokens holds back): EOS unless ignored, stop_token_ids."""
        return (set() if self.ignore_eos else set(eos_token_ids)) | set(self.stop_token_ids)

    @property
    def adjusts_logits(self) -> bool:
        """Does adjust_logits change anything for these params? (False: the rows are used as they are.)"""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)


def _check_logit_bias(bias) -> dict[int, float]:
    """{token id: bias}; JSON object keys arrive as strings ("50256"), so decimal strings are read as ids."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise ConfigError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    out = {}
    for key, value in bias.items():
        tid = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
            raise ConfigError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise ConfigError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for {key!r}")
        out[tid] = float(value)
    return out


def adjust_logits(
    logits: torch.Tensor,  # [n, vocab_size]: row i follows output_ids + guesses[:i]
    params: SamplingParams,
    prompt_ids: list[int],
    output_ids: list[int],
    guesses: list[int],  # at least n - 1 ids: the tokens between row 0 and row n - 1
    stop_ids: tuple[int, ...] | set[int] = (),  # what min_tokens holds back: EOS ids (unless ignored), stop ids
) -> torch.Tensor:  # [n, vocab_size] float32
    """The request's history-dependent transform, row i from the history up to it (prompt, output so far, then
    guesses 1..i), in vLLM's order: logit_bias added; min_tokens masks `stop_ids` (-inf) while fewer than
    min_tokens tokens precede the row (unless nothing else is left, e.g. a grammar that only lets it end); then
    repetition_penalty (HF / vLLM: a token seen in prompt or history has a positive logit divided by it, a
    negative one multiplied), frequency_penalty x its count in the output and presence_penalty once if it
    occurs there, both subtracted. Returns `logits` untouched when params adjust
    nothing; every row is computed elementwise, so row i does not depend on how many rows come with it."""
    if not params.adjusts_logits:
        return logits
    n, vocab = logits.shape
    dev = logits.device
    out = logits.float().clone()
    if params.logit_bias:
        ids = [t for t in params.logit_bias if t < vocab]
        out[:, ids] += torch.tensor([params.logit_bias[t] for t in ids], device=dev)
    if params.min_tokens:
        held = [i for i in range(n) if len(output_ids) + i < params.min_tokens]
        stops = [t for t in stop_ids if t < vocab]
        if held and stops:
            rows, cols = torch.tensor(held, device=dev)[:, None], torch.tensor(stops, device=dev)[None]
            before = out[rows, cols]  # [held, stops]
            out[rows, cols] = float("-inf")
            dead = ~torch.isfinite(out[rows[:, 0]]).any(-1)  # a row whose every other id is masked (a grammar
            out[rows[dead], cols] = before[dead]  # that only lets the output end): the stop stays possible
    if not (params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty):
        return out
    history = torch.tensor(list(output_ids) + list(guesses[: n - 1]), dtype=torch.int64, device=dev)
    counts = torch.zeros(n, vocab, device=dev)  # [n, V]: row i counts output_ids + guesses[:i]
    num_out = len(output_ids)
    if num_out:
        counts += torch.bincount(history[:num_out], minlength=vocab)[:vocab].float()
    if n > 1:
        steps = torch.nn.functional.one_hot(history[num_out:], vocab).float().cumsum(0)  # [n - 1, V]
        counts[1:] += steps
    if params.repetition_penalty != 1:
        seen = counts > 0
        if prompt_ids:
            seen |= torch.zeros(vocab, dtype=torch.bool, device=dev).index_fill_(
                0, torch.tensor([t for t in prompt_ids if t < vocab], dtype=torch.int64, device=dev), True)
        rp = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / rp, out * rp), out)
    if params.frequency_penalty:
        out -= params.frequency_penalty * counts
    if params.presence_penalty:
        out -= params.presence_penalty * (counts > 0).float()
    return out


def token_logprobs(
    logits: torch.Tensor,  # [n, vocab_size] the target's raw logits, row i predicting token_ids[i]
    token_ids: list[int],  # n ids
    num_top: int,
) -> list["TokenLogprob"]:
    """The target's raw log-probabilities (log-softmax of its logits, before penalties, bias, temperature,
    truncation and grammar masks: vLLM's default "raw_logprobs") of each token and of its row's `num_top` most
    likely ids."""
    lp = torch.log_softmax(logits[: len(token_ids)].float(), dim=-1)  # [n, V]
    chosen = lp[torch.arange(len(token_ids)), torch.tensor(token_ids, dtype=torch.int64)].tolist()
    tops = [[] for _ in token_ids]
    if num_top:
        values, ids = torch.topk(lp, num_top, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return [TokenLogprob(t, c, top) for t, c, top in zip(token_ids, chosen, tops)]


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target, and its row's top (id, logprob) pairs."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:  # logits [..., vocab_size] -> [...] int64
    """Each row's greedy token: torch.argmax(logits, -1) exactly (the first maximum; a NaN counts above every
    number). Float32 CPU rows go through the glue's one-pass argmax (kernels/glue.py; ~11 against ~150 us a
    151,936-token row on a Zen 4, where a 4-row step verifying 5 guesses a row had spent ~3 ms in torch's)."""
    if logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.shape[-1] > 0 and glue.available():
        return glue.argmax(logits)
    return logits.argmax(-1)


def process_logits(
    logits: torch.Tensor,  # [..., vocab_size]
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:  # [..., vocab_size] float32 probabilities
    """Temperature, then min-p (tokens below min_p x the top probability dropped), then top-k, then top-p
    (nucleus), then softmax (vLLM's order). Temperature 0 (or below GREEDY_BELOW, where dividing would overflow
    to inf and give NaN probabilities) gives a one-hot argmax."""
    logits = logits.float()
    if not temperature >= GREEDY_BELOW:
        return torch.nn.functional.one_hot(greedy_ids(logits), logits.shape[-1]).float()
    logits = logits / temperature
    vocab = logits.shape[-1]
    if min_p > 0:
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p): no softmax needed
        floor = logits.max(-1, keepdim=True).values + torch.log(torch.tensor(min_p))
        logits = logits.masked_fill(logits < floor, float("-inf"))
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


def inverse_cdf(
    probs: torch.Tensor,  # [num_rows, vocab_size] (unnormalised is fine)
    u: torch.Tensor,  # [num_rows] float64 uniforms in [0, 1)
) -> torch.Tensor:  # [num_rows] int64
    """The token each row's uniform picks: the first index whose normalised CDF exceeds u."""
    cdf = probs.double().cumsum(-1)
    cdf = cdf / cdf[:, -1:]
    # right=True: the first index whose cdf exceeds u, so a zero-probability token is never drawn (with the
    # default left side, u == 0.0 picked token 0 even when top-k/top-p had masked it out)
    ids = torch.searchsorted(cdf, u.to(cdf.device, torch.float64)[:, None], right=True).squeeze(-1)
    return ids.clamp_(max=probs.shape[-1] - 1)


def sample(
    probs: torch.Tensor,  # [num_rows, vocab_size]
    generator: torch.Generator | None,
) -> torch.Tensor:  # [num_rows] int64
    """Draw one token per row. Uses inverse-CDF on a uniform from `generator` so a seed fully determines it."""
    u = torch.rand(probs.shape[0], generator=generator, device=probs.device, dtype=torch.float64)
    return inverse_cdf(probs, u)


# what a position's numbers are for (verify.py): the target's own draw at a position (a plain step's token, a
# point-mass draft's verification, the bonus), a draft token's acceptance test, the correction after a rejection
PURPOSE_TARGET, PURPOSE_ACCEPT, PURPOSE_RESIDUAL = 1, 2, 3
_M64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers whose outputs look independent."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


class PositionalGenerator(torch.Generator):
    """A request's randomness. As a torch.Generator (seeded with `seed`): sequential draws for whoever draws in
    sequence (the draft model's guesses; get_state / set_state roll it back). `uniforms(position, purpose, n)`:
    n numbers in [0, 1) that depend only on (seed, position, purpose, index) — what verification draws at
    output position `position`, the same in a resumed request as in the run it resumes."""

    def __new__(cls, seed: int, device: str = "cpu"):
        return super().__new__(cls, device=device)  # torch's C type takes its device in __new__

    def __init__(self, seed: int, device: str = "cpu"):
        self.manual_seed(seed)
        self.key = _mix64(seed & _M64)

    def uniforms(self, position: int, purpose: int, n: int = 1) -> torch.Tensor:  # -> [n] float64
        base = _mix64(self.key ^ _mix64(position & _M64))
        return torch.tensor([(_mix64(base ^ ((purpose << 32) | i)) >> 11) * 2.0**-53 for i in range(n)],
                            dtype=torch.float64)


def make_generator(seed: int | None, fallback_seed: int, device: str = "cpu") -> PositionalGenerator:
    """A per-request generator: the request's seed when given, else one derived from the engine's seed."""
    return PositionalGenerator(seed if seed is not None else fallback_seed, device)
