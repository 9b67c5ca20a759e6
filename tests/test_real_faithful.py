"""Integration: the packaged GGUFs under `--weights auto` load as the faithful plan (every linear and the embedding
table by the kernel of its stored type, census as the files hold: the 1.5B Q4_K + Q6_K, the 0.5B Q4_K, Q5_0, Q6_K,
Q8_0), row-exact; the real Q6_K / Q8_0 blocks are held exactly (a module's weights equal the gguf package's
dequantization); greedy speculation with the draft model equals plain decoding under the faithful target, with
the draft on its default plan (the fastest, lossy allowed) and on the faithful one. (The
other speculative methods run on the faithful plan in test_real_greedy.py and test_real_suffix.py, whose default
`auto` is now this plan.) About 1-2 minutes with the prepared cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from draftwise import LLM, SamplingParams
from tests.conftest import require_packaged

pytestmark = pytest.mark.integration

CENSUS = {
    "qwen2.5-coder-1.5b-instruct": {"Q4_K": 169, "Q6_K": 29},
    "qwen2.5-coder-0.5b-instruct": {"Q4_K": 12, "Q5_0": 133, "Q6_K": 12, "Q8_0": 13},
}


@pytest.mark.parametrize("name", sorted(CENSUS))
def test_packaged_models_load_faithful_and_hold_their_blocks_exactly(name):
    require_packaged(name)
    from gguf.quants import dequantize

    from draftwise.api import load_model
    from draftwise.kernels.linear import Q6KLinear, Q80Linear
    from draftwise.models.sources import load_checkpoint

    model, _, info = load_model(name, weights="auto")
    plan = model.plan
    assert plan.faithful and info["weights"] == "faithful" and plan.row_exact
    assert plan.stored_types == CENSUS[name]
    head = model.lm_head
    assert isinstance(head, Q6KLinear if name.startswith("qwen2.5-coder-1.5b") else Q80Linear)
    item = load_checkpoint(name).gguf().items()["lm_head.weight"]
    raw = item.raw_rows()[:64].numpy()
    want = dequantize(raw, item._t.tensor_type).reshape(64, -1).astype(np.float32)
    assert torch.equal(head.dense_rows(0, 64), torch.from_numpy(want))


def test_default_pair_draft_speculation_equals_plain_under_the_faithful_target():
    require_packaged("qwen2.5-coder-1.5b-instruct")
    require_packaged("qwen2.5-coder-0.5b-instruct")
    from draftwise.equivalence import run_engine

    llm = LLM("qwen2.5-coder-1.5b-instruct", max_num_seqs=2, max_model_len=256, k_max=4)
    assert llm.model.plan.faithful
    prompts = [llm.tokenizer.encode(p) for p in ("def fibonacci(n):", "The three laws of thermodynamics are")]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts)
    spec = {"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4}
    plain = run_engine(llm, None, prompts, params)
    assert run_engine(llm, spec, prompts, params) == plain  # the draft's default: the autotuner's fastest plan
    assert llm.draft_info["plan"]["role"] == "draft" and not llm.draft_info["plan"]["faithful"]
    assert run_engine(llm, {**spec, "draft_weights": "faithful"}, prompts, params) == plain
    assert llm.draft_info["plan"]["faithful"]
