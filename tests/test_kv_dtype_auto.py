"""--kv-cache-dtype auto (config.auto_kv_cache_dtype through kv_cache.kv_dtype): bfloat16 where our C++ attention
reads K/V (float32 activations on the fused CPU path), the activation dtype elsewhere; under what auto picks,
greedy speculation equals plain decoding for ngram, a draft model and suffix trees (speculation and plain decoding
read the same K/V bits), and a dtype the fused path cannot widen (float16) is refused, not silently run. The
quality side of auto's choice (KL against float32 K/V on the packaged models) is measured by bench/quality.py
kv_dtype_quality and quoted in docs/PERFORMANCE.md, not asserted here. About 6 s."""
from __future__ import annotations

import pytest
import torch

from draftwise.api import LLM
from draftwise.config import ConfigError, auto_kv_cache_dtype
from draftwise.kv_cache import kv_dtype
from draftwise.sampling import SamplingParams
from tests.harness import PROMPTS, tiny_tokenizer
from tests.test_kernels_stack import q4x8_model


def test_auto_picks_bfloat16_only_where_our_attention_widens_it():
    assert auto_kv_cache_dtype("float32", True) == "bfloat16"
    assert auto_kv_cache_dtype("float32", False) == "float32"
    assert auto_kv_cache_dtype("bfloat16", False) == "bfloat16"
    assert kv_dtype("auto", torch.float32, fused=True) == torch.bfloat16
    assert kv_dtype("auto", torch.float32, fused=False) == torch.float32  # the torch path (CUDA, no C++ build)
    assert kv_dtype("auto", torch.bfloat16, fused=False) == torch.bfloat16
    assert kv_dtype("float32", torch.float32, fused=True) == torch.float32  # an explicit choice wins
    with pytest.raises(ConfigError, match="float32 or bfloat16 only"):  # our op cannot widen float16: refused
        kv_dtype("float16", torch.float32, fused=True)


SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3},
    "draft": {"method": "draft_model", "model": "d", "num_speculative_tokens": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
}


@pytest.fixture(scope="module")
def target():
    model = q4x8_model("qwen2")
    if not getattr(model, "fused", False):
        pytest.skip("our C++ kernels do not build here: auto keeps the activation dtype")
    return model


@pytest.mark.parametrize("method", list(SPECS))
def test_auto_kv_dtype_speculative_greedy_equals_plain(target, method):
    tok = tiny_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = PROMPTS[:3] + PROMPTS[:1]  # the repeat gives suffix its cross-request tree
    outs = {}
    for name, config in (("plain", None), ("spec", SPECS[method])):
        llm = LLM.from_parts(target, tok, speculative_config=config, max_model_len=128,
                             load_draft=lambda n, d, w: (q4x8_model("qwen2", seed=1), tok, {"name": n}))
        assert llm.kv_cache_dtype == torch.bfloat16 and llm.engine.cache.keys[0].dtype == torch.bfloat16
        if name == "spec" and method == "draft":
            assert llm.proposer.cache.keys[0].dtype == torch.bfloat16
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["spec"] == outs["plain"]
