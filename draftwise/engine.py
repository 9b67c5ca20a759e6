"""The engine: continuous batching of requests over one target decoder and one proposer.

step(), numbered as docs/ARCHITECTURE.md's "One request, end to end" (1., the tokens, is LLM.new_request's):
2. admit and prefill: the scheduler (scheduler.py) gives waiting requests free slots under a prompt-token budget
   while the K/V pool has room (it also owns preemption: when a forward finds the pool short, the youngest running
   request gives its blocks back and is prefilled again later from prompt + output); each admitted prompt is
   prefilled from the end of its longest prefix in the prefix cache (those blocks shared, not copied); where prompt
   rows are bitwise decode rows its first guesses ride along and are verified like a step's;
3. propose up to k guesses per running sequence (one k decision for the batch);
4. mask: under structured outputs, cut each draft at its first token the grammar forbids;
5. one batched target forward over [pending token, guesses...] for every sequence, ragged: each token a row of its
   own, so a sequence that does not guess costs one token, not the widest sequence's width (`_verify_forward`);
6. verify each row (pure; under a grammar row i masked by the state after guesses 1..i; penalties, bias and
   min_tokens from the history through guess i: sampling.adjust_logits);
7. truncate the target cache to what was accepted;
8. emit tokens (advancing the grammar state along them, and only them).
Plain decoding is the same path with a proposer that never guesses. A draft may be a token tree (Draft.parents): the
same forward with each row attending its ancestors only, a greedy walk down the tree as the verification, and the
accepted path's K/V moved to consecutive positions before the rollback.

A failing step fails only the request(s) it can be pinned on: a batched prefill that raises is retried prompt by
prompt; a decode step that raises is rolled back (truncate, generator states) and retried once; whatever still
fails finishes with finish_reason "error" and `Request.error`, and step() goes on. When the proposer declares a
vocab_limit (a draft with fewer embedding rows), prompts beyond it are refused and sampling is masked to it.

The engine knows token ids, not text or HTTP: stop strings are checked by a per-request callback. Which request
holds a slot, and who gives blocks back, is the scheduler's.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from draftwise.config import ConfigError, ContextLengthError
from draftwise.kernels.threads import ThreadGuard
from draftwise.kv_cache import CacheFull, KVCache, target_cache_capacity
from draftwise.models.transformer import Decoder
from draftwise.prefix_cache import PrefixCache
from draftwise.scheduler import Scheduler
from draftwise.sampling import SamplingParams, TokenLogprob, adjust_logits, make_generator, token_logprobs
from draftwise.spec_decode.adaptive import FixedK, KPolicy, choose_batch, observe_step, ragged_width
from draftwise.spec_decode.proposer import EMPTY_DRAFT_IDS, Draft, Proposer
from draftwise.spec_decode import tree
from draftwise.spec_decode.stats import SpecStats
from draftwise.spec_decode.verify import verify
from draftwise.structured.matcher import GrammarError, GrammarMatcher, mask_logits


# a longer prompt is prefilled in forwards of at most this many tokens, so its activations (the MLP's are ~12 KiB a
# token on the 1.5B) follow the chunk, not the prompt; where rows are exact the result is bitwise one forward's
PREFILL_CHUNK_TOKENS = 2048


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # called with each new token id; returns True when a stop string completed (the API layer owns text)
    on_token: Callable[[int], bool] | None = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # what failed, when finish_reason is "error" (its step raised; others went on)
    slot: int | None = None
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    spec_stats: SpecStats = field(default_factory=SpecStats)
    prompt_text: str | None = None  # carried for the caller's output; the engine never reads it
    speculate: bool = True  # False: this request decodes plainly (k = 0 every step) whatever the policy says
    grammar: object | None = None  # structured.CompiledGrammar of params.structured_outputs (LLM.new_request)
    matcher: GrammarMatcher | None = None  # the output's grammar state: the engine advances it along emitted ids
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (not recomputed)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, when params.logprobs is set
    cache_scope: str = ""  # whose earlier outputs the proposer may guess from (the server: one per API key)
    num_preemptions: int = 0  # times the K/V pool ran out and this request gave its blocks back (Engine._preempt)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def context_ids(self) -> list[int]:
        """What a prefill feeds: the prompt, and after a preemption the output so far too."""
        return self.prompt_ids + self.output_ids


@dataclass
class StepOutput:
    request: Request
    new_token_ids: list[int]
    finished: bool
    k: int = 0  # guesses in this step's draft (0: a prefill or plain step)
    # the first num_accepted of new_token_ids are accepted guesses; the one after them (if emitted) is the
    # target's own recovered or bonus token
    num_accepted: int = 0


class Engine:
    def __init__(
        self,
        target: Decoder,
        proposer: Proposer,
        k_max: int,
        max_num_seqs: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        seed: int = 0,
        k_policy: KPolicy | None = None,
        thread_guard: ThreadGuard | None = None,
        prefix_cache: PrefixCache | None = None,
        speculate_in_prefill: bool = False,
        kv_cache_blocks: int | None = None,  # the K/V pool (kv_cache.py); None: every slot at full context
        kv_cache_dtype: torch.dtype | None = None,  # K/V storage; None: the target's activation dtype
    ):
        c = target.config
        self.target = target
        self.thread_guard = thread_guard  # fewer torch threads while other processes hold cores (kernels/threads.py)
        self.prefix_cache = prefix_cache  # K/V of recent prompts: a prompt's cached prefix is not recomputed
        # the prefill forward also verifies the first draft: only where a prompt's rows are bitwise the rows a
        # decode step computes at those positions (KernelPlan.row_exact, kernels/plan.py), or greedy output could change
        self.speculate_in_prefill = speculate_in_prefill
        self.k_max = k_max  # the most guesses any step may verify: sizes the cache's look-ahead
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.seed = seed
        capacity = target_cache_capacity(max_model_len, k_max)
        self.cache = KVCache(c.num_layers, max_num_seqs, c.num_kv_heads, capacity, c.head_dim,
                             kv_cache_dtype or target.dtype, target.device, num_blocks=kv_cache_blocks)
        # admission, preemption and the block budget (scheduler.py); the engine runs what it admits
        self.scheduler = Scheduler(self.cache, prefix_cache, max_num_seqs, max_model_len, k_max)
        self.set_speculation(proposer, k_policy or FixedK(k_max))
        self.stats = SpecStats()  # engine-wide
        self._counter = itertools.count()
        self._pending: dict[int, int] = {}  # slot -> last emitted token, not yet in the target cache

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        need = len(req.prompt_ids) + req.params.max_tokens
        if not req.prompt_ids:
            raise ConfigError("the prompt is empty")
        if need > self.max_model_len:
            raise ContextLengthError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.params.max_tokens}) = {need} tokens "
                f"exceeds the context length of {self.max_model_len} tokens"
            )
        self.check_vocab_limit(req.prompt_ids)
        if req.params.structured_outputs is not None and req.grammar is None:
            raise ConfigError("structured_outputs need the grammar compiled for the tokenizer (LLM.new_request)")
        if req.grammar is not None and req.matcher is None:
            req.matcher = req.grammar.matcher()
        if req.generator is None:
            req.generator = make_generator(req.params.seed, self.seed + next(self._counter), str(self.target.device))
        self.scheduler.add(req)  # refused when its claim exceeds the pool

    def abort(self, request_id: str) -> None:
        self.scheduler.remove_waiting([r for r in self.waiting if r.request_id == request_id])
        for r in list(self.running):
            if r.request_id == request_id:
                self._finish(r, "abort")

    def set_speculation(self, proposer: Proposer, k_policy: KPolicy) -> None:
        """Switch proposer and k policy (fixed k, or spec_decode/adaptive.AdaptiveK's cost model) between runs:
        only while idle, and only for a policy whose k fits the cache's look-ahead."""
        if self.has_unfinished():
            raise RuntimeError("set_speculation needs an idle engine")
        if k_policy.k_max > self.k_max:
            raise ConfigError(f"num_speculative_tokens {k_policy.k_max} exceeds this engine's look-ahead of "
                              f"{self.k_max} tokens (its KV cache was sized for that)")
        self.proposer, self.k_policy = proposer, k_policy

    @property
    def vocab_limit(self) -> int | None:
        """The proposer's vocab_limit (spec_decode/proposer.py): prompts must stay below it and the target's
        sampling is masked to it; None = the target's whole vocabulary."""
        return getattr(self.proposer, "vocab_limit", None)

    def check_vocab_limit(self, prompt_ids: list[int]) -> None:
        limit = self.vocab_limit
        bad = [t for t in prompt_ids if limit is not None and t >= limit]
        if bad:
            raise ConfigError(f"prompt token id {bad[0]} cannot be used with this draft model: it embeds only ids "
                              f"0..{limit - 1} (the target has {self.target.config.vocab_size})")

    def _shared_vocab(self, logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [..., V]
        """Ids at or beyond vocab_limit get -inf: greedy, p and the first token never pick what the draft can't
        embed (the draft's own q is already zero there), so verification stays exact under the mask."""
        limit = self.vocab_limit
        if limit is None or limit >= logits.shape[-1]:
            return logits
        beyond = torch.arange(limit, logits.shape[-1], device=logits.device)
        return logits.index_fill(-1, beyond, float("-inf"))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def waiting(self) -> list[Request]:  # queued for a slot (the scheduler's queue)
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:  # holding a slot, in admission order
        return self.scheduler.running

    @property
    def num_free_slots(self) -> int:
        return len(self.scheduler.free_slots)

    def _preempt(self, r: Request) -> None:
        """The pool ran out: r lets go of the engine's state for its slot (pending token, the proposer's), then the
        scheduler takes its slot and blocks and queues it first; re-admitted, its prompt and output so far are
        prefilled again (bitwise the K/V it had, where rows are exact: KernelPlan.row_exact) and it goes on from its
        pending token, its output unchanged."""
        self._pending.pop(r.slot, None)
        self.proposer.end(r.slot)
        self.scheduler.preempt(r)

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One step, as docs/ARCHITECTURE.md numbers it: the scheduler admits and the admitted are prefilled (2),
        then one decode step over every running sequence with a pending token: propose (3), mask (4), one
        forward (5), pure verify (6), truncate (7), emit (8): `_decode_step`, `_settle`."""
        if self.thread_guard is not None:
            self.thread_guard.tick()
        outputs: list[StepOutput] = []
        admitted = self.scheduler.schedule()  # 2. slots for the waiting, under the prompt-token and block budgets,
        if admitted:
            outputs.extend(self._prefill(admitted))  # and their prefill (its first draft verified inside, where exact)
        decoding = [r for r in self.running if r.slot in self._pending]
        if decoding:
            outputs.extend(self._decode(decoding))  # 3.-8.
        return outputs

    def _prefill(self, reqs: list[Request]) -> list[StepOutput]:
        """The proposer learns each prompt and, where the prefill verifies guesses (`speculate_in_prefill`),
        guesses after it; one batched forward over the new prompts (right-padded), each followed by its guesses;
        then each one is verified and emits like a decode step (without guesses: its first token). If the
        batched forward fails (e.g. out of memory in one big prefill), each prompt is retried alone and only one
        that still fails finishes with "error"; the others proceed."""
        outputs, begun = [], []
        for r in reqs:  # each holds a slot (scheduler.schedule)
            try:
                self.proposer.begin(r.slot, r.context_ids, r.params, r.generator, r.matcher, scope=r.cache_scope)
                begun.append(r)
            except Exception as e:  # noqa: BLE001
                outputs.append(self._fail(r, e))
        reqs = begun
        drafts, masks = self._first_drafts(reqs)
        try:
            rows = list(zip(reqs, drafts, masks, self._prefill_forward(reqs, drafts)))
        except Exception as e:  # noqa: BLE001 — which prompt caused it is unknown: each one alone
            if len(reqs) == 1:
                return outputs + [self._fail(reqs[0], e)]
            rows = []
            for r, d, m in zip(reqs, drafts, masks):
                try:
                    rows.append((r, d, m, self._prefill_forward([r], [d])[0]))
                except Exception as e_alone:  # noqa: BLE001 — this prompt fails on its own: only it ends
                    outputs.append(self._fail(r, e_alone))
        for r, d, mask, row_logits in rows:
            try:
                if self.prefix_cache is not None and not r.num_preemptions:
                    self.prefix_cache.count(len(r.prompt_ids), r.num_cached_tokens)
                    self.prefix_cache.store(r.prompt_ids, self.cache, r.slot)
                # the last prompt token plays the pending token's part: the cache keeps the prompt + what is accepted
                outputs.append(self._settle(r, d, row_logits, len(r.context_ids) - 1, mask, prefill=True))
            except Exception as e:  # noqa: BLE001
                outputs.append(self._fail(r, e))
        return outputs

    def _first_drafts(self, reqs: list[Request]) -> tuple[list[Draft], list[torch.Tensor | None]]:
        """Each new request's first draft, cut by its grammar, and the masks of its rows (mask [k + 1, V]).
        No guesses unless the prefill verifies them; a proposer that fails here leaves the requests unguessed."""
        # the admitted prompts' first guesses as one batch decision (a draft model reads each prompt to guess)
        k_per_seq = (choose_batch(self.k_policy, reqs, [self._room(r, len(r.context_ids) - 1) for r in reqs])
                     if self.speculate_in_prefill else [0] * len(reqs))
        drafts = [Draft(EMPTY_DRAFT_IDS) for _ in reqs]
        if any(k_per_seq):
            try:
                drafts = self.proposer.propose([r.slot for r in reqs], k_per_seq)
            except Exception:  # noqa: BLE001 — guessing is optional; the first decode step guesses again
                pass
        cut = [self._grammar_cut(r, _chain_prefix(d)) for r, d in zip(reqs, drafts)]
        return [d for d, _ in cut], [m for _, m in cut]

    def _prefill_forward(self, reqs: list[Request], drafts: list[Draft]) -> list[torch.Tensor]:
        """-> per request [1 + k, V]: the logits at its last prompt token and at each of its k guesses."""
        dev = self.target.device
        starts = [self._load_prefix(r) for r in reqs]  # each prompt's tokens already in its slot (prefix cache)
        contexts = [r.context_ids for r in reqs]  # the prompt (and a preempted request's output so far)
        for i, r in enumerate(reqs):  # all but the last chunk of a long prompt, chunk by chunk, no logits kept
            while len(contexts[i]) + drafts[i].num_tokens - starts[i] > PREFILL_CHUNK_TOKENS:
                size = min(PREFILL_CHUNK_TOKENS, len(contexts[i]) - 1 - starts[i])  # the last token: with logits
                if size <= 0:
                    break
                chunk = contexts[i][starts[i] : starts[i] + size]
                self.target(torch.tensor([chunk], device=dev), torch.arange(starts[i], starts[i] + len(chunk),
                            device=dev)[None], self.cache, torch.tensor([r.slot], device=dev), last_only=True,
                            num_tokens=[len(chunk)])
                starts[i] += len(chunk)
        rows = [c[s:] + d.token_ids.tolist() for c, s, d in zip(contexts, starts, drafts)]
        width = max(len(row) for row in rows)
        if max(starts) + width > self.cache.capacity:  # padding after a long cached prefix would not fit: alone
            return [self._prefill_forward([r], [d])[0] for r, d in zip(reqs, drafts)]
        ids = torch.zeros(len(reqs), width, dtype=torch.int64)
        for row, tokens in enumerate(rows):
            ids[row, : len(tokens)] = torch.tensor(tokens)
        # each row from its first uncached position; padding sits past each prompt + guesses: rolled back
        pos = torch.tensor(starts)[:, None] + torch.arange(width)[None]
        num_tokens = [len(row) for row in rows]
        k_per_seq = [d.num_tokens for d in drafts]
        # [B, 1 + max k]: the last prompt token's row and each guess's, repeated past a row's own k (sliced off)
        index = torch.tensor([[min(n - 1 - k + j, n - 1) for j in range(1 + max(k_per_seq))] for n, k in zip(num_tokens, k_per_seq)],
                             device=dev)
        slots = torch.tensor([r.slot for r in reqs], device=dev)
        logits = self._shared_vocab(self.target(ids.to(dev), pos.to(dev), self.cache, slots, logit_index=index,
                                                num_tokens=num_tokens))  # [B, 1 + max k, V]
        return [logits[row, : 1 + k] for row, k in enumerate(k_per_seq)]

    def _load_prefix(self, r: Request) -> int:
        """Empty r's slot, then fill it with the longest cached prefix of its prompt; returns that length."""
        self.cache.free(r.slot)
        r.num_cached_tokens = 0
        if self.prefix_cache is not None:
            entry, r.num_cached_tokens = self.prefix_cache.match(r.context_ids)
            self.prefix_cache.load(entry, r.num_cached_tokens, self.cache, r.slot)
        return r.num_cached_tokens

    def _decode(self, reqs: list[Request]) -> list[StepOutput]:
        """One decode step over reqs; when the K/V pool runs out, the youngest running request is preempted and
        the step runs again without it."""
        while True:
            try:
                return self._decode_step(reqs)
            except CacheFull:  # rolled back already: free the youngest request's blocks, then again
                victim = self.scheduler.preemption_victim()
                self._preempt(victim)
                reqs = [r for r in reqs if r is not victim]
                if not reqs:
                    return []

    def _decode_step(self, reqs: list[Request]) -> list[StepOutput]:
        """Phases 3.-8. over reqs: propose, mask, one forward (retried once, rolled back first), then per row
        verify, truncate, emit (`_settle`); the step's timing goes to the stats and the k policy."""
        slots = [r.slot for r in reqs]
        # 3. one decision for the whole batch: each row's k (0 = plain) within its room (adaptive.choose_batch)
        k_per_seq = choose_batch(self.k_policy, reqs, [self._room(r) for r in reqs])
        base_lengths = [self.cache.lengths[s] for s in slots]
        rng_states = [r.generator.get_state() for r in reqs]  # a retried step draws the same numbers
        for attempt in (1, 2):
            try:
                t0 = time.perf_counter()
                drafts = self.proposer.propose(slots, k_per_seq)  # 3. propose
                t1 = time.perf_counter()
                # 4. mask: cut at the grammar's first forbidden guess (rejected at no cost) and keep the k+1 masks
                drafts, masks = zip(*(self._grammar_cut(r, d) for r, d in zip(reqs, drafts)))
                logits = self._verify_forward(reqs, drafts)  # 5. one forward: per row [1 + k, V]
                break
            except Exception as e:  # noqa: BLE001 — a failed batched step can't be pinned on one request
                # roll back to the pre-step state (propose is idempotent between accepts), then retry once
                for r, n, state in zip(reqs, base_lengths, rng_states):
                    self.cache.truncate(r.slot, n)
                    r.generator.set_state(state)
                if isinstance(e, CacheFull) and len(self.running) > 1:
                    raise  # _decode preempts a request and runs the step again
                if attempt == 2:
                    return [self._fail(r, e) for r in reqs]
        outputs = []
        for row, (r, d) in enumerate(zip(reqs, drafts)):
            try:  # 6.-8. verify, truncate, emit
                outputs.append(self._settle(r, d, logits[row], base_lengths[row], masks[row]))
            except Exception as e:  # noqa: BLE001 — this request's own verification or emission failed
                outputs.append(self._fail(r, e))
        t2 = time.perf_counter()
        share = 1.0 / len(reqs)
        for r, d in zip(reqs, drafts):
            if d.num_tokens:
                r.spec_stats.add_times((t1 - t0) * share, (t2 - t1) * share)
        if any(d.num_tokens for d in drafts):
            self.stats.add_times(t1 - t0, t2 - t1)
        self.stats.record_decision(sum(k > 0 for k in k_per_seq), len(reqs))
        if attempt == 1:  # the step's own cost corrects the policy's grid (no extra forward): a ragged step computed
            # sum(1 + k) tokens, B rows of exactly as many tokens (a fractional width); a padded one B x the widest
            guesses = [d.num_tokens for d in drafts]
            trees = any(d.parents is not None for d in drafts)
            width = 1 + max(guesses) if trees else ragged_width(guesses)
            observe_step(self.k_policy, len(reqs), width, t2 - t1, t1 - t0, k_per_seq)
        return outputs

    def _verify_forward(self, reqs: list[Request], drafts: list[Draft]) -> list[torch.Tensor]:  # each [1 + k, V]
        """One target forward over [pending token, guesses...] of every sequence, ragged: each token is a row of
        its own (its slot's block table, its position), so the forward computes sum(1 + k) tokens, not B x the
        widest row's width — a sequence that does not guess costs one token. Each row stays exact: every layer
        writes the whole chunk's K/V before any row attends, and a row attends exactly its keys (row-exact
        attention), so its bits are a plain step's at its position whatever the batch and the other widths. A
        batch with a token tree (whose rows attend within their chunk) is padded instead: `_padded_verify_forward`."""
        if any(d.parents is not None for d in drafts):
            return self._padded_verify_forward(reqs, drafts)
        dev = self.target.device
        counts = [1 + d.num_tokens for d in drafts]
        ids, pos, slots = [], [], []
        for r, d, n in zip(reqs, drafts, counts):
            base = self.cache.lengths[r.slot]
            ids += [self._pending[r.slot], *d.token_ids.tolist()]
            pos += range(base, base + n)
            slots += [r.slot] * n
        # a slot is named once per token in the forward: its blocks are taken here, once per sequence, all or none
        # (CacheFull); the forward's own reserve then finds them held
        self.cache.reserve([r.slot for r in reqs], [self.cache.lengths[r.slot] + n for r, n in zip(reqs, counts)])
        logits = self.target(torch.tensor(ids, device=dev)[:, None], torch.tensor(pos, device=dev)[:, None],
                             self.cache, torch.tensor(slots, device=dev), num_tokens=[1] * len(ids))  # [N, 1, V]
        return list(self._shared_vocab(logits[:, 0]).split(counts))  # each [1 + k, V]

    def _padded_verify_forward(self, reqs: list[Request], drafts: list[Draft]) -> torch.Tensor:  # [B, 1 + max k, V]
        """The forward with every sequence a row padded to the widest draft (token trees: _tree_inputs); padding
        lands past each row's end and is rolled back."""
        width = 1 + max(d.num_tokens for d in drafts)
        dev = self.target.device
        ids = torch.zeros(len(reqs), width, dtype=torch.int64)
        pos = torch.zeros(len(reqs), width, dtype=torch.int64)
        for row, (r, d) in enumerate(zip(reqs, drafts)):
            ids[row, 0] = self._pending[r.slot]
            ids[row, 1 : 1 + d.num_tokens] = d.token_ids
            pos[row] = self.cache.lengths[r.slot] + torch.arange(width)
        slots = torch.tensor([r.slot for r in reqs], device=dev)
        tree_args = self._tree_inputs(drafts, pos, dev) if any(d.parents is not None for d in drafts) else {}
        # num_tokens: row-exact attention, so each verified row equals the plain decode step at its position
        logits = self.target(ids.to(dev), pos.to(dev), self.cache, slots,
                             num_tokens=[1 + d.num_tokens for d in drafts], **tree_args)  # [B, width, V]
        return self._shared_vocab(logits)

    # ---- token trees (spec_decode/tree.py): a draft with parents, verified in the same one forward ----------------
    @staticmethod
    def _tree_inputs(drafts: list[Draft], pos: torch.Tensor, dev) -> dict[str, torch.Tensor]:  # pos [B, width]
        """The forward's tree arguments when some draft is a tree: each row's ancestor mask and RoPE position (the
        chunk's first position + its depth); a chain in the batch is the tree whose parents are the row before."""
        ancestors = torch.zeros(pos.shape, dtype=torch.int64)
        rope = pos.clone()
        for row, d in enumerate(drafts):
            parents = d.parents if d.parents is not None else tuple(range(d.num_tokens))
            n = 1 + d.num_tokens
            ancestors[row, :n] = torch.tensor(tree.ancestor_masks(parents))
            rope[row, :n] = pos[row, 0] + torch.tensor(tree.depths(parents))
        return {"ancestors": ancestors.to(dev), "rope_positions": rope.to(dev)}

    def _settle(self, r: Request, d: Draft, logits: torch.Tensor, base_length: int,  # logits [width, V]
                mask: torch.Tensor | None = None,  # [k + 1, V] bool (structured outputs)
                prefill: bool = False) -> StepOutput:
        """Verify one sequence's draft (pure), roll its cache back to what was accepted, emit."""
        k = d.num_tokens
        rows = self._masked(r, logits[: k + 1], mask)  # [k + 1, V]
        if r.params.adjusts_logits:  # penalties, bias, min_tokens: row i from the history through guess i (as q)
            d = _chain_prefix(d)  # a history is a chain (tree proposers give such requests chains anyway)
            rows = adjust_logits(rows[: d.num_tokens + 1], r.params, r.prompt_ids, r.output_ids,
                                 d.token_ids.tolist(), r.params.stop_ids(self.eos_token_ids))
        # 6. pure verify
        res = verify(d.token_ids.to(logits.device), d.probs, rows, r.params, r.generator, d.parents,
                     position=len(r.output_ids))  # position-addressed draws: a resumed request draws the same
        # 7. truncate: a tree's accepted path's K/V to consecutive positions first, then the rollback
        if res.path is not None:
            self.cache.compact(r.slot, base_length, [0, *res.path])
        self.cache.truncate(r.slot, base_length + 1 + res.num_accepted)
        if k:
            self.k_policy.observe(r, k, res.num_accepted)  # the policy learns what the target agreed with
        slot = r.slot
        emitted = self._emit(r, res.token_ids)  # 8. emit, up to a stop
        if r.params.logprobs is not None:  # the target's raw rows, the same bits with or without guesses
            at = [0, *res.path] if res.path is not None else list(range(len(emitted)))  # a tree: its path's rows
            r.logprobs.extend(token_logprobs(logits[at[: len(emitted)]], emitted, r.params.logprobs))
        # accepted guesses discarded after a stop (EOS, stop string) inside the run do not count as accepted;
        # every step is counted in the k histogram (k = 0: a plain step, e.g. chosen by the adaptive policy)
        num_accepted = min(res.num_accepted, len(emitted))
        if k or not prefill:  # a prefill without guesses (the first token) is not a decode step
            r.spec_stats.record(k, num_accepted, forced=d.forced)
            self.stats.record(k, num_accepted, forced=d.forced)
        if not r.finished and res.path is None:
            self.proposer.accept(slot, res.num_accepted, res.token_ids[-1])
        elif not r.finished:
            self.proposer.accept(slot, res.num_accepted, res.token_ids[-1], path=res.path)
        return StepOutput(r, emitted, r.finished, k, num_accepted)

    # ---- structured outputs -------------------------------------------------------------------
    def _grammar_cut(self, r: Request, d: Draft) -> tuple[Draft, torch.Tensor | None]:  # mask [k' + 1, V] bool
        """Under a grammar: the draft cut before its first forbidden token (k' <= k guesses) and the masks of
        the k' + 1 positions verification scores (row i: the state after guesses 1..i); (d, None) without."""
        if r.matcher is None:
            return d, None
        d = _chain_prefix(d)  # the grammar walks a chain (tree proposers give such requests chains anyway)
        t0 = time.perf_counter()
        masks, num_valid = r.matcher.masks_along(d.token_ids, self.target.config.vocab_size)  # [k + 1, V]
        if not masks[0].any():  # only a tokenizer that cannot spell the constraint's next bytes gets here
            raise GrammarError("no token of the vocabulary can continue the output under its constraint")
        if num_valid < d.num_tokens:
            d = Draft(d.token_ids[:num_valid], None if d.probs is None else d.probs[:num_valid],
                      tuple(i for i in d.forced if i < num_valid))
        self._charge_mask(r, t0)
        return d, masks[: num_valid + 1]

    def _masked(self, r: Request, logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:  # [n, V]
        if mask is None:
            return logits
        t0 = time.perf_counter()
        out = mask_logits(logits, mask)
        self._charge_mask(r, t0)
        return out

    def _advance_grammar(self, r: Request, tok: int) -> None:
        t0 = time.perf_counter()
        if not r.matcher.advance(tok):
            raise GrammarError(f"token {tok} was emitted but the grammar forbids it here")
        self._charge_mask(r, t0)

    def _charge_mask(self, r: Request, t0: float) -> None:
        dt = time.perf_counter() - t0
        r.spec_stats.mask_time_s += dt
        self.stats.mask_time_s += dt

    def _room(self, req: Request, context: int | None = None) -> int:
        """The most guesses req's next step may hold: 0 for a request that opted out (plain steps through the same
        path), else within k_max, max_tokens and the context (the pending token takes one position); `context`:
        tokens in its cache before the pending token (default: the slot's length; a prefill passes its prompt's
        length - 1, the last prompt token being the pending one)."""
        if not req.speculate:
            return 0
        room_out = req.params.max_tokens - len(req.output_ids) - 1
        room_ctx = self.max_model_len - (self.cache.lengths[req.slot] if context is None else context) - 1
        return max(0, min(self.k_max, room_out, room_ctx))

    def _emit(self, req: Request, token_ids: list[int]) -> list[int]:
        """Append tokens one by one until a stop condition; returns the tokens actually emitted."""
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        emitted = []
        for tok in token_ids:
            req.output_ids.append(tok)
            emitted.append(tok)
            if req.matcher is not None:
                self._advance_grammar(req, tok)
            reason = self._stop_reason(req, tok)
            if reason:
                self._finish(req, reason)
                break
        else:
            self._pending[req.slot] = token_ids[-1]
        return emitted

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if req.on_token is not None and req.on_token(tok):
            return "stop"
        if req.matcher is not None and req.matcher.is_finished():
            return "stop"  # the grammar is complete and admits nothing more (or only EOS)
        if len(req.output_ids) >= p.max_tokens:
            return "length"
        return None

    def _fail(self, req: Request, exc: Exception) -> StepOutput:
        """Finish a request whose step raised: finish_reason "error", `error` says what; its slot is freed."""
        req.error = f"{type(exc).__name__}: {exc}"
        self._finish(req, "error")
        return StepOutput(req, [], True)

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        self.k_policy.end(req)
        if req.slot is not None:
            self._pending.pop(req.slot, None)
            self.proposer.end(req.slot)
        # the slot and its blocks back; a normal end keeps its K/V in the prefix cache (a chat's next turn)
        self.scheduler.finish(req, keep=reason in ("stop", "length"))


def _chain_prefix(d: Draft) -> Draft:
    """A tree draft's leading chain (guesses whose parent is the row before), for forwards that verify chains only
    (the prefill's); a chain as it is."""
    if d.parents is None:
        return d
    n = next((i for i, p in enumerate(d.parents) if p != i), len(d.parents))
    return Draft(d.token_ids[:n], None if d.probs is None else d.probs[:n])
