"""`draftwise tune`'s choice: a conservative winner, and our and vLLM's command lines for it."""
import json

import pytest

from draftwise.bench import tune


def _report(per_prompt: dict[str, list[float]]) -> dict:
    return {"segments": {"s@c1": {"speedups": {c: {"tok_s": {"per_prompt": dict(enumerate(v))}}
                                               for c, v in per_prompt.items()}}}}


def test_tune_picks_conservatively():
    pick = tune.choose(_report({
        "ngram-k8": [1.0, 1.0, 1.0, 3.0, 3.0, 0.9, 1.0, 3.0],  # higher mean, but a typical prompt gains nothing
        "ngram-k3": [1.2, 1.25, 1.3, 1.2, 1.25, 1.3, 1.2, 1.25],
    }))
    assert pick["winner"] == "ngram-k3"
    assert pick["scores"]["ngram-k3"]["score"] == pytest.approx(1.25 - 0.05)
    assert tune.choose(_report({"ngram-k2": [0.9, 1.0, 1.1, 0.95]}))["winner"] == "none"


def test_command_lines():
    spec_config = tune.spec_config_for({"method": "draft_model", "k": 4, "draft": "qwen2.5-coder-0.5b-instruct"})
    assert spec_config == {"method": "draft_model", "num_speculative_tokens": 4, "model": "qwen2.5-coder-0.5b-instruct"}
    line = tune.vllm_line("qwen2.5-coder-1.5b-instruct", spec_config)
    assert line.startswith("vllm serve Qwen/Qwen2.5-Coder-1.5B-Instruct --speculative-config '")
    cfg = json.loads(line.split("'")[1])
    assert cfg == {"method": "draft_model", "num_speculative_tokens": 4, "model": "Qwen/Qwen2.5-Coder-0.5B-Instruct"}
    ngram = json.loads(tune.vllm_line("x", {"method": "ngram", "num_speculative_tokens": 5}).split("'")[1])
    assert ngram["prompt_lookup_max"] == 3 and ngram["prompt_lookup_min"] == 1
    assert tune.vllm_line("some/model", None) == "vllm serve some/model"
    assert tune.spec_config_for({"method": "none", "k": 0, "draft": None}) is None


def test_suffix_lines_carry_vllms_suffix_keys():
    spec_config = tune.spec_config_for({"method": "suffix", "k": 16, "draft": None})
    cfg = json.loads(tune.vllm_line("x", spec_config).split("'")[1])
    assert cfg == {"method": "suffix", "num_speculative_tokens": 16, "suffix_decoding_max_tree_depth": 24,
                   "suffix_decoding_max_cached_requests": 10000, "suffix_decoding_max_spec_factor": 1.0,
                   "suffix_decoding_min_token_prob": 0.1}
    auto = tune.vllm_line("x", tune.spec_config_for({"method": "suffix", "k": "auto"}))
    assert "--speculative-config" not in auto and '"auto"' in auto and "ceiling" in auto  # vLLM takes a fixed k
    chain = tune.vllm_line("x", tune.spec_config_for({"method": "suffix-chain", "k": 8}))
    assert "--speculative-config" not in chain and "suffix_tree" in chain and "always proposes token trees" in chain
