"""Mixture-of-experts targets (issue 46): tiny random Qwen3-MoE, Qwen2-MoE and Mixtral checkpoints made with
transformers (fp32, the tiny byte-level BPE tokenizer), loaded from their HF directories and from GGUF files written
as llama.cpp writes them (stacked experts): logits within 1e-4 of transformers', greedy continuation under
`--weights fp32` identical to transformers'; n-gram and draft-model greedy speculation (the draft a small dense model
of the same tokenizer) equal plain decoding; sampled speculation keeps the target's distribution (chi-square); the
dispatch is row-exact (a planted batch-order dispatch is caught). About 60 s."""
from __future__ import annotations

import pytest
import torch

from draftwise.api import LLM, load_model
from draftwise.equivalence import next_logits, run_engine, sampling_check
from draftwise.kv_cache import KVCache
from draftwise.models.transformer import SparseMoE
from draftwise.sampling import SamplingParams
from tests.tiny_checkpoints import MOE_FAMILIES, write_tiny_hf_dir, write_tiny_moe_gguf, write_tiny_moe_hf_dir

PROMPT = "The quick brown fox jumps over the lazy dog. def hello(name):"


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """family -> (HF checkpoint dir, GGUF path, the transformers model both were written from)."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for family in MOE_FAMILIES:
        hf = write_tiny_moe_hf_dir(root / f"{family}-hf", family, seed=3)
        gguf_hf, _ = write_tiny_moe_gguf(root / f"{family}.gguf", family, seed=3)
        for (_, a), (_, b) in zip(hf.state_dict().items(), gguf_hf.state_dict().items()):
            assert torch.equal(a, b)  # one model in both files
        out[family] = (root / f"{family}-hf", root / f"{family}.gguf", hf)
    return out


@pytest.fixture(scope="module")
def dense_draft(tmp_path_factory):
    """A small dense llama of the same tokenizer (a draft for the MoE targets)."""
    path = tmp_path_factory.mktemp("draft") / "tiny-llama"
    write_tiny_hf_dir(path)
    return path


def _new_cache(model, slots=4, capacity=96):
    c = model.config
    return KVCache(c.num_layers, slots, c.num_kv_heads, capacity, c.head_dim, model.dtype)


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_logits_match_transformers(moe, family, source, tmp_path):
    hf_dir, gguf_path, hf = moe[family]
    model, tok, _ = load_model(str(hf_dir if source == "hf" else gguf_path), weights="fp32",
                               cache_dir=str(tmp_path / "c"))
    assert model.config.architecture == family and model.config.num_experts == 8
    assert any(isinstance(layer.mlp, SparseMoE) for layer in model.model.layers)
    ids = tok.encode(PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]  # [T, V]
    cache = _new_cache(model)
    T = len(ids)
    full = model(torch.tensor([ids]), torch.arange(T)[None], cache, torch.tensor([0]), num_tokens=[T])[0]
    assert (full - ref).abs().max().item() < 1e-4
    # a prefix, single steps, then a verification-shaped chunk: each row as transformers computes it
    parts = [model(torch.tensor([ids[:6]]), torch.arange(6)[None], cache, torch.tensor([1]), num_tokens=[6])[0]]
    for t in range(6, 9):
        parts.append(model(torch.tensor([[ids[t]]]), torch.tensor([[t]]), cache, torch.tensor([1]), num_tokens=[1])[0])
    parts.append(model(torch.tensor([ids[9:]]), torch.arange(9, T)[None], cache, torch.tensor([1]),
                       num_tokens=[T - 9])[0])
    assert (torch.cat(parts) - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_continuation_equals_transformers(moe, family, tmp_path):
    hf_dir, gguf_path, hf = moe[family]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for path in (hf_dir, gguf_path):
        llm = LLM(str(path), weights="fp32", max_num_seqs=2, max_model_len=128, cache_dir=str(tmp_path / "c"))
        ids = llm.tokenizer.encode(PROMPT)
        got = run_engine(llm, None, [ids], [params])[0]
        assert got == _hf_greedy(hf, ids, 32), path


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_speculation_equals_plain(moe, dense_draft, family, tmp_path):
    hf_dir, _, _ = moe[family]
    llm = LLM(str(hf_dir), weights="fp32", max_num_seqs=3, max_model_len=160, k_max=8, cache_dir=str(tmp_path / "c"))
    prompts = [llm.tokenizer.encode(t) for t in (PROMPT, "print(sum(range(10))) print(sum(range(10)))",
                                                 "The dog sleeps. The dog sleeps. The")]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts)
    plain = run_engine(llm, None, prompts, params)
    for spec in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
                 {"method": "ngram", "num_speculative_tokens": "auto"},
                 {"method": "draft_model", "model": str(dense_draft), "num_speculative_tokens": 3}):
        assert run_engine(llm, spec, prompts, params) == plain, spec


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_sampled_speculation_keeps_the_targets_distribution(moe, dense_draft, family, tmp_path):
    hf_dir, _, _ = moe[family]
    spec = {"method": "draft_model", "model": str(dense_draft), "num_speculative_tokens": 2}
    llm = LLM(str(hf_dir), weights="fp32", max_num_seqs=16, max_model_len=64, speculative_config=spec, seed=5,
              cache_dir=str(tmp_path / "c"))
    ids = llm.tokenizer.encode("The dog")
    result = sampling_check(llm, ids, 600, SamplingParams(temperature=0.8, top_k=3))
    print(family, result)
    assert result["passed"] and result["cells"] > 5


# ---- row-exact dispatch ------------------------------------------------------------------------------------------

class _RowByRow(torch.nn.Module):
    """A linear that computes each row in its own call: row-exact by construction, so only the dispatch's own
    arithmetic can make a row depend on the others."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):  # [..., K] -> [..., N]
        flat = x.reshape(-1, x.shape[-1])
        rows = [torch.nn.functional.linear(flat[i:i + 1], self.weight) for i in range(flat.shape[0])]
        return torch.cat(rows).reshape(*x.shape[:-1], -1)


def _row_exact_moe(hf_dir, tmp_path) -> SparseMoE:
    model, _, _ = load_model(str(hf_dir), weights="fp32", cache_dir=str(tmp_path / "c"))
    moe = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE))
    for mlp in list(moe.experts) + ([moe.shared_expert] if moe.shared else []):
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(mlp, name, _RowByRow(getattr(mlp, name).weight))
        mlp.gate_up_proj = None
    return moe


def _rows_alone_equal_rows_together(moe: SparseMoE) -> bool:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 24, moe.gate.weight.shape[1], generator=g)  # [B, T, H]: rows sharing experts in many ways
    with torch.inference_mode():
        together = moe(x)
        alone = torch.cat([moe(x[b:b + 1, t:t + 1]) for b in range(3) for t in range(24)]).view_as(x)
    return torch.equal(together, alone)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_rows_result_does_not_depend_on_who_shares_its_experts(moe, family, tmp_path):
    assert _rows_alone_equal_rows_together(_row_exact_moe(moe[family][0], tmp_path))


def test_a_batch_order_dispatch_is_caught(moe, tmp_path, monkeypatch):
    """Planted: each row's expert outputs summed in the order its experts first appear in the batch (as a loop
    over experts in order of appearance, adding into the rows, would): a row's bits then depend on its
    neighbours' choices, and the check above must see it."""

    def batch_order(self, x):
        B, T, H = x.shape
        rows = x.reshape(B * T, H)
        experts, weights = self.route(rows)
        out = torch.zeros_like(rows)
        seen = list(dict.fromkeys(experts.flatten().tolist()))  # experts in order of first appearance
        for e in seen:
            m, j = torch.nonzero(experts == e, as_tuple=True)
            out.index_add_(0, m, self.experts[e](rows[m], tokens=T) * weights[m, j, None])
        if self.shared:
            out = out + torch.sigmoid(self.shared_expert_gate(rows)).float() * self.shared_expert(rows, tokens=T)
        return out.view(B, T, H)

    moe_block = _row_exact_moe(moe["qwen3_moe"][0], tmp_path)
    assert _rows_alone_equal_rows_together(moe_block)
    monkeypatch.setattr(SparseMoE, "forward", batch_order)
    assert not _rows_alone_equal_rows_together(moe_block)


def test_olmoe_from_a_transformers_checkpoint(tmp_path):
    """OLMoE (its q/k RMSNorms span the whole projection, no renormalisation of the top-k): logits within 1e-4 of
    transformers' and the same greedy continuation; n-gram speculation equals plain."""
    hf = write_tiny_moe_hf_dir(tmp_path / "olmoe", "olmoe", seed=3)
    llm = LLM(str(tmp_path / "olmoe"), weights="fp32", max_num_seqs=2, max_model_len=128, k_max=4,
              cache_dir=str(tmp_path / "c"))
    model = llm.model
    assert model.config.architecture == "olmoe" and model.config.qk_norm_full and not model.config.norm_topk_prob
    ids = llm.tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    T = len(ids)
    got = model(torch.tensor([ids]), torch.arange(T)[None], _new_cache(model), torch.tensor([0]), num_tokens=[T])[0]
    assert (got - ref).abs().max().item() < 1e-4
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = run_engine(llm, None, [ids], [params])[0]
    assert plain == _hf_greedy(hf, ids, 24)
    assert run_engine(llm, {"method": "ngram", "num_speculative_tokens": 4}, [ids], [params])[0] == plain


def test_the_router_is_no_plan_linear_and_stays_float32(moe, tmp_path):
    """The router and the shared expert's gate are never swapped for a quantized kernel (llama.cpp keeps
    ffn_gate_inp in F32 as well): a plan's linears are the experts' and attention's only."""
    from draftwise.models.transformer import Router

    model, _, _ = load_model(str(moe["qwen2_moe"][0]), weights="fp32", cache_dir=str(tmp_path / "c"))
    layer = model.model.layers[0].mlp
    assert isinstance(layer.gate, Router) and isinstance(layer.shared_expert_gate, Router)
    assert layer.gate.weight.dtype == torch.float32 and tuple(layer.gate.weight.shape) == (8, 32)
    ids = [5, 6, 7]
    assert next_logits(model, [ids]).shape[-1] == model.config.vocab_size


# ---- GGUF experts in their stored types ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quantized_moe(tmp_path_factory):
    """A qwen2_moe GGUF at K % 256 == 0 with its experts as llama.cpp's Q4_K_M mix stores them (gate/up Q4_K,
    down Q6_K), the shared expert and attention in Q8_0; router and norms F32."""
    from draftwise.kernels.linear import available
    from draftwise.kernels.probe import probe

    if "q8_0" not in available(probe(bandwidth=False)):
        pytest.skip("our C++ kernels do not build here")
    from tests.tiny_checkpoints import MOE_Q4K_DIMS

    path = tmp_path_factory.mktemp("qmoe") / "tiny-qwen2moe-q4km.gguf"
    types = {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q6_K", "ffn_gate_shexp": "Q8_0",
             "ffn_up_shexp": "Q8_0", "ffn_down_shexp": "Q8_0", "attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0",
             "attn_output": "Q8_0", "token_embd": "Q8_0", "output": "Q8_0"}
    write_tiny_moe_gguf(path, "qwen2_moe", seed=4, dims=MOE_Q4K_DIMS, types=types)
    return path


def test_gguf_experts_load_in_their_stored_types_without_a_float_copy(quantized_moe, tmp_path, monkeypatch):
    from draftwise.kernels.linear import Q4x8Linear, Q6KLinear, Q80Linear
    from draftwise.models.gguf import GGUFTensor

    dense = GGUFTensor.dense

    def no_float_experts(self):
        assert self.expert is None, f"{self.name} dequantized to float at load"
        return dense(self)

    cache = str(tmp_path / "c")
    with monkeypatch.context() as m:
        m.setattr(GGUFTensor, "dense", no_float_experts)
        model, _, _ = load_model(str(quantized_moe), weights="auto", cache_dir=cache)
    plan = model.plan
    assert plan.faithful and plan.row_exact and not plan.lossy_types
    moe = model.model.layers[1].mlp
    assert isinstance(moe, SparseMoE) and len(moe.experts) == 8
    for expert in moe.experts:
        assert isinstance(expert.gate_up_proj, Q4x8Linear) and isinstance(expert.down_proj, Q6KLinear)
    assert isinstance(moe.shared_expert.down_proj, Q80Linear)

    reference, _, _ = load_model(str(quantized_moe), weights="fp32", cache_dir=cache)
    ids = list(range(3, 40))
    ref, got = next_logits(reference, [ids])[0], next_logits(model, [ids])[0]
    # the same weights: int8 activations only (a token near a top-k tie may take another expert: looser than dense)
    assert float((got - ref).norm() / ref.norm()) < 0.06
    ref_moe = reference.model.layers[1].mlp
    x = torch.randn(5, 1, 256, generator=torch.Generator().manual_seed(2))  # [rows, 1, hidden]
    for e in (0, 7):  # each expert's kernel against the exact float weights of the file
        want = ref_moe.experts[e].down_proj(x[..., :256])
        have = moe.experts[e].down_proj(x[..., :256])
        assert float((have - want).norm() / want.norm()) < Q6KLinear.tolerance
    again, _, _ = load_model(str(quantized_moe), weights="auto", cache_dir=cache)  # from the prepared cache
    assert torch.equal(next_logits(again, [ids])[0], got)


def test_verification_rows_are_bitwise_single_steps_under_the_faithful_plan(quantized_moe, tmp_path):
    """Three sequences verified together (4 rows each, padded) give each row exactly the bits of single steps
    taken alone: the experts a row shares with the batch change nothing."""
    model, _, _ = load_model(str(quantized_moe), weights="auto", cache_dir=str(tmp_path / "c"))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 9, 7)]
    steps = [torch.randint(3, 300, (4,), generator=g).tolist() for _ in prompts]
    cache = _new_cache(model, slots=8)
    for slot, p in enumerate(prompts):
        model(torch.tensor([p]), torch.arange(len(p))[None], cache, torch.tensor([slot]), num_tokens=[len(p)])
        model(torch.tensor([p]), torch.arange(len(p))[None], cache, torch.tensor([slot + 4]), num_tokens=[len(p)])
    lens = [len(p) for p in prompts]
    width = [4, 3, 4]  # one row of padding for the second sequence
    ids = torch.tensor([s[:w] + [0] * (4 - w) for s, w in zip(steps, width)])
    pos = torch.tensor([[n + i for i in range(4)] for n in lens])
    together = model(ids, pos, cache, torch.tensor([0, 1, 2]), num_tokens=width)
    for b, (s, n) in enumerate(zip(steps, lens)):
        for i in range(width[b]):
            alone = model(torch.tensor([[s[i]]]), torch.tensor([[n + i]]), cache, torch.tensor([b + 4]), num_tokens=[1])
            assert torch.equal(together[b, i], alone[0, 0]), (b, i)


def test_greedy_speculation_equals_plain_on_a_quantized_moe_gguf(quantized_moe, tmp_path):
    llm = LLM(str(quantized_moe), max_num_seqs=3, max_model_len=128, k_max=8, cache_dir=str(tmp_path / "c"))
    assert llm.model.plan.faithful
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10], [12, 13, 14, 15, 16, 12, 13, 14]]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * len(prompts)
    plain = run_engine(llm, None, prompts, params)
    for spec in ({"method": "ngram", "num_speculative_tokens": 4}, {"method": "suffix", "num_speculative_tokens": 4}):
        assert run_engine(llm, spec, prompts, params) == plain, spec


def test_experts_touched_counts_the_union_a_forward_read(moe, tmp_path):
    model, _, _ = load_model(str(moe["qwen3_moe"][0]), weights="fp32", cache_dir=str(tmp_path / "c"))
    cache = _new_cache(model)
    model(torch.tensor([[5]]), torch.tensor([[0]]), cache, torch.tensor([0]), num_tokens=[1])
    assert model.experts_touched() == [4, 4]  # two sparse layers (layer 1 is dense), top-4 each
    ids = list(range(10, 19))
    model(torch.tensor([ids]), torch.arange(1, 10)[None], cache, torch.tensor([0]), num_tokens=[9])
    assert all(4 <= n <= 8 for n in model.experts_touched())  # 9 rows x top-4 of 8 experts: a union
    assert any(n > 4 for n in model.experts_touched())


def test_grouped_experts_are_bitwise_the_python_loop(quantized_moe, tmp_path, monkeypatch):
    """kernels/experts.py's one C++ call per layer (each routed expert's kernels once over all its rows) gives
    bitwise the Python loop's outputs, on a prompt (many rows per expert: the wide kernels too, forced on from 2
    rows) and on single steps; and the grouped path is the one the faithful plan runs."""
    model, _, _ = load_model(str(quantized_moe), weights="auto", cache_dir=str(tmp_path / "c"))
    moe = model.model.layers[1].mlp
    assert moe._grouped_op() is not None
    ids = list(range(3, 43))
    wide = {k: getattr(torch.ops, f"draftwise_{k}") for k in ("q4x8", "q6k")}
    before = {k: int(ops.wide_min_rows()) for k, ops in wide.items()}
    outs = {}
    try:
        for rows in (before, {"q4x8": 2, "q6k": 2}):
            for k, ops in wide.items():
                ops.set_wide_min_rows(rows[k])
            for grouped in (True, False):
                monkeypatch.setattr(SparseMoE, "grouped", grouped)
                cache = _new_cache(model)
                T = len(ids)
                prompt = model(torch.tensor([ids]), torch.arange(T)[None], cache, torch.tensor([0]), num_tokens=[T])
                step = model(torch.tensor([[7]]), torch.tensor([[T]]), cache, torch.tensor([0]), num_tokens=[1])
                outs[(rows is before, grouped)] = (prompt, step, model.experts_touched())
    finally:
        for k, ops in wide.items():
            ops.set_wide_min_rows(before[k])
    first = outs[(True, True)]
    for key, got in outs.items():
        assert torch.equal(got[0], first[0]) and torch.equal(got[1], first[1]), key
        assert got[2] == first[2], key


def test_the_step_cost_calibration_routes_like_text_not_one_token(moe, tmp_path):
    """kernels/step_cost.py times verification widths with token ids spread over the vocabulary: on a mixture of
    experts a wide calibration forward reads the union of many rows' experts (as a verification of real text does),
    not the top-k of one repeated token."""
    from draftwise.kernels.step_cost import measure_grid

    model, _, _ = load_model(str(moe["qwen3_moe"][0]), weights="fp32", cache_dir=str(tmp_path / "c"))
    top_k = model.config.num_experts_per_tok
    grid = measure_grid(model, max_batch=1, max_width=8, rounds=1, context=16)
    assert set(grid) >= {(1, 1), (1, 8)}
    assert any(n > top_k for n in model.experts_touched())  # the last cell timed: 1 row x 8 tokens


def test_grouped_experts_split_over_threads_changes_no_bit(quantized_moe, tmp_path):
    """csrc/experts.cpp splits a call whose experts have few rows each (a decode or verification step) over its
    experts, one thread running an expert's gate/up, activation and down whole: at 2 threads every row is bitwise
    what 1 thread (no split) and the Python loop give, for 1 row, a verification's 9 rows, and a prompt's 40 (past
    the split's row limit: the kernels' own split), through the direct path's raw GEMVs and through the ops. Planted: a split whose threads each sum their own experts'
    products, the two halves added after (a per-thread reduction: another order of the row's sum), is caught."""
    from draftwise.kernels import experts as experts_op

    model, _, _ = load_model(str(quantized_moe), weights="auto", cache_dir=str(tmp_path / "c"))
    moe = model.model.layers[1].mlp
    op = moe._grouped_op()
    assert op is not None and op.direct()  # Q4_K gate/up, Q6_K down: the kinds with raw GEMVs
    H = moe.gate.weight.shape[1]
    g = torch.Generator().manual_seed(5)
    threads = torch.get_num_threads()
    try:
        for M in (1, 9, 40):
            x = torch.randn(M, H, generator=g)  # [M, H] float32
            # 4 experts a row (the file routes top-2, whose two-term sums no order changes): [M, 4], [M, 4]
            chosen = torch.stack([torch.randperm(moe.num_experts, generator=g)[:4].sort().values for _ in range(M)])
            weights = torch.rand(M, 4, generator=g)
            with torch.inference_mode():
                outs = []
                for direct in (True, False):  # the raw GEMVs (csrc/gemv_rows.h), then the ops
                    before = torch.ops.draftwise_experts.use_direct(direct)
                    try:
                        for n in (2, 1, 2):
                            torch.set_num_threads(n)
                            outs.append(experts_op.run(op, x, chosen, weights))  # [M, H]
                    finally:
                        torch.ops.draftwise_experts.use_direct(before)
                loop = torch.zeros_like(x)
                for m in range(M):  # the Python loop's sum: a row's weighted products in ascending expert order
                    ys = [moe.experts[e](x[m:m + 1], tokens=M)[0] * weights[m, j]
                          for j, e in enumerate(chosen[m].tolist())]
                    loop[m] = ys[0]
                    for y in ys[1:]:
                        loop[m] = loop[m] + y
            assert len(set(chosen.flatten().tolist())) > 1
            for got in outs:
                assert torch.equal(got, outs[1]), M
            assert torch.equal(outs[1], loop), M
    finally:
        torch.set_num_threads(threads)


# ---- mixture layers in the one-call layer loop (kernels/stack.py) -------------------------------------------------

Q4K_M_TYPES = {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q6_K", "ffn_gate_shexp": "Q4_K",
               "ffn_up_shexp": "Q4_K", "ffn_down_shexp": "Q6_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K",
               "ffn_down": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K"}


@pytest.fixture(scope="module")
def stackable_moe(tmp_path_factory):
    """family -> a GGUF in the Q4_K_M mix (experts, shared expert, dense MLP and attention in Q4_K / Q6_K), 3 layers
    (qwen3_moe: layer 1 dense), top-4 of 8 (a row's sum has 4 terms, so its order matters): every layer can run in
    the one-call layer loop."""
    from draftwise.kernels import stack as stack_op
    from tests.tiny_checkpoints import MOE_Q4K_DIMS

    if not stack_op.available():
        pytest.skip("our C++ kernels do not build here")
    root = tmp_path_factory.mktemp("stackmoe")
    out = {}
    for family in ("qwen3_moe", "qwen2_moe", "mixtral"):
        out[family] = root / f"{family}.gguf"
        write_tiny_moe_gguf(out[family], family, seed=6, dims={**MOE_Q4K_DIMS, "layers": 3, "top_k": 4},
                            types=Q4K_M_TYPES)
    return out


def _steps(model) -> list[torch.Tensor]:
    """Two prompts (15 and 9 tokens, padded: the Python loop), a decode step of both, a verification of 5 and 3
    tokens (10 rows), a token tree of 4 rows and a decode step of one: the logits of each, every layer's K/V and each
    step's experts_touched."""
    c = model.config
    cache = KVCache(c.num_layers, 2, c.num_kv_heads, 64, c.head_dim, model.dtype)
    slots = torch.tensor([0, 1])
    ids = torch.randint(3, c.vocab_size, (2, 30), generator=torch.Generator().manual_seed(4))
    out, touched = [], []

    def step(*args, **kwargs):
        out.append(model(*args, **kwargs))
        touched.append(model.experts_touched())

    step(ids[:, :15], torch.arange(15)[None].expand(2, 15), cache, slots, num_tokens=[15, 9])
    lens = torch.tensor([15, 9])[:, None]
    step(ids[:, 15:16], lens, cache, slots, num_tokens=[1, 1])
    step(ids[:, 16:21], lens + 1 + torch.arange(5)[None], cache, slots, num_tokens=[5, 3])
    cache.truncate(0, 18)  # the first sequence kept 2 of its 5 guesses
    tree = torch.tensor([[0b1, 0b11, 0b101, 0b1001]])  # a root and three children
    step(ids[:1, 21:25], 18 + torch.arange(4)[None], cache, slots[:1], num_tokens=[4], ancestors=tree,
         rope_positions=torch.tensor([[18, 19, 19, 19]]))
    cache.truncate(0, 19)
    step(ids[:1, 25:26], torch.tensor([[19]]), cache, slots[:1], num_tokens=[1])
    held = [cache.gather(s, cache.lengths[s]) for s in (0, 1)]
    return out + [t for keys, values in held for t in keys + values], touched


@pytest.fixture
def stacked_calls(monkeypatch):
    """The row counts of the forwards that went through the one-call layer loop."""
    from draftwise.kernels import stack as stack_op

    seen = []
    real = stack_op.layers

    def spy(x, *args, **kwargs):
        seen.append(x.shape[0] * x.shape[1])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(stack_op, "layers", spy)
    return seen


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_mixture_layers_in_the_one_call_loop_are_bitwise_the_python_loop(stackable_moe, family, tmp_path,
                                                                        stacked_calls):
    """A mixture layer in the one C++ call (router logits, route, the ExpertSet, qwen2_moe's gated shared expert,
    the residual add) gives bitwise the Python loop's logits and K/V at decode, verification and token-tree widths,
    and the same experts_touched; prompts (more rows than the router's few-row op takes) keep the Python loop."""
    from draftwise.models.transformer import Decoder

    model, _, _ = load_model(str(stackable_moe[family]), weights="auto", cache_dir=str(tmp_path / "c"))
    assert model.plan.faithful
    mixtures = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoE)]
    assert len(mixtures) == (2 if family == "qwen3_moe" else 3) and mixtures[0].top_k == 4
    assert mixtures[0].shared == (family == "qwen2_moe")
    one_call, touched_one = _steps(model)
    assert stacked_calls == [2, 10, 4, 1]  # every step; not the prompts' 30 rows
    model.stack = False
    loop, touched_loop = _steps(model)
    assert len(stacked_calls) == 4
    assert touched_one == touched_loop and any(n > 4 for n in touched_one[2])
    for a, b in zip(one_call, loop):
        assert torch.equal(a, b)
    assert Decoder.stack is True


@pytest.mark.parametrize("plant", ["no renormalisation", "shared expert skipped", "routed by another layer"])
def test_the_mixture_comparison_catches_a_changed_layer(stackable_moe, plant, tmp_path, monkeypatch):
    """Planted in the one call's arguments: the top-k weights left unnormalised (qwen3_moe renormalises), the
    shared expert left out (qwen2_moe), layer 0 routed by layer 2's router: each changes the logits, so the
    equality above is not vacuous about routing, the shared expert or which layer's router runs."""
    from draftwise.kernels import stack as stack_op

    family = "qwen2_moe" if plant == "shared expert skipped" else "qwen3_moe"
    model, _, _ = load_model(str(stackable_moe[family]), weights="auto", cache_dir=str(tmp_path / "c"))
    model.stack = False
    loop, _ = _steps(model)
    model.stack = True
    real = stack_op.layers
    n = stack_op.SLOTS
    router = n - 2  # csrc/stack.cpp's Slot order ends with ROUTER, SHARED_GATE

    def planted(x, weights, kinds, ffn, experts, *rest):
        weights, ffn = list(weights), list(ffn)
        if plant == "no renormalisation":
            ffn[2] = 0  # layer 0's norm_topk
        elif plant == "shared expert skipped":
            ffn[0] = 0  # layer 0's shared expert width: none
            kinds = list(kinds)
            kinds[4] = kinds[5] = stack_op.ABSENT
        else:
            weights[router] = weights[2 * n + router]
        return real(x, weights, kinds, ffn, experts, *rest)

    monkeypatch.setattr(stack_op, "layers", planted)
    wrong, _ = _steps(model)
    assert not all(torch.equal(a, b) for a, b in zip(wrong[1:4], loop[1:4]))
