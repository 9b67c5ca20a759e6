"""Token-tree attention (kernels/attention.py attend_tree, the decoder's tree forward): every node's result is
bitwise the result of the chain forward of its root-to-node path (brute force: the path's K/V copied to consecutive
cache positions of another slot and attended as a chain), on every ISA path, float32 and bfloat16, GQA, sliding
windows shorter and longer than the tree (and on the AMX path where it runs, against its own chain rows); and the decoder's tree forward gives each node the logits a chain forward
of its path gives, on the C++ op and on the torch reference path, and so does the engine's verification forward of
a batch of tree drafts. Tiny tensors; no timing asserts."""
from __future__ import annotations

import random

import pytest
import torch

from draftwise.kernels import attention
from draftwise.kv_cache import KVCache
from draftwise.spec_decode.tree import ancestor_masks, check_parents, depths, path_rows
from tests.harness import one_torch_thread, row_exact  # noqa: F401 (a fixture)
from tests.tiny_models import tiny_decoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_parents(k: int, rng: random.Random) -> list[int]:
    return [rng.randint(max(0, i - 3), i) for i in range(k)]


@pytest.fixture(scope="module")
def paths() -> list[str]:
    if not attention.available():
        pytest.skip("the C++ extension cannot be built here (no compiler)")
    return attention.cpu_paths()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 4, 64])
@pytest.mark.parametrize("D", [64, 24])  # 24: not a multiple of 16 (the portable path)
def test_each_tree_node_equals_the_chain_of_its_path(paths, dtype, window, D):
    rng = random.Random(D * 100 + window)
    H, Hkv, C, S = 4, 2, 80, 4
    g = torch.Generator().manual_seed(window + D)
    firsts, trees = [5, 17, 1], [random_parents(k, rng) for k in (12, 5, 0)]
    T = 1 + max(len(t) for t in trees)
    keys = torch.randn(S, Hkv, C, D, generator=g).to(dtype)
    values = torch.randn(S, Hkv, C, D, generator=g).to(dtype)
    q = (torch.randn(len(firsts), T, H, D, generator=g) * 2).to(dtype).transpose(1, 2)  # [B, H, T, D]
    slots = torch.tensor([[2], [0], [1]])  # block tables: one block per sequence
    positions = torch.tensor(firsts)[:, None] + torch.arange(T)
    ntok = [1 + len(t) for t in trees]
    anc = torch.zeros(len(firsts), T, dtype=torch.int64)
    for b, t in enumerate(trees):
        check_parents(t)
        anc[b, : ntok[b]] = torch.tensor(ancestor_masks(t))
    amx = ["amx"] if dtype == torch.bfloat16 and D % 32 == 0 and attention.amx() else []  # its own tiles' bits
    for path in paths + amx:
        out = attention.attend_tree(q, keys, values, slots, positions, ntok, anc, 0.3, window, path)
        for b, parents in enumerate(trees):
            s, first = int(slots[b, 0]), firsts[b]
            assert not out[b, :, ntok[b]:].any()  # padding rows: zero
            for node in range(ntok[b]):
                rows = path_rows(parents, node)
                assert len(rows) == depths(parents)[node] + 1
                # brute force: the path's keys at consecutive positions of the spare slot 3, attended as a chain
                k2, v2 = keys.clone(), values.clone()
                k2[3, :, :first] = keys[s, :, :first]
                v2[3, :, :first] = values[s, :, :first]
                for j, r in enumerate(rows):
                    k2[3, :, first + j] = keys[s, :, first + r]
                    v2[3, :, first + j] = values[s, :, first + r]
                qc = q[b : b + 1, :, rows].contiguous()  # [1, H, depth + 1, D]: the path's queries
                pos = first + torch.arange(len(rows))[None]
                chain = attention.attend_rows(qc, k2, v2, torch.tensor([[3]]), pos, [len(rows)], 0.3, window, path)
                assert torch.equal(out[b, :, node], chain[0, :, -1]), (path, b, node, rows)


def test_ancestor_masks_are_checked(paths):
    q = torch.zeros(1, 2, 3, 16)
    cache = torch.zeros(1, 2, 8, 16)
    bad = torch.tensor([[1, 0b11, 0b1001]])  # row 2 names row 3: a child before its parent
    with pytest.raises(RuntimeError, match="only rows before it"):
        attention.attend_tree(q, cache, cache, torch.tensor([[0]]), torch.tensor([[2, 3, 4]]), [3], bad, 1.0)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])  # mistral: a sliding window (5) shorter than the tree
@pytest.mark.parametrize("op", [True, False])
def test_decoder_tree_forward_gives_each_node_its_paths_chain_logits(family, op, monkeypatch):
    model = row_exact(tiny_decoder(family, seed=3, vocab_size=64))
    if not op:
        monkeypatch.setattr(attention, "usable", lambda q, k: False)  # the torch reference path
    elif not attention.available():
        pytest.skip("no C++ op here")
    rng = random.Random(7)
    c = model.config
    prompt = torch.randint(1, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    parents = random_parents(10, rng)
    tokens = [int(x) for x in torch.randint(1, 64, (11,), generator=torch.Generator().manual_seed(2))]
    cache = KVCache(c.num_layers, 2, c.num_kv_heads, 64, c.head_dim, model.dtype)
    for slot in (0, 1):
        model(prompt, torch.arange(9)[None], cache, torch.tensor([slot]), num_tokens=[9])
    anc = torch.tensor([ancestor_masks(parents)])
    rope = 9 + torch.tensor([depths(parents)])
    tree = model(torch.tensor([tokens]), 9 + torch.arange(11)[None], cache, torch.tensor([0]), num_tokens=[11],
                 ancestors=anc, rope_positions=rope)
    for node in range(11):
        rows = path_rows(parents, node)
        cache.truncate(1, 9)
        chain = model(torch.tensor([[tokens[r] for r in rows]]), 9 + torch.arange(len(rows))[None], cache,
                      torch.tensor([1]), num_tokens=[len(rows)])
        assert torch.equal(tree[0, node], chain[0, -1]), (node, rows)
    # the cache keeps one path: its K/V moved to consecutive positions equal the chain's
    rows = path_rows(parents, 10)
    cache.compact(0, 9, rows)
    cache.truncate(0, 9 + len(rows))
    n = 9 + len(rows)
    assert [cache.blocks_needed(s, 32) for s in (0, 1)] == [1, 1]  # the blocks past the path went back to the pool
    for a, b in zip(cache.gather(0, n), cache.gather(1, n)):  # keys, values
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("stack", [True, False])  # all layers in one C++ call (kernels/stack.py), or the layer loop
def test_engine_tree_forward_rows_equal_plain_steps_along_each_path(stack):
    """Through the engine's own inputs (ancestor masks, RoPE at depth, a chain and trees batched): each node's logits
    are bitwise those a plain decode step gives after its path."""
    from draftwise.engine import Engine, Request
    from draftwise.sampling import SamplingParams
    from draftwise.spec_decode.proposer import Draft, NoProposer

    model = row_exact(tiny_decoder("llama", seed=1, vocab_size=64))
    model.stack = stack
    if stack and model._stack_weights(1) is None:
        pytest.skip("the one-call layer loop does not run here")
    eng = Engine(model, NoProposer(), 12, 3, 64, eos_token_ids=(0,))
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    reqs = [Request(f"r{i}", p, params) for i, p in enumerate([[1, 2, 3, 4], [9, 8, 7, 6, 5, 4], [3, 3]])]
    for r in reqs:
        eng.add_request(r)
    eng.step()  # prefills: each has its pending token
    rng = random.Random(5)
    trees = [random_parents(k, rng) for k in (9, 4, 6)]
    trees[1] = list(range(4))  # a chain in the batch
    drafts = [Draft(torch.tensor([rng.randrange(1, 64) for _ in t]), parents=tuple(t)) for t in trees]
    base = [eng.cache.lengths[r.slot] for r in reqs]
    logits = eng._verify_forward(reqs, drafts)
    for b, (r, d, parents) in enumerate(zip(reqs, drafts, trees)):
        for node in range(1 + d.num_tokens):
            rows = path_rows(parents, node)
            eng.cache.truncate(r.slot, base[b])
            ids = [eng._pending[r.slot]] + [int(d.token_ids[x - 1]) for x in rows[1:]]
            for j, tok in enumerate(ids):  # plain steps, one token at a time
                step = model(torch.tensor([[tok]]), torch.tensor([[base[b] + j]]), eng.cache, torch.tensor([r.slot]),
                             num_tokens=[1])
            assert torch.equal(logits[b, node], step[0, 0]), (b, node, rows)
