"""Speculative decoding on the device with static shapes: n-gram lookup, verification, acceptance, the next
input and the rollback as tensor ops around models/static_step.py, one small host read per step.

The state lives in tensors: each slot's token history [S + 1, C] (prompt and output ids; the last one is the
pending token, whose K/V is not yet cached) and its length [S + 1]; the static step's K/V holds positions
0 .. length - 2. A step over a batch bucket B (1, 2, 4, 8; padding sequences on the scratch slot) and a width
bucket W (1 = plain decoding; 2, 4, 8, 16 = verification of up to W - 1 guesses):

1. guesses: the n-gram lookup below (`ngram_lookup`, prompt lookup as vLLM's `ngram` and spec_decode/ngram.py
   define it, bitwise the same guesses), or drafts given as an input (the suffix proposer runs on the host;
   a draft model runs its own static step, `draft_round`), cut to each sequence's k;
2. one target forward over [pending, guess_1 .. guess_{W-1}] at positions length - 1 ..;
3. greedy verification (`greedy_accept`): accept while a guess equals the argmax; or rejection sampling
   (`rejection_accept`, with the uniforms and exponential noise as inputs);
4. the emitted tokens are written after each history's end and the length advanced by the number emitted:
   K/V beyond the new length - 1 (rejected guesses, padding) is invisible to the next step's position mask and
   overwritten by it: that is the rollback;
5. the host reads one [B, W + 1] tensor: the number emitted and the tokens.

`StaticSpecDecoder` is the host loop (admission, buckets, stop on EOS / max_tokens); greedy only. k "auto":
each step takes the width bucket that maximises expected tokens per second, E(k) / cost(W), E(k) = (1 - a^(k+1))
/ (1 - a), a the running acceptance rate, cost(W) the step's time per width bucket timed at the start
(`calibrate`); k = 0 (plain) where guessing does not pay, e.g. a draft model that is rarely right. It knows
nothing of the Engine's requests, grammars, prefix cache or sampling controls; the engine's switch to it lives
in engine/api. Knows no kernels: the static step owns the model side.
"""
from __future__ import annotations

import torch

from draftwise.models.static_step import StaticStep
from draftwise.sampling import SamplingParams

BATCH_BUCKETS = (1, 2, 4, 8)
WIDTH_BUCKETS = (1, 2, 4, 8, 16)
PREFILL_CHUNK = 16


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def ngram_lookup(
    history: torch.Tensor,  # [B, C] int64 token ids; entries at >= lengths[b] are ignored
    lengths: torch.Tensor,  # [B] int64 (>= 1)
    k: int,  # guesses wanted (static)
    min_n: int,
    max_n: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # guesses [B, k] int64, guess_lengths [B] int64
    """spec_decode/ngram.py's `lookup` for every row at once: for n from max_n down to min_n, the latest earlier
    start i (i + n <= L - 1) whose n tokens equal the last n; the up-to-k tokens after it. O(C * max_n) per row,
    no host reads; guesses past guess_lengths are filler."""
    B, C = history.shape
    dev = history.device
    start = torch.arange(C, device=dev)  # [C] candidate match starts
    L = lengths[:, None]  # [B, 1]
    found = torch.zeros(B, dtype=torch.bool, device=dev)
    first = torch.zeros(B, dtype=torch.int64, device=dev)  # where the continuation starts
    for n in range(max_n, min_n - 1, -1):
        match = (start + n <= L - 1) & (L - 1 >= n)  # [B, C]
        for j in range(n):
            window = history.index_select(1, (start + j).clamp(max=C - 1))  # [B, C]: tokens[i + j]
            last = history.gather(1, (L - n + j).clamp(min=0))  # [B, 1]: tokens[L - n + j]
            match = match & (window == last)
        latest = torch.where(match, start, -1).amax(1)  # [B]
        hit = (latest >= 0) & ~found
        first = torch.where(hit, latest + n, first)
        found = found | hit
    offsets = torch.arange(k, device=dev)
    guesses = history.gather(1, (first[:, None] + offsets).clamp(max=C - 1))  # [B, k]
    guess_lengths = torch.where(found, (lengths - first).clamp(min=0, max=k), 0)
    return guesses, guess_lengths


def greedy_accept(
    logits: torch.Tensor,  # [B, W, V]: row t predicts the token after input t
    guesses: torch.Tensor,  # [B, W - 1] int64
    guess_lengths: torch.Tensor,  # [B] int64: real guesses per row (the rest is padding)
) -> tuple[torch.Tensor, torch.Tensor]:  # num_emitted [B] int64 (accepted + 1), tokens [B, W]
    """spec_decode/verify.py's greedy_verify for a whole bucket: accept while a guess equals the argmax, then
    emit the argmax (correction or bonus). The accepted guesses equal the argmax prefix, so the tokens are
    argmax[:, :num_emitted]."""
    target = logits.argmax(-1)  # [B, W]
    W = target.shape[1]
    ok = (guesses == target[:, : W - 1]) & (torch.arange(W - 1, device=logits.device) < guess_lengths[:, None])
    num_accepted = ok.long().cumprod(1).sum(1)
    return num_accepted + 1, target


def rejection_accept(
    p: torch.Tensor,  # [B, W, V] target probabilities (processed: temperature, top-k/p ... as the caller wants)
    q: torch.Tensor | None,  # [B, W - 1, V] draft probabilities; None: point masses on the guesses (n-gram)
    guesses: torch.Tensor,  # [B, W - 1] int64
    guess_lengths: torch.Tensor,  # [B] int64
    uniforms: torch.Tensor,  # [B, W - 1] in [0, 1): one per guess
    noise: torch.Tensor,  # [B, W, V] Exp(1) draws: a categorical draw is argmax(weights / noise)
) -> tuple[torch.Tensor, torch.Tensor]:  # num_emitted [B], tokens [B, W]
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1) for a bucket, as tensor ops: guess i is
    accepted with probability min(1, p_i(x) / q_i(x)) while all before it were; at the first rejection the
    recovered token is drawn from norm(max(0, p - q)), after W - 1 acceptances (or a row's last real guess) the
    bonus from p. Every draw is the exponential-race argmax, so no host read and no data-dependent shape."""
    B, W, V = p.shape
    dev = p.device
    if q is None:
        q = torch.nn.functional.one_hot(guesses, V).to(p.dtype)  # [B, W - 1, V]
    px = p[:, : W - 1].gather(2, guesses[..., None])[..., 0]  # [B, W - 1]
    qx = q.gather(2, guesses[..., None])[..., 0]
    real = torch.arange(W - 1, device=dev) < guess_lengths[:, None]
    ok = (uniforms * qx < px) & real  # u < p/q without a division (q(x) > 0 for a drafted x)
    num_accepted = ok.long().cumprod(1).sum(1)  # [B]
    residual = (p[:, : W - 1] - q).clamp(min=0)  # [B, W - 1, V]
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:, : W - 1])  # p == q: draw from p
    weights = torch.cat((residual, p[:, W - 1 :]), 1)  # [B, W, V]; row i < W - 1: recovered, last: bonus
    # a row whose guesses ended before W - 1 draws its bonus from p at num_accepted == guess_lengths
    bonus_row = (torch.arange(W, device=dev) == guess_lengths[:, None])[..., None]  # [B, W, 1]
    weights = torch.where(bonus_row, p, weights)
    drawn = (weights / noise).argmax(-1)  # [B, W]
    tokens = torch.cat((guesses, guesses[:, :1]), 1)  # [B, W]: accepted guesses, then the draw at num_accepted
    at = torch.arange(W, device=dev)[None] == num_accepted[:, None]
    return num_accepted + 1, torch.where(at, drawn, tokens)


class StaticSpecDecoder:
    """Greedy decoding (plain, n-gram, host-side guesses, or a draft model) through static steps."""

    def __init__(self, target: StaticStep, eos_token_ids=(), method: str | None = None, k: int = 4,
                 min_n: int = 1, max_n: int = 3, draft: StaticStep | None = None, proposer=None):
        if method not in (None, "ngram", "draft_model", "host"):
            raise ValueError(f"method must be None, 'ngram', 'draft_model' or 'host', not {method!r}")
        if method == "draft_model" and draft is None:
            raise ValueError("method 'draft_model' needs the draft's StaticStep")
        if method == "host" and proposer is None:
            raise ValueError("method 'host' needs a host proposer (spec_decode/proposer.py's protocol)")
        self.auto = k == "auto"
        if self.auto:
            k = WIDTH_BUCKETS[-1] - 1
        if method is not None and not (isinstance(k, int) and 1 <= k <= WIDTH_BUCKETS[-1] - 1):
            raise ValueError(f"k must be 'auto' or in 1..{WIDTH_BUCKETS[-1] - 1}, not {k!r}")
        if target.num_slots > BATCH_BUCKETS[-1]:
            raise ValueError(f"at most {BATCH_BUCKETS[-1]} slots (the largest batch bucket)")
        self.target, self.draft, self.proposer = target, draft, proposer
        self.method, self.k, self.min_n, self.max_n = method, k if method else 0, min_n, max_n
        self.eos = set(eos_token_ids)
        slots, dev = target.num_slots + 1, target.keys[0].device
        # history: positions up to capacity - 1, plus a width's room for the unconditional write of a step
        self.history = torch.zeros(slots, target.capacity + WIDTH_BUCKETS[-1], dtype=torch.int64, device=dev)
        self.lengths = torch.ones(slots, dtype=torch.int64, device=dev)  # the scratch slot: one filler token
        self.host_reads = 0  # device -> host reads made by generate()'s steps (one per step)
        self.num_accepted = 0  # guesses accepted (emitted before a stop)
        self.num_guessed = 0  # guesses offered (k per live sequence and step)
        self.acceptance = 0.5  # k auto: running acceptance rate (exponential average over steps)
        self.costs: dict[int, dict[int, float]] = {}  # k auto: batch bucket -> width bucket -> seconds per step

    # ---- the device step: static shapes, no host read --------------------------------------------------
    def device_step(
        self,
        slots: torch.Tensor,  # [B] int64 (the scratch slot for padding)
        live: torch.Tensor,  # [B] bool: False for a bucket's padding sequences
        k_per_seq: torch.Tensor,  # [B] int64: guesses allowed per sequence (<= W - 1)
        width: int,  # W (static)
        host_guesses: torch.Tensor | None = None,  # [B, W - 1] int64 (method "host"), with host_lengths [B]
        host_lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [B, W + 1]: num_emitted, then the tokens (the first num_emitted are emitted)
        B = slots.shape[0]
        L = self.lengths[slots]  # [B]
        hist = self.history[slots]  # [B, C]
        pending = hist.gather(1, (L - 1)[:, None])  # [B, 1]
        if width > 1:
            if self.method == "ngram":
                guesses, glen = ngram_lookup(hist, L, width - 1, self.min_n, self.max_n)
            elif self.method == "draft_model":
                guesses = self.draft_round(hist, L, slots, width - 1)
                glen = torch.full_like(L, width - 1)
            else:
                guesses, glen = host_guesses, host_lengths
            glen = torch.minimum(glen, k_per_seq)
            tokens = torch.cat((pending, guesses), 1)  # [B, W]
        else:
            guesses = torch.zeros(B, 0, dtype=torch.int64, device=slots.device)
            glen = torch.zeros_like(L)
            tokens = pending
        positions = (L - 1)[:, None] + torch.arange(width, device=slots.device)  # [B, W]
        logits = self.target(tokens, positions, slots)  # [B, W, V]
        emitted, out = greedy_accept(logits, guesses, glen)
        emitted = torch.where(live, emitted, 0)
        # write every row's W tokens after its end (those past num_emitted are filler, never read), then advance
        cols = L[:, None] + torch.arange(width, device=slots.device)  # [B, W]
        self.history.index_put_((slots[:, None], cols), out)
        self.lengths.index_put_((slots,), L + emitted)
        return torch.cat((emitted[:, None], out), 1)

    def draft_round(self, hist, L, slots, k: int) -> torch.Tensor:  # hist [B, C], L [B] -> guesses [B, k]
        """k greedy guesses from the draft's static step: one width-2 forward over the last two history tokens
        (catching up the one token the draft has not seen: the previous step's correction or bonus; rewriting
        the other's K/V at its own position is harmless), then k - 1 width-1 forwards. A plain step (width 1: k
        auto chose 0, or the last token of max_tokens) runs no draft, so the draft's K/V keeps a gap there: its
        later guesses get worse, the output does not change (verification decides)."""
        pos = (L - 2).clamp(min=0)[:, None] + torch.arange(2, device=L.device)  # [B, 2]
        ids = hist.gather(1, pos)
        guess = self.draft(ids, pos, slots)[:, 1:].argmax(-1)  # [B, 1] (no call's logits outlive the next call)
        guesses = [guess]
        for i in range(1, k):
            p = (L - 1 + i)[:, None]
            guess = self.draft(guess, p, slots).argmax(-1)
            guesses.append(guess)
        return torch.cat(guesses, 1)

    # ---- the host loop --------------------------------------------------------------------------------
    def prefill(self, slot: int, prompt_ids: list[int], chunk: int = PREFILL_CHUNK) -> int:
        """Write the prompt into `slot`'s history and K/V in fixed chunks (batch bucket 1, the last chunk padded);
        returns the first output token (one host read)."""
        n = len(prompt_ids)
        if not 1 <= n <= self.target.capacity - WIDTH_BUCKETS[-1] - chunk:
            raise ValueError(f"a prompt of {n} tokens does not fit a capacity of {self.target.capacity}")
        dev = self.history.device
        ids = torch.tensor(prompt_ids, dtype=torch.int64, device=dev)
        self.history[slot, :n] = ids
        slots = torch.tensor([slot], device=dev)
        padded = torch.zeros(-(-n // chunk) * chunk, dtype=torch.int64, device=dev)
        padded[:n] = ids
        steps = [self.target] + ([self.draft] if self.method == "draft_model" else [])
        for start in range(0, n, chunk):
            pos = torch.arange(start, start + chunk, device=dev)[None]
            for step in steps:
                logits = step(padded[None, start : start + chunk], pos, slots)  # [1, chunk, V]
                if step is self.target and start + chunk >= n:
                    last = logits[0, (n - 1) - start].argmax()
                del logits
        first = int(last)
        self.history[slot, n] = first
        self.lengths[slot] = n + 1
        return first

    def generate(self, prompts: list[list[int]], max_tokens: int, params=None, sink=None) -> list[list[int]]:
        """Greedy outputs for `prompts` (each at most `max_tokens` tokens, cut after an EOS). Prompts are
        admitted as slots free up; each step runs every live sequence in one batch bucket. Method "host": the
        proposer's chain guesses (a tree's first branch) are inputs; it hears begin / accept / end as in the
        engine (`params`: the SamplingParams it is given; default greedy, this max_tokens). `sink` (default: stop
        at max_tokens or an EOS): `emit(i, token) -> finished?` for each token of prompt i in order, and
        `step(i, k, num_accepted)` after each of its decode steps."""
        dev = self.history.device
        room = self.target.capacity - WIDTH_BUCKETS[-1] - PREFILL_CHUNK
        if any(len(p) + max_tokens > room for p in prompts):
            raise ValueError(f"prompt + max_tokens must stay within {room} tokens (capacity {self.target.capacity})")
        host = self.proposer if self.method == "host" else None
        params = params or SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs: list[list[int]] = [[] for _ in prompts]
        sink = sink or _StopAt(outputs, max_tokens, self.eos)
        tree_rows: dict[int, list[int] | None] = {}  # slot -> its last tree draft's branch rows
        waiting = list(range(len(prompts)))
        running: dict[int, int] = {}  # slot -> request index
        free = list(range(self.target.num_slots))
        while waiting or running:
            while waiting and free:
                i, slot = waiting.pop(0), free.pop(0)
                if host is not None:
                    host.begin(slot, prompts[i], params, torch.Generator().manual_seed(0))
                first = self.prefill(slot, prompts[i])
                outputs[i].append(first)
                running[slot] = i
                if sink.emit(i, first):
                    self._release(running, free, slot)
                elif host is not None:
                    host.accept(slot, 0, first)
            if not running:
                continue
            slots = sorted(running)
            B = bucket(len(slots), BATCH_BUCKETS)
            k_now = self.choose_k(B) if self.auto else self.k
            ks = [max(0, min(k_now, max_tokens - len(outputs[running[s]]) - 1)) for s in slots]
            width = bucket(1 + max(ks), WIDTH_BUCKETS)
            pad = B - len(slots)
            slot_t = torch.tensor(slots + [self.target.scratch_slot] * pad, device=dev)
            live = torch.tensor([True] * len(slots) + [False] * pad, device=dev)
            k_t = torch.tensor(ks + [0] * pad, device=dev)
            extra = {}
            if host is not None and width > 1:
                g = torch.zeros(B, width - 1, dtype=torch.int64)
                made = []
                for row, d in enumerate(host.propose(slots, ks)):
                    guess, tree_rows[slots[row]] = _chain(d)
                    guess = guess[: ks[row]]
                    g[row, : len(guess)] = guess
                    made.append(len(guess))
                ks = made  # the guesses it made
                n = torch.tensor(made + [0] * pad, dtype=torch.int64)
                extra = {"host_guesses": g.to(dev), "host_lengths": n.to(dev)}
            result = self.device_step(slot_t, live, k_t, width, **extra).tolist()  # the one host read
            self.host_reads += 1
            guessed, accepted = sum(ks), sum(result[row][0] - 1 for row in range(len(slots)))
            self.num_guessed += guessed
            if guessed:
                self.acceptance = 0.7 * self.acceptance + 0.3 * accepted / guessed
            for row, s in enumerate(slots):
                i = running[s]
                emitted = result[row][0]
                self.num_accepted += emitted - 1
                done = False
                for tok in result[row][1 : 1 + emitted]:
                    outputs[i].append(tok)
                    if sink.emit(i, tok):
                        done = True
                        break
                sink.step(i, ks[row], emitted - 1)
                if done:
                    self._release(running, free, s)
                elif host is not None and tree_rows.get(s) is not None:
                    host.accept(s, emitted - 1, outputs[i][-1], path=tuple(tree_rows.pop(s)[: emitted - 1]))
                elif host is not None:
                    tree_rows.pop(s, None)
                    host.accept(s, emitted - 1, outputs[i][-1])
        return outputs

    def run_requests(self, requests, eos_token_ids, on_finished=None) -> None:
        """Run engine Requests (duck-typed: prompt_ids, params, on_token, output_ids, finish_reason, times,
        spec_stats) to the end with the engine's stop rules (EOS unless ignored, stop ids, on_token's stop
        strings, max_tokens) and per-step stats. The caller checked `eligible`."""
        sink = _RequestSink(requests, set(eos_token_ids), on_finished)
        self.generate([r.prompt_ids for r in requests], max(r.params.max_tokens for r in requests),
                      requests[0].params if requests else None, sink)

    # ---- k auto --------------------------------------------------------------------------------------
    def calibrate(self, batches: tuple[int, ...] = BATCH_BUCKETS, rounds: int = 3) -> dict[int, dict[int, float]]:
        """Time the device step at every width bucket (median of `rounds`, widths interleaved in each round) for
        each batch bucket, on the scratch slot (no sequence's state changes); what k auto divides by."""
        import statistics
        import time

        dev = self.history.device
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        widths = WIDTH_BUCKETS if self.method else (1,)
        for B in batches:
            slots = torch.full((B,), self.target.scratch_slot, device=dev)
            live = torch.zeros(B, dtype=torch.bool, device=dev)
            times: dict[int, list[float]] = {w: [] for w in widths}
            extra = lambda w: ({"host_guesses": torch.zeros(B, w - 1, dtype=torch.int64, device=dev),  # noqa: E731
                                "host_lengths": torch.zeros(B, dtype=torch.int64, device=dev)}
                               if self.method == "host" and w > 1 else {})
            for _ in range(rounds + 1):  # the first round warms up (and compiles, when the step is compiled)
                for w in widths:
                    k = torch.full((B,), w - 1, device=dev)
                    sync()
                    t0 = time.perf_counter()
                    self.device_step(slots, live, k, w, **extra(w))
                    sync()
                    times[w].append(time.perf_counter() - t0)
            self.costs[B] = {w: statistics.median(t[1:]) for w, t in times.items()}
        return self.costs

    def choose_k(self, batch: int) -> int:
        """The k (a width bucket filled: 0, 1, 3, 7, 15) with the most expected tokens per second at this batch
        bucket; the largest configured k before calibration."""
        costs = self.costs.get(batch)
        if not costs:
            return self.k
        a = min(self.acceptance, 0.999)
        best, best_rate = 0, 0.0
        for w, cost in costs.items():
            k = w - 1
            rate = (1 - a ** (k + 1)) / (1 - a) / cost
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def _release(self, running: dict, free: list, slot: int) -> None:
        del running[slot]
        free.append(slot)
        if self.method == "host":
            self.proposer.end(slot)



def _chain(draft) -> tuple[torch.Tensor, list[int] | None]:  # -> ids [n] int64, their tree rows (None: a chain)
    """A chain draft's ids, or a tree draft's first root-to-leaf branch and its guesses' chunk rows (guess i sits
    at chunk row i + 1; the pending token at row 0)."""
    if draft.parents is None:
        return draft.token_ids, None
    keep, row = [], 0
    for i, parent in enumerate(draft.parents):
        if parent == row:
            keep.append(i)
            row = i + 1
    return draft.token_ids[keep], [i + 1 for i in keep]


class _StopAt:
    """generate's default sink: a sequence ends at max_tokens or after an EOS."""

    def __init__(self, outputs: list[list[int]], max_tokens: int, eos: set[int]):
        self.outputs, self.max_tokens, self.eos = outputs, max_tokens, eos

    def emit(self, i: int, token: int) -> bool:
        return len(self.outputs[i]) >= self.max_tokens or token in self.eos

    def step(self, i: int, k: int, num_accepted: int) -> None:
        pass


def eligible(requests, method: str, max_model_len: int) -> bool:
    """Whether the static path gives these requests exactly what the engine would: greedy, one sample, no
    grammar, logprobs or history-dependent logits (penalties, bias, min_tokens), speculation plain or n-gram, a
    request that fits the context."""
    return method in ("none", "ngram") and all(
        r.params.greedy and r.grammar is None and r.params.logprobs is None and not r.params.adjusts_logits
        and r.speculate and not r.output_ids and len(r.prompt_ids) + r.params.max_tokens <= max_model_len
        for r in requests)


class _RequestSink:
    """run_requests' sink: the engine's stop rules and stats on its Request objects."""

    def __init__(self, requests, eos: set[int], on_finished):
        self.requests, self.eos, self.on_finished = requests, eos, on_finished

    def emit(self, i: int, token: int) -> bool:
        import time

        r, now = self.requests[i], time.perf_counter()
        if r.first_token_time is None:
            r.first_token_time = now
        r.output_ids.append(token)
        p = r.params
        reason = None
        if (token in self.eos and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        elif r.on_token is not None and r.on_token(token):
            reason = "stop"
        elif len(r.output_ids) >= p.max_tokens:
            reason = "length"
        if reason is None:
            return False
        r.finish_reason, r.finish_time = reason, now
        if self.on_finished is not None:
            self.on_finished(r)
        return True

    def step(self, i: int, k: int, num_accepted: int) -> None:
        r = self.requests[i]
        r.spec_stats.record(k, min(num_accepted, k))
