"""kernels/hugepages.py: the THP policy read from an injected sysfs file, and the move itself — bitwise the same
model after it and after the background collapse (logits, tied weights still one storage, views still views),
every large storage in one mapping, small ones left alone, nothing moved where the policy says "never";
load_model does it only when asked (DRAFTWISE_HUGE_PAGES=1) and reports it."""
import mmap

import pytest
import torch

from draftwise.kernels import hugepages
from draftwise.kv_cache import KVCache
from tests.tiny_models import tiny_decoder

needs_madvise = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="this Python cannot advise MADV_HUGEPAGE")


@pytest.mark.parametrize("text,mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                                       ("always madvise [never]\n", "never"), ("", "unavailable")])
def test_thp_mode_reads_the_bracketed_policy(tmp_path, text, mode):
    f = tmp_path / "enabled"
    f.write_text(text)
    assert hugepages.thp_mode(f) == mode
    assert hugepages.thp_mode(tmp_path / "missing") == "unavailable"


def _logits(model, ids: list[int]) -> torch.Tensor:  # [T, V]
    c = model.config
    cache = KVCache(c.num_layers, 1, c.num_kv_heads, 64, c.head_dim, model.dtype, model.device)
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, torch.tensor([0]))[0].float()


def _storages(model):
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for m in model.modules() for t in list(m._parameters.values()) + list(m._buffers.values()) if t is not None}


@needs_madvise
def test_the_move_keeps_every_value_and_every_sharing():
    model = tiny_decoder("qwen2", 0, vocab_size=4096)  # qwen2: tied embedding and LM head; 4096 x 32 fp32 = 512 KiB
    ids = list(range(3, 40))
    before = _logits(model, ids).clone()
    head, table = model.lm_head.weight, model.model.embed_tokens.weight
    tied = head.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
    small = {p: n for p, n in _storages(model).items() if n < 64 * 1024}
    report = hugepages.place_in_huge_pages(model, min_bytes=64 * 1024, mode="madvise")
    assert report["mode"] == "madvise" and report["storages"] >= 1 and report["moved_bytes"] >= 512 * 1024
    assert torch.equal(_logits(model, ids), before)  # before the collapse
    hugepages.collapse_pending().join(120)
    assert torch.equal(_logits(model, ids), before)  # and after it
    head, table = model.lm_head.weight, model.model.embed_tokens.weight
    assert (head.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()) == tied
    after = _storages(model)
    assert set(small) <= set(after)  # storages under the threshold were not touched
    big = [p for p, n in after.items() if n >= 64 * 1024]
    assert len(big) == 1  # every large storage now lives in the one advised mapping


@needs_madvise
def test_views_and_shared_parameters_stay_shared():
    lin = torch.nn.Linear(256, 1024)
    mod = torch.nn.Module()
    mod.a, mod.b = lin, torch.nn.Linear(256, 1024, bias=False)
    mod.b.weight = lin.weight  # one Parameter object in two modules
    mod.register_buffer("packed", torch.randint(0, 255, (2048, 512), dtype=torch.uint8))
    mod.register_buffer("view", mod.packed[10:20, 5:])  # a strided view at an offset
    x = torch.randn(3, 256)
    ref = (lin(x), mod.packed.clone(), mod.view.clone(), mod.b(x))
    hugepages.place_in_huge_pages(mod, min_bytes=1, mode="madvise")
    hugepages.collapse_pending(background=False)
    assert mod.b.weight is mod.a.weight and torch.equal(mod.a(x), ref[0]) and torch.equal(mod.b(x), ref[3])
    assert torch.equal(mod.packed, ref[1]) and torch.equal(mod.view, ref[2])
    assert mod.view.storage_offset() == 10 * 512 + 5 and mod.view.stride() == (512, 1)
    mod.packed[10, 5] = 7  # still a view of the moved buffer, not a copy
    assert mod.view[0, 0].item() == 7


def test_policy_never_moves_nothing():
    model = tiny_decoder("llama", 0)
    ptrs = _storages(model)
    report = hugepages.place_in_huge_pages(model, min_bytes=1, mode="never")
    assert report == {"mode": "never", "moved_bytes": 0, "storages": 0}
    assert _storages(model) == ptrs


def test_load_model_reports_the_placement(tiny_gguf_path, draftwise_cache_dir, monkeypatch):
    from draftwise.api import load_model

    monkeypatch.delenv("DRAFTWISE_HUGE_PAGES", raising=False)
    _, _, info = load_model(str(tiny_gguf_path), "float32", weights="fp32", cache_dir=str(draftwise_cache_dir))
    assert "huge_pages" not in info  # opt-in
    monkeypatch.setenv("DRAFTWISE_HUGE_PAGES", "1")
    _, _, info = load_model(str(tiny_gguf_path), "float32", weights="fp32", cache_dir=str(draftwise_cache_dir))
    assert info["huge_pages"]["thp"] == hugepages.thp_mode() and info["huge_pages"]["bytes"] >= 0


@needs_madvise
def test_a_dropped_model_frees_its_mapping_before_any_collapse():
    import gc

    hugepages.collapse_pending(background=False)  # whatever earlier tests left
    mod = torch.nn.Linear(512, 1024)
    hugepages.place_in_huge_pages(mod, min_bytes=1, mode="madvise")
    del mod
    gc.collect()
    assert hugepages.collapse_pending() is None  # nothing pending held the dropped model's mapping alive
