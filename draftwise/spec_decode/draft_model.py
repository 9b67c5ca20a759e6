"""Draft-model proposer: a smaller causal LM with its own KV cache guesses k tokens autoregressively.

Owns the draft's per-slot token history and cache length. After the target's verdict it rolls its cache back
with `truncate` (the only rollback); the all-accepted case — the last guess was never fed to the draft — is
handled by feeding every token the draft has not seen yet on the next call. Draft distributions are processed
with the request's own temperature/top-k/top-p/min-p, after its history transform (sampling.adjust_logits:
penalties, bias, min_tokens from prompt + accepted output + the guesses before), as the engine transforms the
target's rows, so rejection sampling compares like with like. Under structured
outputs each slot keeps its own copy of the request's grammar state: guesses are drawn from the draft's
distribution masked by it (so q is a proper distribution over the allowed ids, as the target's p is), it is
advanced along the guesses, and `accept` rolls the guesses back and advances what the target emitted.
With a prefix cache of its own (prefix_cache.py; builders.py turns it on where it is exact, as the target's),
`begin` copies a new prompt's longest cached prefix into the slot and `end` keeps what the slot holds.

A trimmed head (`draft_vocab_size`, after FR-Spec: Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary
Language Models via Frequency-Ranked Speculative Sampling", arXiv 2502.14856; EAGLE-3 drafts over 32k ids too):
the draft computes logits only for the kept ids — the first `draft_vocab_size` ids plus every EOS id — and
`TrimmedHead` scatters them into a [..., V] row at -inf, so the draft never proposes another id and its q is 0
there; everything after (process_logits, grammar masks, sampling, Draft.probs [k, V]) is unchanged, and
verification keeps the target's distribution for any q the guesses were really drawn from. Which ids: byte-level
BPE vocabularies (Qwen, GPT-2) number tokens in merge order, which follows corpus frequency, so the first N ids
stand in for FR-Spec's frequency ranking when no corpus counts are at hand; EOS ids are always kept so the draft
can still propose the end. On a 151,936-id vocabulary with hidden 896 (qwen2.5-coder-0.5b) the head is 27% of
the draft's weight reads per token. The head's first N rows are a view of the draft's own lm_head where its
format allows one (q4x8: whole 16-column blocks, bitwise the full head's logits; dense: row slices); the EOS
rows are a small copy; other formats (torch int4 / int8 kernels) compute the full head and pick the kept ids.
Stopping early on the draft's own confidence (`min_guess_prob`, after llama.cpp's speculative `p_min` and the
adaptive drafts of SpecDec++, Huang et al. 2024, arXiv 2405.19715, and DISCO, Mamou et al. 2024, arXiv
2405.04304): a row stops guessing after a guess its draft gave less than this probability (greedy: the top
probability of the draft's row; sampled: q of the drawn id). That guess is still proposed (it costs no draft
forward, only one more verified row); the forwards for guesses after it, which the target would mostly reject,
are saved. The stop depends only on the draft's own rows, so verification stays exact for any value.
Knows nothing of the target model or the engine's scheduling.
"""
from __future__ import annotations

import torch
from torch import nn

from draftwise.config import ConfigError
from draftwise.kernels import linear
from draftwise.kv_cache import MAX_BATCHED_CATCH_UP, KVCache
from draftwise.prefix_cache import PrefixCache
from draftwise.sampling import SamplingParams, adjust_logits, greedy_ids, process_logits, sample
from draftwise.spec_decode.proposer import EMPTY_DRAFT_IDS, Draft
from draftwise.structured.matcher import GrammarError, GrammarMatcher, mask_logits


CATCH_UP_CHUNK_TOKENS = 2048  # a long prompt is fed in forwards of at most this many tokens (activations per chunk)


class DraftModelProposer:
    def __init__(self, model, num_slots: int, capacity: int, target_vocab_size: int,
                 draft_vocab_size: int | None = None, eos_token_ids: tuple[int, ...] = (),
                 prefix_cache: PrefixCache | None = None, num_blocks: int | None = None,
                 kv_cache_dtype: torch.dtype | None = None, min_guess_prob: float = 0.0):
        c = model.config
        self.model = model
        if not 0.0 <= min_guess_prob < 1.0:
            raise ConfigError(f"draft_p_min must be in [0, 1), got {min_guess_prob!r}")
        # stop a row's guesses after one its draft gave less than this probability (0: always guess k)
        self.min_guess_prob = min_guess_prob
        # the draft's own head over the kept ids (None: the model's lm_head, the whole vocabulary)
        self.head = None
        if draft_vocab_size is not None and not 1 <= draft_vocab_size <= c.vocab_size:
            raise ConfigError(f"draft_vocab_size {draft_vocab_size} must be in 1..{c.vocab_size} "
                              f"(the draft's vocabulary)")
        if draft_vocab_size is not None and draft_vocab_size < c.vocab_size:
            self.head = TrimmedHead(model.lm_head, c.vocab_size, kept_ids(draft_vocab_size, c.vocab_size, eos_token_ids))
        # its own paged pool (kv_cache.py; num_blocks None: every slot at full capacity)
        self.cache = KVCache(c.num_layers, num_slots, c.num_kv_heads, capacity, c.head_dim,
                             kv_cache_dtype or model.dtype, model.device, num_blocks=num_blocks)
        self.prefix_cache = prefix_cache  # the draft's own: a prompt's cached prefix is not fed again
        self.target_vocab_size = target_vocab_size
        # ids the draft can embed: fewer rows than the target (padding) -> the engine masks to the shared ids
        self.vocab_limit = c.vocab_size if c.vocab_size < target_vocab_size else None
        self.tokens: dict[int, list[int]] = {}  # context per slot: prompt + accepted output
        self.prompt_lens: dict[int, int] = {}  # the prompt's part of `tokens` (penalties tell output from prompt)
        self.eos_token_ids = set(eos_token_ids)  # what min_tokens holds back in the draft's q, as in the target's
        self.seen: dict[int, int] = {}  # tokens of `tokens` (then of the guesses) held in the draft cache
        self.params: dict[int, SamplingParams] = {}
        self.generators: dict[int, torch.Generator] = {}
        self._last: dict[int, list[int]] = {}
        self.grammars: dict[int, GrammarMatcher] = {}  # per slot: the accepted output's grammar state ...
        self._advanced: dict[int, int] = {}  # ... plus this many tokens of the last draft, rolled back in accept

    def begin(self, slot, prompt_ids, params, generator, grammar=None, scope=""):
        self.tokens[slot] = list(prompt_ids)
        self.prompt_lens[slot] = len(prompt_ids)
        self.seen[slot] = 0
        self.cache.free(slot)
        if self.prefix_cache is not None:  # the longest cached prefix goes in; the catch-up feeds the rest
            entry, self.seen[slot] = self.prefix_cache.match(prompt_ids)
            self.prefix_cache.load(entry, self.seen[slot], self.cache, slot)
            self.prefix_cache.count(len(prompt_ids), self.seen[slot])
        self.params[slot], self.generators[slot] = params, generator
        self._last[slot] = []
        if grammar is not None:
            self.grammars[slot] = grammar.copy()
            self._advanced[slot] = 0

    def end(self, slot):
        if self.prefix_cache is not None and slot in self.seen:  # what the cache holds of prompt + output
            self.prefix_cache.store(self.tokens[slot][: self.seen[slot]], self.cache, slot)
        for d in (self.tokens, self.prompt_lens, self.seen, self.params, self.generators, self._last, self.grammars, self._advanced):
            d.pop(slot, None)
        self.cache.free(slot)

    def accept(self, slot, num_accepted, token_id):
        m = self.grammars.get(slot)
        if m is not None:
            self._rewind_grammar(slot)
            kept = self._last[slot][:num_accepted] + [token_id]
            if m.advance_many(kept) != len(kept):
                raise GrammarError(f"the draft's grammar state refused the emitted tokens {kept}")
        old = len(self.tokens[slot])
        self.tokens[slot].extend(self._last[slot][:num_accepted])
        self.tokens[slot].append(token_id)
        self.seen[slot] = min(self.seen[slot], old + num_accepted)
        self.cache.truncate(slot, self.seen[slot])
        self._last[slot] = []

    # ---- proposing ----------------------------------------------------------------------------
    def propose(self, slots, k_per_seq, after=None):
        before = {s: list(after[i]) if after else [] for i, s in enumerate(slots)}
        for s in slots:
            self._rewind(s)
            self._last[s] = before[s]
            m = self.grammars.get(s)
            if m is not None and before[s]:
                self._advanced[s] = m.advance_many(before[s])
        active = [(s, k) for s, k in zip(slots, k_per_seq) if k > 0]
        out = {s: Draft(EMPTY_DRAFT_IDS) for s in slots}
        if active:
            act_slots = [s for s, _ in active]
            k_max = max(k for _, k in active)
            logits = self._catch_up(act_slots, before)  # [B, V_draft] next-token logits after each context
            guesses, probs = [[] for _ in active], [[] for _ in active]
            # a row stops at its k, or once its grammar admits nothing more; only live rows are fed on
            done = [s in self.grammars and self.grammars[s].is_finished() for s in act_slots]
            for step in range(k_max):
                for row, (s, k) in enumerate(active):
                    if done[row]:
                        continue
                    tok, p, conf = self._draw(s, logits[row], before[s] + guesses[row])
                    if tok is None:  # a trimmed head under a grammar that admits none of its ids
                        done[row] = True
                        continue
                    guesses[row].append(tok)
                    probs[row].append(p)
                    done[row] = (len(guesses[row]) >= k or conf < self.min_guess_prob
                                 or (s in self.grammars and self.grammars[s].is_finished()))
                live = [row for row in range(len(active)) if not done[row]]
                if not live:
                    break
                fed = self._forward([act_slots[r] for r in live], [[guesses[r][-1]] for r in live])  # [L, V]
                logits = {r: fed[i] for i, r in enumerate(live)}
            for row, (s, k) in enumerate(active):
                self._last[s] = before[s] + guesses[row][:k]
                if not guesses[row]:
                    continue
                q = None if self.params[s].greedy else torch.stack(probs[row][:k])
                out[s] = Draft(torch.tensor(guesses[row][:k], dtype=torch.int64), q)
        return [out[s] for s in slots]

    def _rewind_grammar(self, slot: int) -> None:
        """Back to the accepted output's grammar state (the last draft's advances undone)."""
        if slot in self.grammars:
            self.grammars[slot].rollback(self._advanced[slot])
            self._advanced[slot] = 0

    def _rewind(self, slot: int) -> None:
        """Start from the accepted context: drop whatever an earlier propose fed beyond it (its guesses, or a
        half-done forward of a step that failed and is being retried), so propose is idempotent. The last
        context token is always fed again (its logits start the guesses); after `accept` it is unseen anyway."""
        self.seen[slot] = min(self.seen[slot], len(self.tokens[slot]) - 1)
        self.cache.truncate(slot, self.seen[slot])  # a forward extends the cache before `seen` moves: never below
        self._rewind_grammar(slot)

    def _draw(self, slot: int, logits: torch.Tensor,  # logits [V_draft]
              drafted: list[int]) -> tuple[int | None, torch.Tensor | None, float]:
        """One guess, its q [V] (None under greedy) and the draft's probability of it, after the tokens `drafted`
        this step; (None, None, 0.0) when no kept id is allowed. The probability is only computed when
        `min_guess_prob` asks for it (1.0 otherwise)."""
        params = self.params[slot]
        logits = _fit_vocab(logits, self.target_vocab_size)
        m = self.grammars.get(slot)
        if m is not None:
            logits = mask_logits(logits, m.allowed(logits.shape[-1]))  # [V]: q lives on the allowed ids
            if self.head is not None and not bool(torch.isfinite(logits).any()):
                return None, None, 0.0  # the grammar admits no id of the trimmed head: no guess here
        if params.adjusts_logits:
            context, n = self.tokens[slot], self.prompt_lens[slot]
            logits = adjust_logits(logits[None], params, context[:n], context[n:] + drafted, [],
                                   params.stop_ids(self.eos_token_ids))[0]
        conf = 1.0
        if params.greedy:
            tok, q = int(greedy_ids(logits)), None
            if self.min_guess_prob > 0.0:  # the top probability: exp(max - logsumexp)
                row = logits.float()
                conf = float(torch.exp(row[tok] - torch.logsumexp(row, -1)))
        else:
            q = process_logits(logits[None], params.temperature, params.top_k, params.top_p, params.min_p)[0]  # [V]
            tok = int(sample(q[None], self.generators[slot])[0])
            conf = float(q[tok])
        if m is not None:
            if not m.advance(tok):
                raise GrammarError(f"the draft drew token {tok}, which its grammar mask forbids")
            self._advanced[slot] += 1
        return tok, q, conf

    def _catch_up(self, slots: list[int], before: dict[int, list[int]]) -> torch.Tensor:  # -> [B, V_draft]
        """Feed each slot every context token its cache lacks, then its `before` tokens; return logits after
        the last one. Rows with many unseen context tokens (a new prompt) go alone."""
        rows: dict[int, torch.Tensor] = {}
        small = []
        for s in slots:
            unseen = len(self.tokens[s]) - self.seen[s]
            if unseen > MAX_BATCHED_CATCH_UP:
                while len(self.tokens[s]) - self.seen[s] > CATCH_UP_CHUNK_TOKENS:  # a long prompt: chunk by chunk
                    self._forward([s], [self.tokens[s][self.seen[s] : self.seen[s] + CATCH_UP_CHUNK_TOKENS]])
                rows[s] = self._forward([s], [self.tokens[s][self.seen[s]:] + before[s]])[0]
            else:
                small.append(s)
        if small:
            feeds = [self.tokens[s][self.seen[s]:] + before[s] for s in small]
            for s, row in zip(small, self._forward(small, feeds)):
                rows[s] = row
        return torch.stack([rows[s] for s in slots])

    def _forward(self, slots: list[int], new_tokens: list[list[int]]) -> torch.Tensor:  # -> [B, V_draft]
        """One batched draft forward; rows padded to the longest; logits taken at each row's last real token."""
        T = max(len(t) for t in new_tokens)
        ids = torch.zeros(len(slots), T, dtype=torch.int64)
        pos = torch.zeros(len(slots), T, dtype=torch.int64)
        for r, (s, toks) in enumerate(zip(slots, new_tokens)):
            ids[r, : len(toks)] = torch.tensor(toks)
            pos[r] = self.seen[s] + torch.arange(T)  # padding sits past the real tokens and is rolled back below
        dev = self.model.device
        last = torch.tensor([len(t) - 1 for t in new_tokens], device=dev)
        # the head only at each row's last real token (a prompt's catch-up would otherwise score every position),
        # padding told apart by num_tokens (one attention call per layer)
        logits = self.model(ids.to(dev), pos.to(dev), self.cache, torch.tensor(slots, device=dev), logit_index=last,
                            num_tokens=[len(t) for t in new_tokens], head=self.head)  # [B, 1, V_draft]
        for s, toks in zip(slots, new_tokens):
            self.seen[s] += len(toks)
            self.cache.truncate(s, self.seen[s])
        return logits[:, 0].float()


# ---- the trimmed head (FR-Spec) ---------------------------------------------------------------------------

def kept_ids(draft_vocab_size: int, vocab: int, eos_token_ids) -> torch.Tensor:  # -> [N + extra] int64
    """The ids a trimmed head scores: [0, draft_vocab_size) (merge order ~ frequency order), then every EOS id
    beyond it (sorted), so the draft can still end a turn."""
    extra = sorted({int(e) for e in eos_token_ids if draft_vocab_size <= int(e) < vocab})
    return torch.cat([torch.arange(draft_vocab_size), torch.tensor(extra, dtype=torch.int64)])


class TrimmedHead(nn.Module):
    """hidden [..., H] -> logits [..., V] with the scores of `ids` only and -inf elsewhere.

    `ids` [M]: a prefix 0..n-1 then any other ids (the EOS ids). Both parts are the head's own `rows`
    (kernels/linear.py: a view of the first n weight rows for the prefix — q4x8 blocks, dense rows —, the rest
    a small module over just their rows); a head whose layout has no rows (torch int4) is computed whole once
    and the kept ids picked (the same logits, no saving)."""

    def __init__(self, head: nn.Module, vocab: int, ids: torch.Tensor):  # ids [M] int64
        super().__init__()
        n = int((ids == torch.arange(len(ids))).cumprod(0).sum())  # length of the 0..n-1 prefix
        self.first = linear.rows(head, ids[:n]) if n else None  # [..., n]
        if self.first is not None and _whole(self.first):  # no rows in this layout: one pass over the whole head
            self.first, n = None, 0
        self.vocab, self.n = vocab, n
        self.rest_ids = ids[n:]  # [M - n]
        self.rest = linear.rows(head, self.rest_ids) if len(self.rest_ids) else None
        # weight rows read per token (x hidden = the head's weights; the full head reads `vocab` rows)
        self.rows_read = sum(_rows_read(m) for m in (self.first, self.rest) if m is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., H] -> logits [..., V]
        parts = [m(x) for m in (self.first, self.rest) if m is not None]  # [..., n], [..., M - n]
        out = torch.full((*parts[0].shape[:-1], self.vocab), float("-inf"), dtype=parts[0].dtype,
                         device=parts[0].device)
        if self.first is not None:
            out[..., : self.n] = parts[0]
        if self.rest is not None:
            out[..., self.rest_ids.to(out.device)] = parts[-1].to(out.dtype)
        return out


def _whole(module: nn.Module) -> bool:
    """Does this prefix module compute its source's every output (a layout without rows: linear.Columns)? (A
    prefix of q4x8 or dense rows is a view, never Columns.)"""
    if isinstance(module, linear.SplitLinear):
        return _whole(module.step)
    return isinstance(module, linear.Columns)


def _rows_read(module: nn.Module) -> int:
    """Weight rows a head part reads per call (q4x8: whole 16-column blocks; the whole head for a fallback)."""
    if isinstance(module, linear.Columns):
        return _rows_read(module.module)
    if isinstance(module, linear.SplitLinear):  # one half runs per call
        return _rows_read(module.step)
    return int(module.out_features)


def _fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft and target may differ only by padded embedding rows: cut or pad the draft's logits to the target's."""
    n = logits.shape[-1]
    if n == vocab:
        return logits
    if n > vocab:
        return logits[..., :vocab]
    pad = torch.full((*logits.shape[:-1], vocab - n), float("-inf"), dtype=logits.dtype, device=logits.device)
    return torch.cat([logits, pad], dim=-1)


def check_compatible(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Same vocabulary (token strings, ids and special tokens) or a clear error naming the first difference."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        only_t = sorted(set(tv) - set(dv))[:3]
        only_d = sorted(set(dv) - set(tv))[:3]
        moved = [t for t in tv if t in dv and tv[t] != dv[t]][:3]
        raise ConfigError(
            f"draft {draft_name!r} does not share the tokenizer of target {target_name!r} "
            f"({len(tv)} vs {len(dv)} tokens; only in target: {only_t}; only in draft: {only_d}; "
            f"different ids: {moved})"
        )
    if tuple(target_tok.eos_token_ids) != tuple(draft_tok.eos_token_ids) or target_tok.bos_token_id != draft_tok.bos_token_id:
        raise ConfigError(
            f"draft {draft_name!r} special tokens differ from target {target_name!r}: "
            f"bos {draft_tok.bos_token_id} vs {target_tok.bos_token_id}, eos {draft_tok.eos_token_ids} vs {target_tok.eos_token_ids}"
        )
