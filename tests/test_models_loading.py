"""Model loading invariants: GGUF and HF-dir checkpoints come back with HF names and values, llama.cpp's
Q/K permutation is undone, packaged files are sha256-checked, errors name what the user can fix, and the
conversion cache is reused. Tiny random files only; no downloads."""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tiny_checkpoints import TINY_DIMS, llama_cpp_permute, write_tiny_gguf, write_tiny_hf_dir
from draftwise.config import ConfigError
from draftwise.models import catalog, sources
from draftwise.models import safetensors as st
from draftwise.models.gguf import GGUFFile, unpermute_rope
from draftwise.models.sources import load_checkpoint


def test_gguf_qwen2_roundtrip_names_values_and_config(tmp_path):
    path = tmp_path / "q.gguf"
    hf = write_tiny_gguf(path, "qwen2", quantize=("mlp.up_proj.weight",))
    g = GGUFFile(path)
    got = dict(g.tensors())
    assert set(got) == set(hf)
    assert [n for n, _ in g.tensor_specs()] == list(got)
    for name, ref in hf.items():
        assert got[name].dtype == torch.float32 and tuple(got[name].shape) == ref.shape, name
        if name.endswith("mlp.up_proj.weight"):  # Q8_0: 8-bit blocks, error well below the weights' scale
            torch.testing.assert_close(got[name], torch.from_numpy(ref), atol=3e-3, rtol=0)
        else:
            assert torch.equal(got[name], torch.from_numpy(ref)), name
    c = g.config
    assert (c.architecture, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "qwen2", TINY_DIMS["hidden"], TINY_DIMS["layers"], TINY_DIMS["heads"], TINY_DIMS["kv_heads"], TINY_DIMS["head_dim"])
    assert c.attention_bias and not c.tie_word_embeddings and not c.qk_norm
    assert c.rms_norm_eps == 1e-6 and c.rope_theta == 1e6 and c.max_position_embeddings == 256
    assert c.vocab_size == hf["model.embed_tokens.weight"].shape[0]
    assert set(c.eos_token_ids) == {2, 0}  # <|im_end|> (file's eos) and <|endoftext|> (end of turn)


def test_gguf_llama_unpermutes_qk_and_ties_embeddings(tiny_llama_gguf_path):
    g = GGUFFile(tiny_llama_gguf_path)
    got = dict(g.tensors())
    hf = write_tiny_gguf(tiny_llama_gguf_path.with_name("again.gguf"), "llama", tie=True)
    assert "lm_head.weight" not in got and g.config.tie_word_embeddings
    assert not g.config.attention_bias
    for name, ref in hf.items():
        assert torch.equal(got[name], torch.from_numpy(ref)), name


def _rope_rotate_half(x, pos, theta=10000.0):  # HF layout: pairs (i, i + D/2); x: [T, H, D]
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None, None] * inv  # [T, 1, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def _rope_interleaved(x, pos, theta=10000.0):  # llama.cpp/GPT-J layout: pairs (2i, 2i + 1)
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None, None] * inv
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()], -1).flatten(-2)


def test_unpermute_turns_interleaved_rope_weights_into_rotate_half_weights():
    """Attention scores with HF weights + rotate-half RoPE equal those with llama.cpp's permuted weights +
    interleaved RoPE, and unpermute_rope recovers the HF weights: the direction of the fix is right."""
    rng = np.random.default_rng(1)
    heads, head_dim, hidden, seq = 2, 8, 16, 5
    wq = rng.standard_normal((heads * head_dim, hidden))
    wk = rng.standard_normal((heads * head_dim, hidden))
    x = torch.from_numpy(rng.standard_normal((seq, hidden)))
    pos = torch.arange(seq, dtype=torch.float64)

    def scores(q_w, k_w, rope):
        q = rope((x @ torch.from_numpy(q_w).T).view(seq, heads, head_dim), pos)
        k = rope((x @ torch.from_numpy(k_w).T).view(seq, heads, head_dim), pos)
        return torch.einsum("thd,shd->hts", q, k)

    hf_scores = scores(wq, wk, _rope_rotate_half)
    gguf_q, gguf_k = llama_cpp_permute(wq, heads), llama_cpp_permute(wk, heads)
    torch.testing.assert_close(scores(gguf_q, gguf_k, _rope_interleaved), hf_scores)
    assert torch.equal(unpermute_rope(torch.from_numpy(gguf_q), heads), torch.from_numpy(wq))


def test_config_comes_from_metadata_not_path(tiny_gguf_path, tmp_path):
    misleading = tmp_path / "gemma-3-27b-llama-mistral.gguf"
    shutil.copy(tiny_gguf_path, misleading)
    assert GGUFFile(misleading).config == GGUFFile(tiny_gguf_path).config


def test_unsupported_gguf_architecture_is_named(tmp_path):
    import gguf

    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ConfigError, match="'phi3'.*supported: llama, mistral, qwen2, qwen3, gemma3"):
        GGUFFile(path)


def test_hf_dir_checkpoint(tiny_hf_dir):
    ck = load_checkpoint(tiny_hf_dir)
    hf = write_tiny_hf_dir(tiny_hf_dir.with_name("again"))
    got = dict(ck.tensors())
    assert set(got) == set(hf)
    for name, ref in hf.items():
        assert torch.equal(got[name], torch.from_numpy(ref).to(torch.bfloat16)), name
    c = ck.config
    assert c.architecture == "llama" and c.rope_theta == 500000.0 and c.rms_norm_eps == 1e-5
    assert c.head_dim == TINY_DIMS["head_dim"] and not c.tie_word_embeddings and not c.attention_bias
    assert c.eos_token_ids[0] == 2 and set(ck.tokenizer.eos_token_ids) == set(c.eos_token_ids)
    assert ck.info["kind"] == "hf_dir"
    assert ck.tokenizer.decode(ck.tokenizer.encode("hello wörld")) == "hello wörld"


def test_unsupported_model_type_is_named(tmp_path):
    d = tmp_path / "m"
    write_tiny_hf_dir(d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="'gpt2'.*supported: llama, mistral, qwen2, qwen3, gemma3, gemma3_text"):
        load_checkpoint(d)


def test_hf_config_gemma3_multimodal_and_qwen2_window():
    text = {"hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 4,
            "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 1000, "sliding_window": 512,
            "rope_theta": 1e6, "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 256,
            "hidden_activation": "gelu_pytorch_tanh"}
    c = st.config_from_hf({"model_type": "gemma3", "text_config": text, "eos_token_id": [1, 106]})
    assert c.architecture == "gemma3" and c.sandwich_norm and c.qk_norm and c.norm_weight_offset == 1.0
    assert c.layer_types.count("full_attention") == 2 and c.layer_types[5] == "full_attention"
    assert c.embed_scale == pytest.approx(640 ** 0.5) and c.rope_local_theta == 1e4 and c.eos_token_ids == (1, 106)
    q = st.config_from_hf({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "vocab_size": 100, "sliding_window": 32768,
                           "use_sliding_window": False, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert q.attention_bias and q.sliding_window is None and q.rope_theta == 1e6 and q.rope_scaling is None
    assert st.hf_name("language_model.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert st.hf_name("vision_tower.encoder.layers.0.weight") is None


def test_write_tensors_is_readable_by_safetensors(tmp_path):
    """One writer for both caches: a generator cast to one dtype (the converted GGUF) and tensors of mixed dtypes
    kept as they are (prepared kernel weights)."""
    from safetensors.torch import load_file

    tensors = [("a", torch.randn(3, 5)), ("b.weight", torch.randn(7))]
    specs = [(n, tuple(t.shape), torch.bfloat16) for n, t in tensors]
    sha = st.write_tensors(tmp_path / "x.safetensors", specs, iter(tensors))
    back = load_file(str(tmp_path / "x.safetensors"))
    assert all(torch.equal(back[n], t.bfloat16()) for n, t in tensors)
    assert sha == hashlib.sha256((tmp_path / "x.safetensors").read_bytes()).hexdigest()
    mixed = [("q", torch.randint(-128, 127, (4, 16), dtype=torch.int8)), ("w", torch.randn(6, 4).t()),
             ("s", torch.randn(2).bfloat16())]
    st.write_tensors(tmp_path / "m.safetensors", [(n, tuple(t.shape), t.dtype) for n, t in mixed], mixed)
    back = load_file(str(tmp_path / "m.safetensors"))
    assert all(back[n].dtype == t.dtype and torch.equal(back[n], t) for n, t in mixed)
    with pytest.raises(ValueError, match="fewer tensors"):
        st.write_tensors(tmp_path / "y.safetensors", specs, iter(tensors[:1]))


@pytest.fixture
def fake_packaged(tmp_path, monkeypatch):
    """Two installed fake chunk packages and a catalog entry for them; returns (name, full bytes)."""
    import hashlib

    blobs = [b"GGUF-chunk-one-" * 100, b"chunk-two" * 50]
    site = tmp_path / "site"
    for i, blob in enumerate(blobs, 1):
        pkg = site / f"dwfake_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob)
    monkeypatch.syspath_prepend(str(site))
    full = b"".join(blobs)
    good = catalog.CatalogEntry("fake-good", "qwen2", "fake", "fake-good.gguf", hashlib.sha256(full).hexdigest(),
                                len(full), "org/fake", catalog._numbered_chunks("dwfake_part", 2))
    bad = catalog.CatalogEntry(**{**good.__dict__, "name": "fake-bad", "file_name": "fake-bad.gguf", "sha256": "0" * 64})
    monkeypatch.setitem(catalog.CATALOG, good.name, good)
    monkeypatch.setitem(catalog.CATALOG, bad.name, bad)
    return good, full


def test_assemble_verifies_and_caches_sha(fake_packaged, draftwise_cache_dir, monkeypatch):
    entry, full = fake_packaged
    path = catalog.assemble(entry.name, draftwise_cache_dir, progress=False)
    assert path.read_bytes() == full
    monkeypatch.setattr(catalog, "sha256_file", lambda *a, **k: pytest.fail("rehashed a verified file"))
    assert catalog.assemble(entry.name, draftwise_cache_dir, progress=False) == path
    rows = {r["name"]: r for r in catalog.list_models(draftwise_cache_dir)}
    assert rows["fake-good"]["installed"] and rows["fake-good"]["assembled"] and not rows["fake-bad"]["assembled"]


def test_sha256_mismatch_is_refused(fake_packaged, draftwise_cache_dir):
    entry, full = fake_packaged
    with pytest.raises(catalog.ChecksumError, match=f"expected {'0' * 64}, got {entry.sha256}"):
        catalog.assemble("fake-bad", draftwise_cache_dir, progress=False)
    models = draftwise_cache_dir / "models"
    assert not (models / "fake-bad.gguf").exists() and not list(models.glob("fake-bad.gguf.partial*"))
    with pytest.raises(ConfigError, match="sha256 mismatch"):
        load_checkpoint("fake-bad", draftwise_cache_dir, progress=False)


def test_missing_chunk_package_is_named(draftwise_cache_dir, monkeypatch):
    entry = catalog.CatalogEntry("fake-missing", "qwen2", "x", "x.gguf", "0" * 64, 1, "org/x",
                                 catalog._numbered_chunks("dwfake_not_installed_part", 1))
    monkeypatch.setitem(catalog.CATALOG, entry.name, entry)
    with pytest.raises(ConfigError, match="dwfake-not-installed-part1"):
        load_checkpoint("fake-missing", draftwise_cache_dir, progress=False)


def test_unknown_name_lists_catalog(draftwise_cache_dir):
    with pytest.raises(ConfigError) as e:
        load_checkpoint("no-such-model", draftwise_cache_dir)
    assert all(name in str(e.value) for name in catalog.CATALOG)


def test_hub_id_while_offline_is_a_clear_error(draftwise_cache_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # any hub import would fail loudly
    with pytest.raises(ConfigError, match="is not a packaged model, file or directory, and the hub is offline") as e:
        load_checkpoint("some-org/some-model", draftwise_cache_dir)
    assert "qwen2.5-coder-1.5b-instruct" in str(e.value)


def test_gguf_conversion_is_cached_and_reused(tiny_gguf_path, tmp_path, draftwise_cache_dir, monkeypatch):
    user_file = tmp_path / "mine.gguf"
    shutil.copy(tiny_gguf_path, user_file)
    first = load_checkpoint(user_file, draftwise_cache_dir, progress=False)
    first_tensors = dict(first.tensors())
    converted = sources.converted_dir(first.info["sha256"], draftwise_cache_dir)
    assert first.info["converted_path"] == str(converted) and (converted / "model.safetensors").is_file()

    from draftwise import tokenizer as tokenizer_module
    from draftwise.models import gguf as gguf_module

    monkeypatch.setattr(gguf_module, "GGUFFile", lambda *a: pytest.fail("reopened the GGUF"))
    monkeypatch.setattr(tokenizer_module.Tokenizer, "from_gguf", lambda *a: pytest.fail("rebuilt the tokenizer"))
    monkeypatch.setattr(catalog, "sha256_file", lambda *a, **k: pytest.fail("rehashed an unchanged file"))
    second = load_checkpoint(user_file, draftwise_cache_dir, progress=False)
    assert second.config == first.config and second.info["sha256"] == first.info["sha256"]
    second_tensors = dict(second.tensors())
    assert all(torch.equal(second_tensors[n], t) for n, t in first_tensors.items())
    text = "<|im_start|>user\nhéllo 😀<|im_end|>"
    assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    assert second.tokenizer.eos_token_ids == second.config.eos_token_ids


def test_changed_user_file_is_rehashed(tiny_gguf_path, tmp_path, draftwise_cache_dir):
    user_file = tmp_path / "mine.gguf"
    shutil.copy(tiny_gguf_path, user_file)
    sha1 = catalog.cached_sha256(user_file, draftwise_cache_dir, progress=False)
    write_tiny_gguf(user_file, "qwen2", seed=5)
    sha2 = catalog.cached_sha256(user_file, draftwise_cache_dir, progress=False)
    assert sha1 != sha2 == catalog.sha256_file(user_file, progress=False)


def test_non_gguf_file_is_refused(tmp_path, draftwise_cache_dir):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"not a model")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        load_checkpoint(f, draftwise_cache_dir)


# ---- corrupt files, manifests, durable writes, confined index paths ---------------------
def _converted(tiny_gguf_path, tmp_path, cache_dir):
    user_file = tmp_path / "mine.gguf"
    shutil.copy(tiny_gguf_path, user_file)
    ck = load_checkpoint(user_file, cache_dir, progress=False)
    return user_file, ck, dict(ck.tensors()), Path(ck.info["converted_path"]) / "model.safetensors"


@pytest.mark.parametrize("damage", ["truncate", "flip bytes"])
def test_a_corrupt_converted_cache_is_converted_again(tiny_gguf_path, tmp_path, draftwise_cache_dir, capsys, damage):
    """A converted file cut short (a crash, a full disk) or changed in place is caught by the manifest written at
    conversion (size always; sha256 when the mtime moved) and converted again — never loaded as weights."""
    user_file, _, ref, weights = _converted(tiny_gguf_path, tmp_path, draftwise_cache_dir)
    data = bytearray(weights.read_bytes())
    if damage == "truncate":
        data = data[:-100]
    else:
        data[-100:] = bytes(100)
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    again = load_checkpoint(user_file, draftwise_cache_dir, progress=False)
    assert "unusable" in capsys.readouterr().err
    got = dict(again.tensors())
    assert all(torch.equal(got[n], t) for n, t in ref.items())
    assert weights.stat().st_size == len(data) + (100 if damage == "truncate" else 0)
    meta = json.loads((weights.parent / "draftwise_config.json").read_text())
    assert meta["files"]["model.safetensors"]["size"] == weights.stat().st_size
    assert len(meta["files"]["model.safetensors"]["sha256"]) == 64 and "tokenizer.json" in meta["files"]


def test_a_truncated_safetensors_file_is_a_clear_error(tiny_hf_dir, tmp_path):
    """Reads are length-checked: a short file is a ConfigError naming the file, offset and expected bytes, before
    any tensor is read, and a file that shrinks while being read fails the short read (no uninitialised memory)."""
    shard = tmp_path / "shard.safetensors"
    shutil.copy(st.weight_files(tiny_hf_dir)[0], shard)
    full = shard.read_bytes()
    shard.write_bytes(full[:-10])
    with pytest.raises(ConfigError, match=r"shard\.safetensors is truncated: .* its header needs"):
        list(st.iter_tensors([shard]))
    shard.write_bytes(full)
    tensors = st.iter_tensors([shard])
    next(tensors)
    shard.write_bytes(full[:-10])  # truncated under the open reader
    with pytest.raises(ConfigError, match=r"shard\.safetensors: tensor .* truncated: expected \d+ bytes at offset \d+"):
        list(tensors)
    shard.write_bytes(full[:4])
    with pytest.raises(ConfigError, match="expected 8 header-length bytes at offset 0, read 4"):
        list(st.iter_tensors([shard]))


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/abs/outside.safetensors", "sub/../../outside.safetensors"])
def test_index_weight_paths_must_stay_inside_the_checkpoint(tiny_hf_dir, tmp_path, bad):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_hf_dir, ckpt)
    shutil.copy(st.weight_files(ckpt)[0], tmp_path / "outside.safetensors")  # a real file out there
    index = ckpt / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = bad.replace("/abs", str(tmp_path)) if bad.startswith("/abs") else bad
    index.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="is not a relative path inside the checkpoint folder"):
        load_checkpoint(ckpt)


def test_every_cache_write_is_fsynced_before_its_rename(tiny_gguf_path, tmp_path, draftwise_cache_dir, monkeypatch):
    """Conversion folder, fp32 and bf16 copies: each file and folder is fsynced before the rename, the parent after."""
    import os

    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a), str(b))), replace(a, b))[1])
    _, ck, _, weights = _converted(tiny_gguf_path, tmp_path, draftwise_cache_dir)
    dict(ck.tensors(torch.bfloat16))
    renames = [e for e in events if e[0] == "replace"]
    for event in renames:
        _, src, dst = event
        at = events.index(event)
        synced = {e[1] for e in events[:at] if e[0] == "fsync"}
        assert src in synced, dst  # the file, or the folder ...
        if Path(dst).is_dir():
            assert str(Path(src) / "tokenizer.json") in synced  # ... and every file in it
        assert ("fsync", str(Path(dst).parent)) in events[at + 1:], dst  # then the rename itself
    assert {Path(d).name for _, _, d in renames} >= {weights.parent.name, "model.safetensors",
                                                       "model.bfloat16.safetensors"}
