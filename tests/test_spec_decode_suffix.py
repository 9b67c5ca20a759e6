"""Suffix speculation and token-tree verification (spec_decode/suffix.py, tree.py, verify.py's tree walk, the
engine's tree path): greedy output with trees equals plain greedy output token for token (the suffix proposer at
k = 1..16, earlier requests' outputs cached, and a proposer of random tree shapes, batched, k = 1..16); the tree walk
against a brute-force reading of the target's argmax; the suffix trie's counts, eviction (requests and bytes, oldest
first) and scopes; sampled requests get chains; the config's keys and errors. Tiny random models; no timing."""
from __future__ import annotations

import gc
import random

import pytest
import torch

from draftwise.config import ConfigError, parse_spec_config
from draftwise.sampling import SamplingParams
from draftwise.spec_decode.proposer import EMPTY_DRAFT_IDS, Draft, NoProposer
from draftwise.spec_decode.suffix import ROOT, SuffixCache, SuffixProposer, SuffixTrie, grow_tree
from draftwise.spec_decode.tree import ancestor_masks, depths, path_rows
from draftwise.spec_decode.verify import tree_greedy_verify, verify
from tests.harness import engine_run, one_torch_thread  # noqa: F401 (a fixture)
from tests.tiny_models import tiny_decoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_LEN = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 8, 7], [5, 5, 5, 5, 6, 5, 5, 5, 5], [10, 20, 30, 40, 50, 60, 10, 20]]


@pytest.fixture(scope="module")
def target():
    # llama seed 1: varied greedy outputs (the tiny qwen2 decoders repeat their last token, which no tree shape could get wrong)
    return tiny_decoder("llama", seed=1, vocab_size=64)


def run(target, proposer, k, prompts=PROMPTS, params=GREEDY, scopes=None):
    outs, eng, _ = engine_run(target, proposer, max(k, 1), prompts, params, max_len=MAX_LEN, scopes=scopes)
    return outs, eng


@pytest.fixture(scope="module")
def plain(target):
    return run(target, NoProposer(), 0)[0]


class Counting:
    """Wraps a proposer and counts the tree drafts (with branches) it returned."""

    def __init__(self, inner):
        self.inner, self.trees, self.nodes = inner, 0, 0
        self.vocab_limit = None

    def begin(self, *a, **kw):
        self.inner.begin(*a, **kw)

    def propose(self, slots, k_per_seq, after=None):
        drafts = self.inner.propose(slots, k_per_seq, after)
        self.trees += sum(d.parents is not None for d in drafts)
        self.nodes += sum(d.num_tokens for d in drafts)
        return drafts

    def accept(self, *a, **kw):
        self.inner.accept(*a, **kw)

    def end(self, slot):
        self.inner.end(slot)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, 12, 16])
def test_suffix_greedy_equals_plain_within_and_across_requests(target, plain, k):
    proposer = Counting(SuffixProposer(min_token_prob=0.0))
    outs, eng = run(target, proposer, k)
    assert outs == plain
    again, eng = run(target, proposer, k)  # the first run's outputs now guess the second's
    assert again == plain
    assert eng.stats.num_accepted_tokens > 0
    if k >= 3:
        assert proposer.trees > 0  # branches were verified, not only chains


class RandomTrees:
    """Random tree shapes of exactly k nodes: one branch follows the plain output (so paths of every length get
    accepted), the others are random tokens; each slot its own seed, so a batch mixes shapes."""

    vocab_limit = None

    def __init__(self, plain_by_prompt: dict, seed: int):
        self.plain, self.seed = plain_by_prompt, seed
        self.state = {}

    def begin(self, slot, prompt_ids, params, generator, grammar=None, scope=""):
        self.state[slot] = [tuple(prompt_ids), 0, random.Random(self.seed + slot), []]

    def propose(self, slots, k_per_seq, after=None):
        out = []
        for slot, k in zip(slots, k_per_seq):
            prompt, done, rng, _ = self.state[slot]
            if k == 0:
                out.append(Draft(EMPTY_DRAFT_IDS))
                self.state[slot][3] = []
                continue
            truth = self.plain[prompt][done:] + [0] * k
            parents, tokens, good = [], [], 0  # good: the row of the deepest true node so far (0: the root)
            true_depth = 0
            for i in range(k):
                if rng.random() < 0.6:  # extend the true branch
                    parents.append(good)
                    tokens.append(truth[true_depth] if rng.random() < 0.85 else rng.randrange(64))
                    if tokens[-1] == truth[true_depth]:
                        good, true_depth = i + 1, true_depth + 1
                else:
                    parents.append(rng.randint(0, i))
                    tokens.append(rng.randrange(64))
            # siblings carry distinct tokens (as a trie's children do): bump a repeated one
            seen = set()
            for i, (p, t) in enumerate(zip(parents, tokens)):
                while (p, tokens[i]) in seen:
                    tokens[i] = (tokens[i] + 1) % 64
                seen.add((p, tokens[i]))
            self.state[slot][3] = tokens
            out.append(Draft(torch.tensor(tokens), parents=tuple(parents)))
        return out

    def accept(self, slot, num_accepted, token_id, path=None):
        self.state[slot][1] += num_accepted + 1

    def end(self, slot):
        self.state.pop(slot, None)


@pytest.mark.parametrize("k", range(1, 17))
def test_random_tree_shapes_batched_greedy_equals_plain(target, plain, k):
    proposer = RandomTrees({tuple(p): o for p, o in zip(PROMPTS, plain)}, seed=k)
    outs, eng = run(target, proposer, k)
    assert outs == plain
    if k > 1:
        assert eng.stats.num_accepted_tokens > 0


def test_tree_walk_equals_brute_force():
    rng = random.Random(0)
    for trial in range(200):
        k = rng.randint(0, 12)
        parents = [rng.randint(0, i) for i in range(k)]
        tokens, seen = [], set()
        for p in parents:
            t = rng.randrange(4)
            while (p, t) in seen:
                t = (t + 1) % 8
            seen.add((p, t))
            tokens.append(t)
        logits = torch.randn(k + 1, 8, generator=torch.Generator().manual_seed(trial))
        res = tree_greedy_verify(torch.tensor(tokens, dtype=torch.int64), tuple(parents), logits)
        argmax = logits.argmax(-1).tolist()
        # brute force: every node whose whole path agrees with the target; the deepest one (unique: siblings differ)
        agreed = [r for r in range(1, k + 1) if all(tokens[n - 1] == argmax[parents[n - 1]]
                                                    for n in path_rows(parents, r)[1:])]
        deepest = max(agreed, key=lambda r: depths(parents)[r], default=0)
        want = path_rows(parents, deepest)[1:]
        assert res.path == tuple(want)
        assert res.token_ids == [tokens[r - 1] for r in want] + [argmax[deepest]]
        assert res.num_accepted == len(want)


def test_a_chain_shaped_tree_verifies_like_the_chain():
    logits = torch.randn(6, 10, generator=torch.Generator().manual_seed(3))
    ids = logits.argmax(-1)[:5].clone()
    ids[3] = (ids[3] + 1) % 10
    chain = verify(ids, None, logits, GREEDY, None)
    tree = verify(ids, None, logits, GREEDY, None, parents=(0, 1, 2, 3, 4))
    assert (tree.num_accepted, tree.token_ids, tree.path) == (chain.num_accepted, chain.token_ids, (1, 2, 3))


def test_trees_are_refused_for_sampling():
    with pytest.raises(ValueError, match="greedily only"):
        verify(torch.tensor([1]), None, torch.randn(2, 4), SamplingParams(temperature=1.0), None, parents=(0,))


def test_tree_arithmetic():
    parents = [0, 0, 1, 3, 2]
    assert depths(parents) == [0, 1, 1, 2, 3, 2]
    assert ancestor_masks(parents) == [1, 0b11, 0b101, 0b1011, 0b11011, 0b100101]
    assert path_rows(parents, 4) == [0, 1, 3, 4]


# ---- the suffix structures -------------------------------------------------------------------------------------
def test_trie_counts_every_substring_up_to_its_depth_and_removes_them():
    trie = SuffixTrie(3)
    seq = [1, 2, 1, 2, 3]
    trie.extend(seq)
    for n in (1, 2, 3):
        for s in range(len(seq) - n + 1):
            sub = seq[s : s + n]
            want = sum(seq[i : i + n] == sub for i in range(len(seq) - n + 1))
            assert trie.count(sub) == want
    assert trie.walk([1, 2, 1, 2]) is None  # deeper than 3
    trie.start()
    trie.extend([7, 1])
    assert trie.walk([2, 7]) is None  # sequences never join
    trie.remove([7, 1])
    trie.remove(seq)
    assert trie.children(ROOT) == {} and trie.edges == {} and trie.num_nodes == 0
    slots = len(trie.counts)
    trie.start()
    trie.extend(seq)  # removed nodes' ids are reused: the trie's lists do not grow with turnover
    assert len(trie.counts) == slots and trie.count([1, 2]) == 2


def test_a_trie_adds_nothing_the_cyclic_garbage_collector_walks():
    """Tries grow by a node per token per depth; nodes the collector tracks made every full collection walk them all
    (each batch of the bench paid one, 100-250 ms, unpriced). However large the trie, the tracked objects it adds
    stay the same few (its own lists)."""
    def tracked_in(trie: SuffixTrie) -> int:
        """The tracked objects the trie holds: itself and what it reaches through containers. Counted from the trie,
        not as the process's count before and after (another thread of an xdist worker allocates meanwhile: that
        count once read 8 for 7)."""
        seen, todo, tracked = {id(trie)}, [trie], 0
        while todo:
            o = todo.pop()
            tracked += gc.is_tracked(o)
            if o is trie or isinstance(o, (list, tuple, dict, set)):
                for r in gc.get_referents(o):
                    if not isinstance(r, type) and id(r) not in seen:
                        seen.add(id(r))
                        todo.append(r)
        return tracked

    def tracked_after(tokens: int) -> tuple[int, int]:
        """(tracked objects the trie holds, collections that ran while it grew)"""
        runs = []
        gc.collect()
        gc.callbacks.append(lambda phase, info: runs.append(phase == "start"))
        try:
            trie = SuffixTrie(24)
            trie.extend(list(range(tokens)) + list(range(tokens // 2)))
            trie.start()
            trie.extend([tokens + 1] * 8)
        finally:
            gc.callbacks.pop()
        assert trie.num_nodes > 10 * tokens  # the trie really holds a node per token per depth
        return tracked_in(trie), sum(runs)

    (small, _), (large, collections) = tracked_after(50), tracked_after(2000)
    assert large == small and large <= 8
    assert collections == 0  # no object per node: 30000 nodes never fill even the youngest generation


def test_match_is_the_longest_continued_suffix():
    trie = SuffixTrie(8)
    trie.extend([5, 1, 2, 3, 9, 1, 2, 3, 4, 7, 2, 3])
    node, m = trie.match([0, 7, 1, 2, 3])  # "1 2 3" was continued (by 9 and by 4); "7 1 2 3" never occurred
    assert m == 3 and sorted(trie.children(node)) == [4, 9]
    assert trie.match([42]) == (None, 0)


def test_grown_trees_put_parents_first_and_prune_by_probability():
    trie = SuffixTrie(10)
    for seq in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7]):
        trie.start()
        trie.extend(seq)
    node, m = trie.match([9, 1, 2])
    tokens, parents, probs = grow_tree(trie, node, 10, 10, 0.0)
    assert tokens[:2] == [3, 4] and probs[0] == pytest.approx(0.75) and probs[1] == pytest.approx(0.5)
    assert all(p <= i for i, p in enumerate(parents))
    assert probs == sorted(probs, reverse=True)
    tokens, parents, probs = grow_tree(trie, node, 10, 10, 0.3)  # 5 (0.25) and 6 (0.25) pruned
    assert tokens == [3, 4] and parents == [0, 1]
    assert grow_tree(trie, node, 10, 1, 0.0)[0] == [3, 6]  # depth 1: siblings only
    assert grow_tree(trie, node, 10, 10, 0.0, chain=True)[1] == [0, 1]  # a chain: the most likely child each time


def test_cache_evicts_oldest_first_by_requests_and_bytes():
    cache = SuffixCache(4, max_requests=2, max_bytes=1 << 30)
    for i in range(3):
        cache.add("", [100 + i, 1, 2])
    assert [e[1][0] for e in cache.entries] == [101, 102]
    assert cache.trie("").walk([100]) is None and cache.trie("").count([101, 1]) == 1
    small = SuffixCache(4, max_requests=100, max_bytes=cache.nbytes)  # room for about two outputs' nodes
    for i in range(5):
        small.add("a", [200 + i, 1, 2])
        assert small.nbytes <= small.max_bytes
    assert [e[1][0] for e in small.entries][-1] == 204 and len(small.entries) < 5
    off = SuffixCache(4, max_requests=0, max_bytes=1 << 30)
    off.add("", [1, 2, 3])
    assert off.trie("") is None


def test_scopes_never_share_earlier_outputs():
    p = SuffixProposer(min_token_prob=0.0)
    secret = [11, 12, 13, 14, 15, 16]
    p.begin(0, [1, 2], GREEDY, None, scope="alice")
    for t in secret:
        p.accept(0, 0, t)
    p.end(0)
    for scope, expect in (("bob", False), ("alice", True)):
        p.begin(1, [3, 11, 12, 13], GREEDY, None, scope=scope)
        d = p.propose([1], [4])[0]
        assert (d.token_ids.tolist()[:2] == [14, 15]) is expect, scope
        p.end(1)


def test_sampled_requests_and_grammars_get_chains():
    p = SuffixProposer(min_token_prob=0.0)
    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]
    p.begin(0, prompt, GREEDY, None)
    assert p.propose([0], [6])[0].parents is not None  # 3, 4, 5 follow "1 2": branches
    p.begin(1, prompt, SamplingParams(temperature=0.8), None)
    d = p.propose([1], [6])[0]
    assert d.parents is None and d.num_tokens >= 1 and d.probs is None


def test_the_verify_cost_cuts_the_tree_to_what_pays():
    p = SuffixProposer()
    p.verify_cost = {1: 1.0, 2: 1.05, 3: 1.1, 4: 3.0}
    assert p.tree_size([0.9, 0.8, 0.7]) == 2  # a third node costs more than it yields
    p.verify_cost = {1: 1.0, 2: 5.0}
    assert p.tree_size([0.9]) == 0  # plain wins
    p.verify_cost = None
    assert p.tree_size([0.9, 0.1]) == 2


def test_config_keys_and_errors():
    c = parse_spec_config({"method": "suffix", "num_speculative_tokens": 16})
    assert (c.suffix_decoding_max_tree_depth, c.suffix_decoding_max_cached_requests,
            c.suffix_decoding_max_spec_factor, c.suffix_decoding_min_token_prob) == (24, 10000, 1.0, 0.1)
    assert parse_spec_config(c.to_dict()) == c
    assert "suffix_decoding_max_tree_depth" not in parse_spec_config({"method": "ngram", "num_speculative_tokens": 2}).to_dict()
    assert parse_spec_config({"method": "suffix", "num_speculative_tokens": "auto"}).k_max == 16
    for bad, match in (({"suffix_decoding_max_tree_depth": 1}, "max_tree_depth"),
                       ({"suffix_decoding_min_token_prob": 1.5}, "min_token_prob"),
                       ({"suffix_decoding_max_spec_factor": 0}, "max_spec_factor"),
                       ({"suffix_decoding_max_cached_requests": -1}, "max_cached_requests")):
        with pytest.raises(ConfigError, match=match):
            parse_spec_config({"method": "suffix", "num_speculative_tokens": 8, **bad})
    with pytest.raises(ConfigError, match="only applies to method suffix"):
        parse_spec_config({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 0.2})


@pytest.mark.parametrize("k", [2, 5, 16])
def test_trees_under_history_controls_verify_as_their_chain(target, k):
    """A penalty's history is a chain: a tree draft for a request with penalties is verified as its leading chain
    (row i penalised by guesses 1..i), so greedy output still equals plain decoding with the same penalties; the
    suffix proposer gives such requests chains in the first place."""
    params = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.5)
    ref = run(target, NoProposer(), 0, params=params)[0]
    outs, _ = run(target, RandomTrees({tuple(p): o for p, o in zip(PROMPTS, ref)}, seed=k), k, params=params)
    assert outs == ref
    p = SuffixProposer(min_token_prob=0.0)
    p.begin(0, [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2], params, None)
    assert p.propose([0], [6])[0].parents is None
