"""Integration: fp32 greedy decoding of the packaged real models through draftwise equals HF transformers'
greedy decoding token for token (5 prompts x 32 tokens), and speculative greedy decoding of the default
pair equals plain decoding (k = 2 and 5, both methods).

The HF reference model is built from transformers' own reading of the GGUF config and the tensors draftwise
converted (test_real_models_loading checks those tensors equal transformers' GGUF loader). HF's greedy choice at every
position is read from one forward over the prompt and draftwise's answer (teacher forcing): each argmax equal to the
token draftwise chose there is, by induction over the positions, HF's greedy decoding of the same 32 tokens; a
position where they differ sends that prompt through HF's own `generate` (its decode path), which must then agree."""
from __future__ import annotations

import pytest
import torch

from draftwise import LLM, SamplingParams
from tests.conftest import require_packaged

pytestmark = pytest.mark.integration

PROMPTS = [
    "def quicksort(xs):",
    "The capital of France is",
    "Write a haiku about the sea.\n",
    "import numpy as np\n\n# compute the mean of each row\n",
    "Q: What is 17 * 23?\nA:",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
SPEC_GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)  # 1.5B fp32 is slow here


@pytest.mark.parametrize("name", ["gemma-3-270m", "qwen2.5-coder-0.5b-instruct"])
def test_greedy_matches_transformers(name):
    require_packaged(name)
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    llm = LLM(name, dtype="float32", weights="fp32", max_num_seqs=5, max_model_len=256,  # dense: compared with HF
              kv_cache_dtype="float32")  # HF's eager attention keeps float32 K/V (auto would store bfloat16)
    outs = llm.generate(PROMPTS, GREEDY)
    path = llm.model_info["path"]
    folder, file = path.rsplit("/", 1)
    ref_config = AutoConfig.from_pretrained(folder, gguf_file=file)
    ref_config._attn_implementation = "eager"
    with no_init_weights():  # every weight is loaded next: its random initialisation would be thrown away
        hf = AutoModelForCausalLM.from_config(ref_config, dtype=torch.float32).eval()
    state = {n: p for n, p in llm.model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    for prompt, out in zip(PROMPTS, outs):
        mine = out.outputs[0].token_ids
        assert len(mine) == 32
        n = len(out.prompt_token_ids)
        ids = torch.tensor([out.prompt_token_ids + mine[:-1]])  # [1, n + 31]
        with torch.no_grad():
            greedy = hf(ids, attention_mask=torch.ones_like(ids)).logits[0, n - 1:].argmax(-1).tolist()  # [32]
        if greedy != mine:  # a near-tie decided differently by the prefill's arithmetic: HF's decode path decides
            prompt_ids = ids[:, :n]
            with torch.no_grad():
                ref = hf.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=False,
                                  max_new_tokens=32, min_new_tokens=32, eos_token_id=None, pad_token_id=0)
            assert mine == ref[0, n:].tolist(), prompt


@pytest.mark.parametrize("spec_config", [
    {"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 2},
    {"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 5},
    {"method": "ngram", "num_speculative_tokens": 2},
    {"method": "ngram", "num_speculative_tokens": 5},
])
def test_default_pair_speculative_greedy_equals_plain(spec_config, default_target_plain):
    from draftwise.equivalence import run_engine

    llm, plain = default_target_plain
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:4]]
    spec_out = run_engine(llm, spec_config, prompts, [SPEC_GREEDY] * len(prompts))
    assert spec_out == plain


@pytest.fixture(scope="module")
def default_target_plain():
    require_packaged("qwen2.5-coder-1.5b-instruct")
    require_packaged("qwen2.5-coder-0.5b-instruct")
    from draftwise.equivalence import run_engine

    llm = LLM("qwen2.5-coder-1.5b-instruct", dtype="float32", max_num_seqs=4, max_model_len=256, k_max=5)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:4]]
    return llm, run_engine(llm, None, prompts, [SPEC_GREEDY] * len(prompts))
