"""draftwise.kernels.stack: the decoder's layer loop in one C++ call is bitwise the Python loop it replaces (the
logits and every layer's K/V), for each family whose layers qualify, and for layers mixing the kernels a faithful
plan mixes (q4x8, q6k, q8_0, q8_1 per projection, q/k/v merged or as three calls), at prompt, decode and verification
widths in ragged padded batches; it runs where it should and nowhere else (sandwich norms, separate gate/up, torch's
kernels, a prefill half it cannot call, `Decoder.stack = False`); the comparison catches a wrong layer and a
projection run by another kind's kernel; a bad weight list is a clear error. Tiny random models; no timing
asserts."""
from __future__ import annotations

import pytest
import torch

from draftwise.kernels import stack as stack_op
from draftwise.kv_cache import KVCache
from draftwise.kernels.plan import resolve_plan
from draftwise.models import quant
from tests.harness import one_torch_thread  # noqa: F401 (a fixture)
from tests.tiny_models import tiny_decoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", autouse=True)
def built():
    if not stack_op.available():
        pytest.skip("the C++ extension cannot be built here (no compiler)")


@pytest.fixture
def calls(monkeypatch):
    """How many forwards went through the one-call layer loop."""
    seen = []
    real = stack_op.layers

    def spy(*args, **kwargs):
        seen.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(stack_op, "layers", spy)
    return seen


def q4x8_model(family: str, prefill: str = "q4x8", seed: int = 0):
    model = tiny_decoder(family, seed, 64)
    quant.build_linears(model, resolve_plan(f"q4x8+{prefill}", "auto", None))
    return model


def ragged_batch(model, stack: bool, seed: int):
    """The two-row batch `run` and `last_logits` drive (with the loop chosen): a fresh cache of 48 positions, slots
    [0, 1], 30 random ids a row (seeded) and the prompts' lengths [[20], [13]]."""
    model.stack = stack
    c = model.config
    cache = KVCache(c.num_layers, 2, c.num_kv_heads, 48, c.head_dim, model.dtype)
    ids = torch.randint(0, c.vocab_size, (2, 30), generator=torch.Generator().manual_seed(seed))
    return cache, torch.tensor([0, 1]), ids, torch.tensor([20, 13])[:, None]


def run(model, stack: bool) -> list[torch.Tensor]:
    """A ragged batch of two: prompts of 20 and 13 tokens (padded to 20), one decode step each, then a
    verification of 9 and 4 tokens (padded to 9). Returns the three forwards' logits and every layer's keys and
    values (padding included: both loops make the same calls on the same inputs)."""
    cache, slots, ids, lens = ragged_batch(model, stack, seed=3)
    out = [model(ids[:, :20], torch.arange(20)[None].expand(2, 20), cache, slots, num_tokens=[20, 13]),
           model(ids[:, 20:21], lens, cache, slots, num_tokens=[1, 1]),
           model(ids[:, 21:30], lens + 1 + torch.arange(9)[None], cache, slots, num_tokens=[9, 4])]
    held = [cache.gather(s, cache.lengths[s]) for s in (0, 1)]  # every position written, padding included
    return out + [t for keys, values in held for t in keys + values]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_one_call_is_bitwise_the_python_loop(family, calls):
    """Every family whose layers qualify (mistral: a sliding window; qwen2: q/k/v bias; qwen3: q/k norms)."""
    model = q4x8_model(family)
    one_call = run(model, True)
    assert len(calls) == 3
    loop = run(model, False)
    assert len(calls) == 3  # stack=False: the Python loop only
    for a, b in zip(one_call, loop):
        assert torch.equal(a, b)


def test_the_comparison_catches_a_wrong_layer(calls, monkeypatch):
    """Layer 1 run with layer 0's weights (a plausible ordering bug) changes the logits: the equality above is not
    vacuous."""
    model = q4x8_model("qwen2")
    loop = run(model, False)
    real = stack_op.layers

    def shifted(x, weights, kinds, *rest):
        n = stack_op.SLOTS
        k = len(kinds) // (len(weights) // n)  # kinds per layer
        return real(x, weights[:n] + weights[:n] + weights[2 * n:], kinds[:k] + kinds[:k] + kinds[2 * k:], *rest)

    monkeypatch.setattr(stack_op, "layers", shifted)
    wrong = run(model, True)
    assert not torch.equal(wrong[0], loop[0])


def test_a_dense_prefill_half_runs_the_prompt_in_python(calls):
    """q4x8 steps with a dense prefill: the 20-token prompt takes the Python loop (its SplitLinear picks the dense
    half), the decode step and the verification the one call; all bitwise the Python loop."""
    model = q4x8_model("qwen2", prefill="fp32")
    one_call = run(model, True)
    assert [shape[1] for shape in calls] == [1, 9]
    for a, b in zip(one_call, run(model, False)):
        assert torch.equal(a, b)


def test_layers_that_do_not_qualify_take_the_python_loop(calls):
    gemma = q4x8_model("gemma3")  # sandwich norms
    run(gemma, True)
    dense = tiny_decoder("qwen2", 0, 64)  # torch's fp32 linears
    run(dense, True)
    separate = tiny_decoder("qwen2", 0, 64)  # q4x8, but q/k/v and gate/up left separate (gate/up: not in the loop)
    separate.merge_projections = lambda merge=None: 0
    quant.build_linears(separate, resolve_plan("q4x8", "auto", None))
    assert separate.model.layers[0].self_attn.qkv_proj is None
    run(separate, True)
    assert calls == []


def test_layer_weights_follow_the_libraries_slot_count(monkeypatch):
    """SLOTS is csrc/stack.cpp's count, read from the library; a layer_weights out of step with it says so."""
    model = q4x8_model("qwen2")
    assert stack_op.SLOTS == stack_op.slots_per_layer() == torch.ops.draftwise_stack.weights_per_layer()
    real = stack_op._linear
    monkeypatch.setattr(stack_op, "_linear", lambda m: real(m)[:-1])  # a projection's bias left out
    with pytest.raises(RuntimeError, match="Slot layout takes"):
        model._stack_weights(1)


def test_a_bad_weight_list_is_a_clear_error():
    model = q4x8_model("qwen2")
    c = model.config
    cache = KVCache(c.num_layers, 1, c.num_kv_heads, 8, c.head_dim, model.dtype)
    weights, kinds, ffn, experts, mixtures, (*_, act), *_ = model._stack_weights(1)
    assert len(weights) == c.num_layers * stack_op.SLOTS and len(kinds) == c.num_layers * 6
    assert ffn == [64, 0, 0] * c.num_layers and experts == [None] * c.num_layers and mixtures == []
    assert torch.ops.draftwise_stack.weights_per_layer() == stack_op.SLOTS  # the C++ layout's size
    angles = model.angles("full_attention", torch.tensor([[0]]))
    args = (cache.keys, cache.values, [angles[0]] * c.num_layers, [angles[1]] * c.num_layers, torch.tensor([[0]]),
            torch.tensor([[0]]), [1], [0] * c.num_layers, (4, 2, 8, act), (1e-6, 0.0), (0.0, 0.0), 8 ** -0.5)
    x = torch.zeros(1, 1, c.hidden_size)
    with pytest.raises(RuntimeError, match="weights for 2 layers"):
        stack_op.layers(x, weights[:-1], kinds, ffn, experts, *args)
    with pytest.raises(RuntimeError, match="projection kinds for 2 layers"):
        stack_op.layers(x, weights, kinds[:-1], ffn, experts, *args)
    bad = len(stack_op.kind_ids())  # one past the last kind the library has
    with pytest.raises(RuntimeError, match=f"has kind {bad}"):
        stack_op.layers(x, weights, [bad] + kinds[1:], ffn, experts, *args)
    with pytest.raises(RuntimeError, match="k_proj and v_proj come together"):
        stack_op.layers(x, weights, kinds[:1] + [0] + kinds[2:], ffn, experts, *args)
    missing = list(weights)
    missing[stack_op.SLOTS + 1] = None  # layer 1's packed q/k/v nibbles
    with pytest.raises(RuntimeError, match=f"weight {stack_op.SLOTS + 1} .* is missing"):
        stack_op.layers(x, missing, kinds, ffn, experts, *args)
    with pytest.raises(RuntimeError, match="ffn entries"):
        stack_op.layers(x, weights, kinds, ffn[:-1], experts, *args)
    with pytest.raises(RuntimeError, match="neither an MLP nor experts"):
        stack_op.layers(x, weights, kinds, [0, 0, 0] + ffn[3:], experts, *args)
    with pytest.raises(RuntimeError, match="routes to experts but has no ExpertSet"):
        stack_op.layers(x, weights, kinds, [64, 4, 1] + ffn[3:], experts, *args)
    absent = [stack_op.ABSENT] * 2
    with pytest.raises(RuntimeError, match="projection 4 has kind -1"):  # a dense MLP needs its gate/up and down
        stack_op.layers(x, weights, kinds[:4] + absent + kinds[6:], ffn, experts, *args)


# per layer, each projection's kernel: what faithful plans mix (the 1.5B: v_proj and down_proj in Q6_K on half
# its layers, so q/k/v stay three calls; the 0.5B: Q5_0 / Q8_0 held as q8_0 with Q6_K or Q4_K down_proj)
MIXED = [
    {"q_proj": "q4x8", "k_proj": "q4x8", "v_proj": "q6k", "o_proj": "q4x8", "gate_proj": "q4x8", "up_proj": "q4x8",
     "down_proj": "q6k"},
    {"q_proj": "q8_0", "k_proj": "q8_0", "v_proj": "q8_0", "o_proj": "q8_0", "gate_proj": "q8_0", "up_proj": "q8_0",
     "down_proj": "q4x8"},
    {"q_proj": "q6k", "k_proj": "q8_0", "v_proj": "q4x8", "o_proj": "q6k", "gate_proj": "q6k", "up_proj": "q6k",
     "down_proj": "q8_0"},
    {"q_proj": "q8_1", "k_proj": "q8_1", "v_proj": "q8_1", "o_proj": "q5x8", "gate_proj": "q5x8", "up_proj": "q5x8",
     "down_proj": "q6k"},  # a Q5_K_M file's layer (Q5_K as q5x8, Q6_K down_proj), q/k/v in the byte form q8_1
    {"q_proj": "q4c", "k_proj": "q4c", "v_proj": "q4c", "o_proj": "q5m", "gate_proj": "q5m", "up_proj": "q5m",
     "down_proj": "q4c"},  # the compact forms: Q4_0 / IQ4 as q4c, Q4_1 / Q5_1 as q5m
    {"q_proj": "q6m", "k_proj": "q6m", "v_proj": "q6m", "o_proj": "q6m", "gate_proj": "q6m", "up_proj": "q6m",
     "down_proj": "q3k"},  # a Q2_K file's layer: Q2_K as q6m (six packed buffers: a projection's widest entry),
    # its Q3_K down_proj as q3k
]


def mixed_model(family: str, layout: list[dict] = MIXED):
    """A tiny decoder (K = 256 everywhere, as Q6_K blocks need) whose projections take `layout`'s kernels, merged
    where the kinds agree (linear.merge), as a faithful plan builds them."""
    from draftwise.kernels import linear

    sizes = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    if family == "qwen3":  # its head_dim is 16: 16 heads make o_proj's K 256
        sizes.update(num_attention_heads=16, num_key_value_heads=4)
    model = tiny_decoder(family, 0, 64, num_layers=len(layout), sizes=sizes)
    for layer, kernels in zip(model.model.layers, layout):
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if name in kernels:
                    cls = stack_op.KERNELS[kernels[name]]
                    setattr(parent, name, cls(child.weight.detach().float(),
                                              None if child.bias is None else child.bias.detach().float()))
    model.merge_projections(linear.merge)
    return model


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
def test_layers_mixing_q4x8_q6k_and_q8_0_are_bitwise_the_python_loop(family, calls):
    """Layer 0 as the 1.5B's faithful layers (q/k/v three calls: v in q6k), layer 1 as the 0.5B's (merged q8_0),
    layer 2 every kind in one layer, layer 3 a Q5_K_M file's (q5x8, q6k down; q/k/v merged q8_1), layer 4 the compact forms
    (q4c, q5m), layer 5 a Q2_K file's (q6m, q3k down): all in the one call, bitwise the Python loop (qwen2: q/k/v bias;
    qwen3: q/k norms)."""
    model = mixed_model(family)
    attn = [layer.self_attn for layer in model.model.layers]
    assert attn[0].qkv_proj is None and attn[1].qkv_proj is not None and attn[2].qkv_proj is None
    kinds = model._stack_weights(1).kinds
    ids = stack_op.kind_ids()
    assert kinds[:6] == [ids["q4x8"], ids["q4x8"], ids["q6k"], ids["q4x8"], ids["q4x8"], ids["q6k"]]
    assert kinds[6:9] == [ids["q8_0"], stack_op.ABSENT, stack_op.ABSENT]
    assert kinds[18:24] == [ids["q8_1"], stack_op.ABSENT, stack_op.ABSENT, ids["q5x8"], ids["q5x8"], ids["q6k"]]
    assert kinds[24:30] == [ids["q4c"], stack_op.ABSENT, stack_op.ABSENT, ids["q5m"], ids["q5m"], ids["q4c"]]
    assert kinds[30:36] == [ids["q6m"], stack_op.ABSENT, stack_op.ABSENT, ids["q6m"], ids["q6m"], ids["q3k"]]
    one_call = run(model, True)
    assert len(calls) == 3
    for a, b in zip(one_call, run(model, False)):
        assert torch.equal(a, b)


def test_the_comparison_catches_a_projection_run_by_another_kinds_kernel(calls, monkeypatch):
    """Layer 0's q6k down_proj announced as q8_0 to the library (a wrong kind mapping) is caught: either the
    kernel refuses the buffers or the logits differ. The mixed test above is not vacuous about kinds."""
    model = mixed_model("qwen2")
    loop = run(model, False)
    real = stack_op.layers
    ids = stack_op.kind_ids()

    def relabelled(x, weights, kinds, *rest):
        kinds = list(kinds)
        kinds[5] = ids["q4x8"]  # layer 0's down_proj (Proj order: qkv, k, v, o, gate_up, down)
        return real(x, weights, kinds, *rest)

    monkeypatch.setattr(stack_op, "layers", relabelled)
    try:
        wrong = run(model, True)
    except RuntimeError:
        return
    assert not torch.equal(wrong[0], loop[0])


@pytest.mark.parametrize("how", ["module", "buffer"])
def test_what_is_rebound_after_a_forward_is_what_the_next_one_runs(how, calls, monkeypatch):
    """Decoder._stack_for keeps a step's flat list for the next step; a module rebound (setattr) or a buffer
    rebound (register_buffer, as kernels/hugepages.py moves them; torch's registration hooks see both) after a
    forward makes the next one build it again: bitwise the Python loop over the changed model. Planted: with
    `changed` a no-op (no invalidation), the stale list runs and the comparison catches it."""
    for planted in (False, True):
        model = q4x8_model("qwen2")
        run(model, True)  # the lists built and kept
        with monkeypatch.context() as m:
            if planted:
                m.setattr(stack_op, "changed", lambda *_: None)
            attn = model.model.layers[0].self_attn
            if how == "module":
                attn.o_proj = model.model.layers[1].self_attn.o_proj
            else:
                attn.o_proj.register_buffer("d", attn.o_proj._buffers["d"] * 2)
            one_call = run(model, True)
        loop = run(model, False)
        same = all(torch.equal(a, b) for a, b in zip(one_call, loop))
        assert same != planted, planted


def last_logits(model, stack: bool) -> list[torch.Tensor]:
    """`run`'s three forwards (a ragged prompt, a decode step, a ragged verification) with last_only (each row's
    last token's logits [B, 1, V]), then the step and the verification again with a logit_index as the engine
    passes it ([B] and [B, J])."""
    cache, slots, ids, lens = ragged_batch(model, stack, seed=5)
    return [model(ids[:, :20], torch.arange(20)[None].expand(2, 20), cache, slots, num_tokens=[20, 13],
                  last_only=True),
            model(ids[:, 20:21], lens, cache, slots, num_tokens=[1, 1], last_only=True),
            model(ids[:, 21:30], lens + 1 + torch.arange(9)[None], cache, slots, num_tokens=[9, 4], last_only=True),
            model(ids[:, 21:22], lens + 1, cache, slots, num_tokens=[1, 1], logit_index=torch.tensor([0, 0])),
            model(ids[:, 21:30], lens + 1 + torch.arange(9)[None], cache, slots, num_tokens=[9, 4],
                  logit_index=torch.tensor([[8, 2, 5], [3, 0, 3]]))]  # the engine's rows (verification: 1 + k)


@pytest.fixture
def heads(monkeypatch):
    """The `head` each one-call forward passed (None: the norm and LM head ran in Python after it)."""
    seen = []
    real = stack_op.layers

    def spy(*args):
        seen.append(args[18] if len(args) > 18 else None)
        return real(*args)

    monkeypatch.setattr(stack_op, "layers", spy)
    return seen


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_the_last_token_norm_and_head_in_the_one_call_are_bitwise_python(family, heads):
    """A last_only forward whose LM head is a loop kernel runs x[:, -1:], the final norm and the head inside the
    one call (Packed.last), as does one with a logit_index (the engine's): its logits are bitwise the Python loop's
    tail, at 1 and at 9 tokens a row."""
    model = q4x8_model(family)
    one_call = last_logits(model, True)
    assert len(heads) == 5 and all(h is not None for h in heads)
    loop = last_logits(model, False)
    assert len(heads) == 5
    assert [a.shape[1] for a in one_call] == [1, 1, 1, 1, 3]
    for a, b in zip(one_call, loop):
        assert torch.equal(a, b)


def test_the_tail_comparison_catches_a_wrong_final_norm(heads, monkeypatch):
    """The head run on a norm with another eps (a plausible wiring slip: the layer norms' eps) changes the
    logits: the equality above is not vacuous."""
    model = q4x8_model("qwen3")
    loop = last_logits(model, False)
    real = stack_op.layers

    def wrong_eps(*args):
        args = list(args)
        if args[18] is not None:
            w, module, eps, offset = args[18]
            args[18] = (w, module, eps * 1e4 + 1e-3, offset)
        return real(*args)

    monkeypatch.setattr(stack_op, "layers", wrong_eps)
    wrong = last_logits(model, True)
    assert not torch.equal(wrong[1], loop[1]) and not torch.equal(wrong[4], loop[4])
