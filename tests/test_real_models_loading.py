"""Integration: the packaged GGUFs, converted and cached by draftwise, hold exactly the tensors (names and
values) and configuration that transformers' own GGUF loader produces."""
from __future__ import annotations

import pytest
import torch

from draftwise.models.sources import load_checkpoint
from tests.conftest import require_packaged

pytestmark = pytest.mark.integration


# gemma only: it has every quirk (norm +1, sandwich norms, sliding layers); transformers' loader needs ~1.5 min
# per model on 2 cores. The qwen2 0.5B file was checked the same way once by hand (291/291 tensors equal).
@pytest.mark.parametrize("name", ["gemma-3-270m"])
def test_converted_tensors_and_config_match_transformers(name):
    require_packaged(name)
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ck = load_checkpoint(name, progress=False)
    path = ck.info["path"]
    folder, file = path.rsplit("/", 1)
    ref_config = AutoConfig.from_pretrained(folder, gguf_file=file)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(ref_config)
    ref = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    mine = dict(ck.tensors())
    assert set(mine) == set(ref)
    for key, value in ref.items():
        assert torch.equal(mine[key], torch.as_tensor(value).float()), key

    c = ck.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads) == (
        ref_config.vocab_size, ref_config.hidden_size, ref_config.intermediate_size, ref_config.num_hidden_layers,
        ref_config.num_attention_heads, ref_config.num_key_value_heads)
    assert c.tie_word_embeddings == ref_config.tie_word_embeddings
    assert c.rms_norm_eps == pytest.approx(ref_config.rms_norm_eps)
    if c.architecture == "gemma3":
        assert list(c.layer_types) == list(ref_config.layer_types)
        assert (c.sliding_window, c.head_dim, c.query_pre_attn_scalar) == (
            ref_config.sliding_window, ref_config.head_dim, ref_config.query_pre_attn_scalar)
        assert c.rope_theta == ref_config.rope_parameters["full_attention"]["rope_theta"]
        assert c.rope_local_theta == ref_config.rope_parameters["sliding_attention"]["rope_theta"]
    else:
        assert c.rope_theta == ref_config.rope_parameters["rope_theta"]
