"""Decoder invariants: logit parity with HF transformers for every family, KV-cache rollback round trip,
and batched == single forward."""
import pytest
import torch

from draftwise.kv_cache import KVCache
from tests.tiny_models import FAMILIES, draftwise_from_hf, hf_model


def new_cache(model, num_slots=4, capacity=64):
    c = model.config
    return KVCache(c.num_layers, num_slots, c.num_kv_heads, capacity, c.head_dim, model.dtype)


def run(model, cache, slot, ids, start):
    ids = torch.tensor([ids])
    pos = torch.arange(start, start + ids.shape[1])[None]
    return model(ids, pos, cache, torch.tensor([slot]))[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf_prefill_and_decode(family):
    hf = hf_model(family, seed=1)
    ours = draftwise_from_hf(hf)
    ids = torch.randint(0, hf.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits[0]  # [T, V]
    cache = new_cache(ours)
    full = run(ours, cache, 0, ids[0].tolist(), 0)
    assert (full - ref).abs().max().item() < 1e-4
    # incremental: prefix, then one token at a time, then a 3-token chunk (a verification-shaped call)
    cache2 = new_cache(ours)
    parts = [run(ours, cache2, 1, ids[0, :5].tolist(), 0)]
    for t in range(5, 9):
        parts.append(run(ours, cache2, 1, [ids[0, t].item()], t))
    parts.append(run(ours, cache2, 1, ids[0, 9:].tolist(), 9))
    inc = torch.cat(parts)
    assert (inc - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_truncate_round_trip(family):
    model = draftwise_from_hf(hf_model(family, seed=3))
    cache = new_cache(model)
    prompt, junk, cont = [5, 7, 9, 11, 13, 2], [40, 41, 42, 43], [17, 19, 23]
    run(model, cache, 2, prompt, 0)
    run(model, cache, 2, junk, len(prompt))  # speculative tokens that get rejected
    cache.truncate(2, len(prompt))
    after = run(model, cache, 2, cont, len(prompt))
    fresh_cache = new_cache(model)
    run(model, fresh_cache, 0, prompt, 0)
    fresh = run(model, fresh_cache, 0, cont, len(prompt))
    assert torch.equal(after, fresh) or (after - fresh).abs().max().item() < 1e-5
    assert cache.lengths[2] == len(prompt) + len(cont)
    with pytest.raises(ValueError):
        cache.truncate(2, 100)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_batched_equals_single(family):
    model = draftwise_from_hf(hf_model(family, seed=4))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (3, 9, 6)]
    singles, cache_b = [], new_cache(model)
    for slot, p in enumerate(prompts):
        single_cache = new_cache(model)
        run(model, single_cache, 0, p, 0)
        singles.append(run(model, single_cache, 0, [1, 2, 3], len(p)))
        run(model, cache_b, slot, p, 0)
    # one batched 3-token step over three sequences of different lengths, in non-contiguous slots order
    order = [2, 0, 1]
    ids = torch.tensor([[1, 2, 3]] * 3)
    pos = torch.tensor([[len(prompts[s]) + i for i in range(3)] for s in order])
    out = model(ids, pos, cache_b, torch.tensor(order))
    for row, s in enumerate(order):
        assert (out[row] - singles[s]).abs().max().item() < 1e-5
        assert cache_b.lengths[s] == len(prompts[s]) + 3
