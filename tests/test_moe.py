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
