"""Draft-model proposer: a smaller causal LM with its own KV cache guesses k tokens autoregressively.

Owns the draft's per-slot token history and cache length. After the target's verdict it rolls its cache back
with `truncate` (the only rollback); the all-accepted case — the last guess was never fed to the draft — is
handled by feeding every token the draft has not seen yet on the next call. Draft distributions are processed
with the request's own temperature/top-k/top-p so rejection sampling compares like with like.
Knows nothing of the target model or the engine's scheduling.
"""
from __future__ import annotations

import torch

from draftwise.config import ConfigError
from draftwise.kv_cache import KVCache
from draftwise.sampling import SamplingParams, process_logits, sample
from draftwise.spec_decode.proposer import EMPTY_DRAFT_IDS, Draft

MAX_BATCHED_CATCH_UP = 4  # rows with more unseen tokens than this (a new prompt) are prefilled alone


def draft_cache_capacity(max_model_len: int, max_lookahead: int) -> int:
    """Tokens per slot in the draft's KV cache: the context, k guesses, a batched catch-up and two spare
    positions (the draft may run one token ahead of the target's context before a rollback)."""
    return max_model_len + max_lookahead + MAX_BATCHED_CATCH_UP + 2


class DraftModelProposer:
    def __init__(self, model, num_slots: int, capacity: int, target_vocab_size: int):
        c = model.config
        self.model = model
        self.cache = KVCache(c.num_layers, num_slots, c.num_kv_heads, capacity, c.head_dim, model.dtype, model.device)
        self.target_vocab_size = target_vocab_size
        self.tokens: dict[int, list[int]] = {}  # context per slot: prompt + accepted output
        self.seen: dict[int, int] = {}  # tokens of `tokens` (then of the guesses) held in the draft cache
        self.params: dict[int, SamplingParams] = {}
        self.generators: dict[int, torch.Generator] = {}
        self._last: dict[int, list[int]] = {}

    def begin(self, slot, prompt_ids, params, generator):
        self.tokens[slot] = list(prompt_ids)
        self.seen[slot] = 0
        self.cache.free(slot)
        self.params[slot], self.generators[slot] = params, generator
        self._last[slot] = []

    def end(self, slot):
        for d in (self.tokens, self.seen, self.params, self.generators, self._last):
            d.pop(slot, None)
        self.cache.free(slot)

    def accept(self, slot, num_accepted, token_id):
        old = len(self.tokens[slot])
        self.tokens[slot].extend(self._last[slot][:num_accepted])
        self.tokens[slot].append(token_id)
        self.seen[slot] = min(self.seen[slot], old + num_accepted)
        self.cache.truncate(slot, self.seen[slot])
        self._last[slot] = []

    # ---- proposing ----------------------------------------------------------------------------
    def propose(self, slots, max_tokens):
        active = [(s, k) for s, k in zip(slots, max_tokens) if k > 0]
        out = {s: Draft(EMPTY_DRAFT_IDS) for s in slots}
        if active:
            act_slots = [s for s, _ in active]
            k_max = max(k for _, k in active)
            logits = self._catch_up(act_slots)  # [B, V_draft] next-token logits after each context
            guesses, probs = [[] for _ in active], [[] for _ in active]
            for step in range(k_max):
                for row, s in enumerate(act_slots):
                    tok, p = self._draw(s, logits[row])
                    guesses[row].append(tok)
                    probs[row].append(p)
                if step + 1 < k_max:
                    logits = self._forward(act_slots, [[g[-1]] for g in guesses])
            for row, (s, k) in enumerate(active):
                self._last[s] = guesses[row][:k]
                q = None if self.params[s].greedy else torch.stack(probs[row][:k])
                out[s] = Draft(torch.tensor(guesses[row][:k], dtype=torch.int64), q)
        return [out[s] for s in slots]

    def _draw(self, slot: int, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:  # logits [V_draft]
        params = self.params[slot]
        logits = _fit_vocab(logits, self.target_vocab_size)
        if params.greedy:
            return int(logits.argmax()), None
        q = process_logits(logits[None], params.temperature, params.top_k, params.top_p)  # [1, V]
        return int(sample(q, self.generators[slot])[0]), q[0]

    def _catch_up(self, slots: list[int]) -> torch.Tensor:  # -> [B, V_draft]
        """Feed each slot every context token its cache lacks; return logits after the last one."""
        rows: dict[int, torch.Tensor] = {}
        small = []
        for s in slots:
            unseen = len(self.tokens[s]) - self.seen[s]
            if unseen > MAX_BATCHED_CATCH_UP:
                rows[s] = self._forward([s], [self.tokens[s][self.seen[s]:]])[0]
            else:
                small.append(s)
        if small:
            for s, row in zip(small, self._forward(small, [self.tokens[s][self.seen[s]:] for s in small])):
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
        logits = self.model(ids.to(dev), pos.to(dev), self.cache, torch.tensor(slots, device=dev))
        last = torch.tensor([len(t) - 1 for t in new_tokens], device=dev)
        for s, toks in zip(slots, new_tokens):
            self.seen[s] += len(toks)
            self.cache.truncate(s, self.seen[s])
        return logits[torch.arange(len(slots), device=dev), last].float()


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
