"""`draftwise quality`'s measurement (bench/quality.py): teacher-forced KL against the dense reference, top-1
agreement, perplexity, and the issue-32 bar. On a tiny model whose weights are Q8_0 values: our q8_0 kernel over
those exact weights (only int8 activations differ from the dense reference) meets the bar set by a second faithful
computation (the dense weights with activations rounded to Q8_0 in torch, as llama.cpp's CPU path does), and a
planted lossy kernel (the same weights requantized to 4 bits, what `--weights q4x8` did to every tensor) fails it.
About 2 s."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from draftwise.bench import quality
from draftwise.kernels import ggml_blocks
from draftwise.kernels.linear import LINEARS, Q4x8Linear, Q80Linear, available
from draftwise.kernels.probe import probe
from tests.tiny_models import tiny_decoder


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, nn.Linear)]


class _Q8Activations(nn.Module):
    """Dense weights, activations rounded to Q8_0 (per row, per 32) in torch: llama.cpp's CPU arithmetic."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.lin = lin
        self.in_features, self.out_features = lin.in_features, lin.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        g = x.reshape(*x.shape[:-1], -1, 32)
        d = g.abs().amax(-1, keepdim=True) / 127
        xq = torch.where(d > 0, (g / d.clamp(min=1e-30)).round() * d, torch.zeros_like(g)).reshape(x.shape)
        return self.lin(xq)


@pytest.fixture(scope="module")
def models():
    if "q8_0" not in available(probe(bandwidth=False)):
        pytest.skip("our C++ kernels do not build here")
    torch.manual_seed(0)
    ref = tiny_decoder("qwen2", vocab_size=96)
    with torch.no_grad():
        ref.lm_head.weight.mul_(8.0)  # peaked next-token distributions, as a trained model's
        for _, _, lin in _linears(ref):  # the file's weights: Q8_0 values, the reference their exact dense form
            lin.weight.copy_(ggml_blocks.dequantize_q8_0(ggml_blocks.quantize_q8_0(lin.weight)))
    built = {"reference": ref}
    for kind in ("faithful", "baseline", "planted_lossy"):
        m = copy.deepcopy(ref)
        for parent, name, lin in _linears(m):
            w, b = lin.weight.detach(), None if lin.bias is None else lin.bias.detach()
            if kind == "faithful":
                new = Q80Linear(parts=ggml_blocks.quantize_q8_0(w), bias=b)
            elif kind == "baseline":
                new = _Q8Activations(lin)
            else:
                new = Q4x8Linear(w, b)
            setattr(parent, name, new)
        built[kind] = m
    return built


def _row(models, kind: str, ids: list[int]) -> dict:
    ref = np.concatenate([lp.numpy() for lp in quality.teacher_forced(models["reference"], ids, chunk=32)])
    return quality.compare(ref, quality.teacher_forced(models[kind], ids, chunk=32), ids)


def test_the_faithful_kernel_meets_the_bar_and_a_planted_lossy_one_fails_it(models):
    ids = torch.randint(0, 96, (160,), generator=torch.Generator().manual_seed(1)).tolist()
    baseline = _row(models, "baseline", ids)
    faithful = _row(models, "faithful", ids)
    lossy = _row(models, "planted_lossy", ids)
    # the bar's absolute slack (0.002) is sized for real models over 1k tokens; a tiny model's KLs are smaller
    # than it, so here the ratio decides
    assert quality.quality_bar(faithful, baseline, slack=0.0)[0], (faithful, baseline)
    passed, why = quality.quality_bar(lossy, baseline, slack=0.0)
    assert not passed and "mean KL" in why, (lossy, baseline)
    assert lossy["mean_kl"] > 4 * faithful["mean_kl"]
    for row in (baseline, faithful, lossy):
        assert row["tokens"] == len(ids) - 1 and row["reference_perplexity"] == baseline["reference_perplexity"]


def test_the_reference_against_itself_is_zero_kl_and_full_agreement(models):
    ids = list(range(40))
    row = _row(models, "reference", ids)
    assert row["mean_kl"] == 0.0 and row["top1_agreement"] == 1.0
    assert row["perplexity"] == pytest.approx(row["reference_perplexity"])


def test_the_default_text_is_about_a_thousand_tokens_of_code_and_prose():
    text = quality.DEFAULT_TEXT.read_text(encoding="utf-8")
    assert "def " in text and "```python" in text and len(text.split()) > 500


def test_bar_arithmetic():
    base = {"mean_kl": 0.004, "top1_agreement": 0.98}
    assert quality.quality_bar({"mean_kl": 0.0059, "top1_agreement": 0.975}, base)[0]  # within 0.002
    assert not quality.quality_bar({"mean_kl": 0.0061, "top1_agreement": 0.98}, base)[0]
    assert not quality.quality_bar({"mean_kl": 0.004, "top1_agreement": 0.965}, base)[0]
    assert quality.quality_bar({"mean_kl": 0.029, "top1_agreement": 0.98}, {"mean_kl": 0.02, "top1_agreement": 0.98})[0]
    assert "q8_0" in LINEARS


def test_the_dense_reference_rebuilds_exactly_the_kernels_weights():
    from draftwise.kernels.q4x8 import Q4x8Embedding

    q4 = Q4x8Linear(torch.randn(100, 512))
    q8 = Q80Linear(torch.randn(40, 512))
    want4 = Q4x8Embedding.from_linear(q4)(torch.arange(100))
    want8 = ggml_blocks.dequantize_q8_0(ggml_blocks.unpack_q8_0(q8._buffers, 0, 3))[:40]
    for n0, n1 in ((0, 100), (5, 37), (32, 48), (90, 100)):
        assert torch.equal(quality.DenseOnTheFly(q4).weight_rows(n0, n1), want4[n0:n1]), (n0, n1)
    assert torch.equal(quality.DenseOnTheFly(q8).weight_rows(3, 40), want8[3:40])
    x = torch.randn(3, 512)
    assert torch.allclose(quality.DenseOnTheFly(q4)(x), x @ want4.T, atol=1e-5)


def test_a_recorded_quality_run_is_what_kernels_prints_beside_lossy_candidates(monkeypatch, tmp_path):
    """`quality` records each plan's row per model file; `draftwise kernels`' note reads it (no measuring): the
    lossy candidate shows its KL, a file without a record keeps the hint to measure it."""
    from types import SimpleNamespace

    from draftwise.cli import _faithful_note

    monkeypatch.setenv("DRAFTWISE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 10)
    cfg = SimpleNamespace()
    census = {"Q4_K": 3, "Q6_K": 1}
    monkeypatch.setattr("draftwise.models.quant.type_census", lambda types, cfg: census)
    ckpt = SimpleNamespace(info={"path": str(gguf), "converted_path": "c"}, tensor_types=lambda: {"t": "Q4_K"})
    before = _faithful_note(ckpt, cfg, ["q4x8", "fp32"])
    assert "q4x8: LOSSY here" in before and "measures the cost in KL" in before and "fp32" not in before
    row = {"mean_kl": 0.01732, "p99_kl": 0.0787, "top1_agreement": 0.948, "lossy": True}
    quality._record(str(gguf), [{"plan": "q4x8", **row}, {"plan": "faithful", **row, "mean_kl": 0.00608,
                                                          "lossy": False}], 1024)
    assert quality.recorded(str(gguf))["q4x8"]["mean_kl"] == 0.01732
    after = _faithful_note(ckpt, cfg, ["q4x8", "fp32"])
    assert "q4x8: LOSSY here" in after and "mean KL 0.01732, p99 0.0787, top-1 94.8%" in after
    assert "mean KL 0.00608" in after.splitlines()[0]  # the faithful plan's own, on the first line
    assert quality.recorded(str(tmp_path / "other.gguf")) == {}
