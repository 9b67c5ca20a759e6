"""Suffix speculation (SuffixDecoding, Oliaro et al., NeurIPS 2025, arXiv 2411.04975): guesses from suffix tries
over this request's prompt and output and over the outputs of earlier requests, proposed as a token tree.

Owns `SuffixTrie` (every substring of up to `max_depth` tokens of the sequences put in, each node counting its
occurrences: a depth-capped suffix tree), `SuffixCache` (the earlier requests' outputs, one trie per scope, bounded
in requests and in tokens, evicted oldest first) and `SuffixProposer` (the Proposer protocol, spec_decode/proposer.py).
A step matches the longest suffix of the context (at most max_depth - 1 tokens) that some earlier occurrence
continued, in the request's own trie and in its scope's trie of earlier outputs, and grows a tree from each match
best-first by estimated probability (a path's product of child count / sum of sibling counts), keeping nodes whose
probability is at least `min_token_prob`, no deeper than `max_spec_factor` x the match length, at most k nodes
(the engine's k); of the two trees the one with more expected accepted tokens (the sum of its nodes' probabilities)
is proposed. Given the target's step cost (`step_cost`: the live grid the k policy reads and the engine's steps
correct, kernels/step_cost.py, read at each propose at the batch's size, never a copy that goes stale; or a fixed
`verify_cost` curve, width -> seconds), the tree is cut to the size n that maximises (1 + expected accepted) /
cost(B, n + 1): a node is verified only where it pays for its row.

Greedy requests get the tree (verified by spec_decode/verify.py tree_greedy_verify); sampled requests, requests
under a grammar and requests with history-dependent controls (penalties, bias, min_tokens: their history is a
chain) get its single most likely branch as a chain, verified by the usual rejection sampling with
point-mass guesses — chain-only sampling, exact and lossless (no multi-branch sampling scheme here).

Scopes: a request's `scope` (begin) names whose earlier outputs it may be guessed from and which trie its own output
joins. The server passes one per API key unless the operator opts into one global scope: guesses never change a
token, but how fast a request runs (accepted guesses) would tell one tenant what another generated.
Knows nothing of models, caches or the engine.
"""
from __future__ import annotations

import heapq
from collections import deque

import torch

from draftwise.spec_decode.proposer import EMPTY_DRAFT_IDS, Draft
from draftwise.spec_decode.tree import MAX_TREE_ROWS, is_chain

ROOT = 0  # a trie's root node id
NONE = -1  # no node (a leaf's first child, the last sibling)


class SuffixTrie:
    """Every substring of up to max_depth tokens of the sequences added, with its number of occurrences.

    Nodes are integer ids (ROOT = 0) into lists of ints: `counts[n]` its occurrences, `tokens[n]` the token on its
    edge, `first[n]` its first child and `sibling[n]` the next child of its parent (NONE ends a chain); one dict
    maps (parent id << 32 | token) to the child. A node allocates no Python object of its own, so a trie of a
    million nodes gives the cyclic garbage collector nothing to count or walk (a node as a [count, children] list
    did: a full collection a batch, 100-250 ms each on the bench's tries, none of them priced)."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.counts: list[int] = [0]  # node id -> occurrences
        self.tokens: list[int] = [-1]  # node id -> the token on the edge from its parent
        self.first: list[int] = [NONE]  # node id -> its first child (NONE: a leaf)
        self.sibling: list[int] = [NONE]  # node id -> its parent's next child
        self.edges: dict[int, int] = {}  # parent id << 32 | token -> child id
        self._free: list[int] = []  # ids of removed nodes, reused first
        self.num_nodes = 0  # nodes besides the root
        self._open: list[int] = []  # the nodes of the current sequence's suffixes shorter than max_depth

    def start(self) -> None:
        """A new sequence begins: substrings never span two sequences."""
        self._open = []

    def _new(self, parent: int, token: int) -> int:
        """A child of `parent` on `token`, first in its parent's chain."""
        self.num_nodes += 1
        if self._free:
            n = self._free.pop()
            self.tokens[n], self.first[n], self.sibling[n] = token, NONE, self.first[parent]
        else:
            n = len(self.counts)
            self.counts.append(0)
            self.tokens.append(token)
            self.first.append(NONE)
            self.sibling.append(self.first[parent])
        self.first[parent] = n
        self.edges[parent << 32 | token] = n
        return n

    def append(self, token: int) -> None:
        """The current sequence grows by one token: each of its suffixes (up to max_depth) gains an occurrence."""
        grown, counts, edges = [], self.counts, self.edges
        for parent in (ROOT, *self._open):
            child = edges.get(parent << 32 | token)
            if child is None:
                child = self._new(parent, token)
            counts[child] += 1
            grown.append(child)
        self._open = grown[: self.max_depth - 1]

    def extend(self, tokens) -> None:
        for t in tokens:
            self.append(t)

    def remove(self, tokens: list[int]) -> None:
        """Take out a sequence added before (start + extend): the same occurrences, counted down; empty nodes go."""
        D = self.max_depth
        for s in range(len(tokens)):
            node = ROOT
            for t in tokens[s : s + D]:
                child = self.edges[node << 32 | t]
                self.counts[child] -= 1
                if self.counts[child] == 0:
                    self._unlink(node, child)
                    break
                node = child

    def _unlink(self, parent: int, node: int) -> None:
        """Take `node` out of its parent's chain, then free it and everything under it (their ids are reused)."""
        if self.first[parent] == node:
            self.first[parent] = self.sibling[node]
        else:
            c = self.first[parent]
            while self.sibling[c] != node:
                c = self.sibling[c]
            self.sibling[c] = self.sibling[node]
        stack = [(parent, node)]
        while stack:
            p, n = stack.pop()
            del self.edges[p << 32 | self.tokens[n]]
            c = self.first[n]
            while c != NONE:
                stack.append((n, c))
                c = self.sibling[c]
            self.counts[n], self.first[n], self.sibling[n] = 0, NONE, NONE
            self._free.append(n)
            self.num_nodes -= 1

    def children(self, node: int) -> dict[int, int]:
        """{token: child id} of `node` (a new dict: for callers that look, not for the hot path)."""
        out, c = {}, self.first[node]
        while c != NONE:
            out[self.tokens[c]] = c
            c = self.sibling[c]
        return out

    def match(self, context: list[int]) -> tuple[int | None, int]:
        """The node of the longest suffix of `context` (at most max_depth - 1 tokens) that occurs followed by some
        token, and its length; (None, 0) when none does. "Occurs and is continued" shrinks with the suffix's length,
        so a binary search over the length finds it."""
        lo, hi, best = 1, min(self.max_depth - 1, len(context)), (None, 0)
        while lo <= hi:
            m = (lo + hi) // 2
            node = self.walk(context[len(context) - m :])
            if node is not None and self.first[node] != NONE:
                best, lo = (node, m), m + 1
            else:
                hi = m - 1
        return best

    def walk(self, tokens) -> int | None:
        """The node of `tokens` (a path from the root), or None."""
        node, edges = ROOT, self.edges
        for t in tokens:
            node = edges.get(node << 32 | t)
            if node is None:
                return None
        return node

    def count(self, tokens) -> int:
        """Occurrences of `tokens` (0: none, or deeper than max_depth)."""
        node = self.walk(tokens)
        return 0 if node is None else self.counts[node]


def grow_tree(trie: SuffixTrie, node: int, max_nodes: int, max_depth: int, min_prob: float,
              chain: bool = False) -> tuple[list[int], list[int], list[float]]:
    """Best-first from a matched node of `trie`: (tokens, parents, probabilities) of up to max_nodes nodes in the
    order they were taken (parents first: parents[i] is the chunk row of node i's parent, 0 = the root, node i sits
    in row i + 1), no deeper than max_depth, each with probability >= min_prob. A child's probability is its
    parent's times its count over its siblings' total, so it never exceeds its parent's and every prefix of the
    order is a tree. chain: only the most likely child each time (a chain)."""
    tokens, parents, probs = [], [], []
    heap: list = []
    tick = 0
    counts, toks, first, sibling = trie.counts, trie.tokens, trie.first, trie.sibling

    def push_children(trie_node, p_parent, row, depth):
        nonlocal tick
        if depth >= max_depth or first[trie_node] == NONE:
            return
        children, c = [], first[trie_node]
        while c != NONE:
            children.append((toks[c], c))
            c = sibling[c]
        children.reverse()  # the chain holds the newest child first: oldest first, ties keep that order
        total = sum(counts[c] for _, c in children)
        ranked = sorted(children, key=lambda kv: -counts[kv[1]])
        for tok, child in ranked[:1] if chain else ranked:
            p = p_parent * counts[child] / total
            if p < min_prob:
                break
            heapq.heappush(heap, (-p, tick, tok, row, depth + 1, child))
            tick += 1

    push_children(node, 1.0, 0, 0)
    while heap and len(tokens) < max_nodes:
        neg_p, _, tok, parent_row, depth, child = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent_row)
        probs.append(-neg_p)
        push_children(child, -neg_p, len(tokens), depth)
    return tokens, parents, probs


NODE_BYTES = 150  # what one trie node holds in CPython (its int in each of four lists, its edge in the dict; measured ~143), for the cache's byte bound


class SuffixCache:
    """Earlier requests' outputs, one SuffixTrie per scope; at most max_requests outputs and about max_bytes of
    trie nodes in all (scopes together), the oldest output evicted first. max_requests = 0: nothing is kept."""

    def __init__(self, max_depth: int, max_requests: int, max_bytes: int):
        self.max_depth, self.max_requests, self.max_bytes = max_depth, max_requests, max_bytes
        self.tries: dict[str, SuffixTrie] = {}
        self.entries: deque[tuple[str, list[int]]] = deque()  # (scope, output), oldest first

    @property
    def nbytes(self) -> int:
        return NODE_BYTES * sum(t.num_nodes for t in self.tries.values())

    def add(self, scope: str, tokens: list[int]) -> None:
        if self.max_requests == 0 or not tokens:
            return
        trie = self.tries.get(scope)
        if trie is None:
            trie = self.tries[scope] = SuffixTrie(self.max_depth)
        trie.start()
        trie.extend(tokens)
        self.entries.append((scope, list(tokens)))
        while self.entries and (len(self.entries) > self.max_requests or self.nbytes > self.max_bytes):
            self.evict_oldest()

    def evict_oldest(self) -> None:
        scope, tokens = self.entries.popleft()
        trie = self.tries[scope]
        trie.remove(tokens)
        if trie.first[ROOT] == NONE:
            del self.tries[scope]

    def trie(self, scope: str) -> SuffixTrie | None:
        return self.tries.get(scope)


class _Sequence:
    def __init__(self, prompt_ids: list[int], max_depth: int, scope: str, chain: bool):
        self.tokens = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.trie = SuffixTrie(max_depth)
        self.trie.extend(prompt_ids)
        self.scope = scope
        self.chain = chain  # sampled or under a grammar: the most likely branch only
        self.last: list[int] = []  # `after` + the guesses of the last draft, in chunk-row order


class SuffixProposer:
    vocab_limit = None  # guesses are ids already seen

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1, max_cached_bytes: int = 256 << 20, tree: bool = True):
        self.max_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.tree = tree  # False: every request gets chains (the most likely branch)
        self.cache = SuffixCache(max_tree_depth, max_cached_requests, max_cached_bytes)
        # the target's live step-cost grid (kernels/step_cost.StepCost: (B, width) -> seconds; api.py hands over the
        # k policy's own object, so a correction reaches the trees at once) or a fixed curve (width -> seconds):
        # cuts each tree to the size its expected tokens pay for; both None: as many nodes as k allows
        self.step_cost = None
        self.verify_cost: dict[int, float] | None = None
        self.seqs: dict[int, _Sequence] = {}

    def begin(self, slot, prompt_ids, params, generator, grammar=None, scope=""):
        chain = not self.tree or not params.greedy or grammar is not None or params.adjusts_logits
        self.seqs[slot] = _Sequence(prompt_ids, self.max_depth, scope, chain)

    def propose(self, slots, k_per_seq, after=None):
        drafts = []
        for i, (slot, k) in enumerate(zip(slots, k_per_seq)):
            seq = self.seqs[slot]
            before = list(after[i]) if after else []
            context = seq.tokens[-self.max_depth :] + before  # a match is at most max_depth - 1 tokens long
            tokens, parents = (self.guess(seq, context, k, chain=seq.chain or bool(after), batch=len(slots))
                               if k > 0 else ([], []))
            seq.last = before + tokens
            if not tokens:
                drafts.append(Draft(EMPTY_DRAFT_IDS))
                continue
            tree = None if is_chain(parents) else tuple(parents)
            drafts.append(Draft(torch.tensor(tokens, dtype=torch.int64), parents=tree))
        return drafts

    def guess(self, seq: _Sequence, context: list[int], k: int, chain: bool,
              batch: int = 1) -> tuple[list[int], list[int]]:
        """(tokens, parents) of the better tree of the request's own trie and its scope's, cut to what pays."""
        best, best_score = ([], [], []), 0.0
        # a trie holds substrings of up to max_depth tokens, so a match of m leaves max_depth - m for the guesses and
        # max_spec_factor * m caps them too: besides the longest match, try the length where the two caps meet
        balance = max(1, int(self.max_depth / (1 + self.max_spec_factor)))
        for trie in (seq.trie, self.cache.trie(seq.scope)):
            if trie is None:
                continue
            node, m = trie.match(context)
            if node is None:
                continue
            for length in {m, min(m, balance)}:
                at = node if length == m else trie.walk(context[len(context) - length :])
                depth = min(int(self.max_spec_factor * length), self.max_depth - length)
                grown = grow_tree(trie, at, min(k, MAX_TREE_ROWS - 1), depth, self.min_token_prob, chain)
                if sum(grown[2]) > best_score:
                    best, best_score = grown, sum(grown[2])
        tokens, parents, probs = best
        n = self.tree_size(probs, batch)
        return tokens[:n], parents[:n]

    def tree_size(self, probs: list[float], batch: int = 1) -> int:
        """Nodes worth verifying: the n <= len(probs) maximising (1 + expected accepted) / cost(batch, n + 1), nodes
        taken in best-first order (the expected accepted tokens of the first n is the sum of their probabilities)."""
        grid, curve = self.step_cost, self.verify_cost
        if grid is None and not curve:
            return len(probs)
        cost = (lambda w: grid.cost(batch, w)) if grid is not None else curve.get
        best_n, best_rate, expected = 0, 1.0 / cost(1), 1.0
        for n, p in enumerate(probs, start=1):
            c = cost(n + 1)
            if c is None:
                break
            expected += p
            if expected / c > best_rate:
                best_n, best_rate = n, expected / c
        return best_n

    def accept(self, slot, num_accepted, token_id, path=None):
        """`path` (a tree draft): the chunk rows of the accepted guesses; None: the first num_accepted (a chain)."""
        seq = self.seqs[slot]
        kept = seq.last[:num_accepted] if path is None else [seq.last[r - 1] for r in path]
        seq.tokens.extend(kept)
        seq.tokens.append(token_id)
        seq.trie.extend(kept)
        seq.trie.append(token_id)
        seq.last = []

    def end(self, slot):
        """The request's output joins its scope's trie of earlier outputs."""
        seq = self.seqs.pop(slot, None)
        if seq is not None:
            self.cache.add(seq.scope, seq.tokens[seq.prompt_len :])
