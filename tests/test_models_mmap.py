"""Prepared weights mapped, not copied (models/safetensors.py map_tensors, models/quant.py storage_order,
kernels/linear.py cat_rows): a model read back from its prepared cache — on the load that writes it, too — holds
views of the file's mapping, every kernel buffer, the merged q/k/v and gate/up included, and its logits are bitwise
those of the same cache read into fresh memory and of the model built straight from the GGUF in memory; what cannot
be a view (an unaligned tensor, a concatenation of parts that are not back to back) is copied, bitwise. The load
that writes the file holds one prepared module at a time (models/safetensors.py Spill). About 5 s."""
from __future__ import annotations

import weakref

import pytest
import torch

from draftwise.api import load_model
from draftwise.kernels.linear import Q4x8Linear, Q80Linear, available, cat_rows
from draftwise.kernels.probe import probe
from draftwise.models import quant
from draftwise.models import safetensors as st
from tests.tiny_checkpoints import Q4K_DIMS, write_tiny_gguf


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    if "q8_0" not in available(probe(bandwidth=False)):
        pytest.skip("our C++ kernels do not build here")
    path = tmp_path_factory.mktemp("mmap") / "tiny-mixed.gguf"
    write_tiny_gguf(path, "qwen2", dims=Q4K_DIMS, q4k=("_proj.weight",),
                    quantize=("lm_head.weight", "embed_tokens.weight", "down_proj.weight"))
    return path


def _logits(model, ids: list[int]) -> torch.Tensor:
    from draftwise.equivalence import next_logits

    return next_logits(model, [ids])[0]


def _kernel_buffers(model) -> dict[str, torch.Tensor]:
    return {f"{name}.{b}": t for name, m in model.named_modules() if isinstance(m, (Q4x8Linear, Q80Linear))
            for b, t in m.named_buffers(recurse=False) if t is not None and b != "bias"}


@pytest.mark.parametrize("weights", ["auto", "q4x8"])  # the faithful plan (q4x8 + q8_0 + stored rows), the 4-bit one
def test_prepared_cache_is_mapped_and_bitwise_the_copied_load(mixed_gguf, tmp_path, monkeypatch, weights):
    from draftwise.models.sources import Checkpoint

    cache = str(tmp_path / "cache")
    first, _, info = load_model(str(mixed_gguf), weights=weights, cache_dir=cache)  # writes the file, then maps it
    mapped, _, _ = load_model(str(mixed_gguf), weights=weights, cache_dir=cache)  # read back: mapped
    prepared = [str(p) for p in (tmp_path / "cache").rglob("prepared-*.safetensors")]
    assert len(prepared) == 1
    assert [p.name for p in (tmp_path / "cache").rglob("*.tmp-*")] == []  # neither the spill nor the temporary left
    for model in (first, mapped):
        buffers = _kernel_buffers(model)
        assert any(".qkv_proj." in n for n in buffers) and any(".gate_up_proj." in n for n in buffers)
        for name, t in buffers.items():  # merged modules too: views of the file, not concatenated copies
            assert st.mapped_file(t) == prepared[0], name
        if weights == "auto":  # the table kept as stored: its raw rows are the file's
            assert st.mapped_file(model.model.embed_tokens.raw) == prepared[0]

    with monkeypatch.context() as m:  # the modules built straight from the GGUF, in memory, no cache between
        m.setattr(Checkpoint, "prepared", lambda self, plan, embed_dtype, progress=None: quant.prepared_weights(
            self.gguf().items(), self.config, plan, False))
        built, _, _ = load_model(str(mixed_gguf), weights=weights, cache_dir=cache)
    assert all(st.mapped_file(t) is None for t in _kernel_buffers(built).values())
    monkeypatch.setattr(st, "map_tensors", lambda path: st.iter_tensors([path]))  # the copied load
    copied, _, _ = load_model(str(mixed_gguf), weights=weights, cache_dir=cache)
    assert all(st.mapped_file(t) is None for t in _kernel_buffers(copied).values())
    for ids in (list(range(3, 40)), [5]):
        want = _logits(built, ids)
        for model in (first, mapped, copied):
            assert torch.equal(_logits(model, ids), want)


def test_the_load_that_writes_the_prepared_file_holds_one_module_at_a_time(mixed_gguf, tmp_path, monkeypatch):
    """A first load used to build every prepared module before writing any (a 4.84 GB mixture file peaked at 13.6 GB
    RSS; a real 30B one would need ~50 GB): now each module is spilled and dropped as it is built, so when a module
    is handed over at most the one before it (still being spilled) and the head a tied table shares are alive."""
    real, alive, most = quant.prepared_weights, [], [0]

    def counted(*args, **kwargs):
        for name, value in real(*args, **kwargs):
            if isinstance(value, torch.nn.Module):
                most[0] = max(most[0], sum(ref() is not None for ref in alive))
                alive.append(weakref.ref(value))
            yield name, value

    monkeypatch.setattr(quant, "prepared_weights", counted)
    load_model(str(mixed_gguf), weights="auto", cache_dir=str(tmp_path / "cache"))
    assert len(alive) >= 8 and most[0] <= 2, (len(alive), most[0])


def test_a_spill_writes_the_tensors_in_the_order_asked_and_leaves_nothing(tmp_path):
    parts = {"a": torch.arange(6, dtype=torch.int32).reshape(2, 3), "b": torch.tensor([7, 0], dtype=torch.uint8),
             "c": torch.empty(0, 4, dtype=torch.float32), "d": torch.linspace(-1, 1, 5, dtype=torch.bfloat16)}
    path = tmp_path / "out.safetensors"
    with st.Spill(tmp_path / "out.spill") as spill:
        for name, t in parts.items():
            spill.add(name, t)
        with pytest.raises(ValueError, match="added twice"):
            spill.add("a", parts["a"])
        with pytest.raises(ValueError, match="other tensors"):
            spill.write(path, ["a", "b"])
        spill.write(path, ["d", "b", "c", "a"], {"k": "v"})
    assert [p.name for p in tmp_path.iterdir()] == ["out.safetensors"]
    got = list(st.iter_tensors([path]))
    assert [n for n, _ in got] == ["d", "b", "c", "a"] and st.read_metadata(path) == {"k": "v"}
    for name, t in got:
        assert t.dtype == parts[name].dtype and torch.equal(t, parts[name])


def test_a_spill_gives_its_blocks_back_as_they_are_read(tmp_path):
    """Peak disk about one copy of the data: each tensor's whole blocks in the spill file are punched out once it is
    read back, so after `write` the spill file keeps its size but hardly any blocks (the prepared file of a
    Qwen3-30B-A3B-shaped GGUF is ~18 GB: two copies at once were ~36 GB)."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"\1" * 3 * 4096)
    with open(probe, "r+b") as f:
        if not st.punch_hole(f.fileno(), 0, 3 * 4096):
            pytest.skip("this filesystem (or platform) does not punch holes")
    assert probe.stat().st_blocks * 512 < 3 * 4096 and probe.read_bytes() == bytes(3 * 4096)
    g = torch.Generator().manual_seed(0)
    parts = {f"t{i}": torch.randn(1000 + 37 * i, 64, generator=g) for i in range(6)}  # ~1.6 MB, unaligned sizes
    path = tmp_path / "out.safetensors"
    spill_path = tmp_path / "out.spill"
    with st.Spill(spill_path) as spill:
        for name, t in parts.items():
            spill.add(name, t)
        spill._out.flush()
        held = spill_path.stat().st_blocks * 512
        total = sum(t.numel() * 4 for t in parts.values())
        assert held >= total
        spill.write(path, list(reversed(parts)))
        assert spill_path.stat().st_size == total  # the size kept, the blocks given back
        assert spill_path.stat().st_blocks * 512 <= 6 * 2 * 4096  # at most the two edge blocks of each tensor
        with pytest.raises(ValueError, match="written once"):
            spill.write(path, list(parts))
    for name, t in st.iter_tensors([path]):
        assert torch.equal(t, parts[name]), name


def test_a_write_to_a_mapped_tensor_never_reaches_the_file(tmp_path):
    path = tmp_path / "w.safetensors"
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    st.write_tensors(path, [("a", (8, 8), torch.float32)], [("a", t)])
    (name, m), = list(st.map_tensors(path))
    assert name == "a" and torch.equal(m, t) and st.mapped_file(m) == str(path)
    m.fill_(-1.0)  # MAP_PRIVATE: this process's copy of the page changes, the file does not
    (_, again), = list(st.iter_tensors([path]))
    assert torch.equal(again, t)


def test_an_unaligned_tensor_is_copied_with_its_values(tmp_path):
    path = tmp_path / "odd.safetensors"
    odd = torch.arange(3, dtype=torch.uint8)  # 3 bytes: the float32 after it starts at an offset not a multiple of 4
    f = torch.linspace(-1, 1, 10)
    st.write_tensors(path, [("odd", (3,), torch.uint8), ("f", (10,), torch.float32)], [("odd", odd), ("f", f)])
    got = dict(st.map_tensors(path))
    assert torch.equal(got["odd"], odd) and st.mapped_file(got["odd"]) == str(path)
    assert torch.equal(got["f"], f) and st.mapped_file(got["f"]) is None


def test_cat_rows_is_a_view_only_when_the_parts_are_back_to_back():
    whole = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    a, b, c = whole[0:3], whole[3:5], whole[5:10]
    joined = cat_rows([a, b, c])
    assert torch.equal(joined, torch.cat([a, b, c])) and joined.data_ptr() == whole.data_ptr()
    gap = cat_rows([whole[0:3], whole[4:6]])  # a row between them: a copy
    assert torch.equal(gap, torch.cat([whole[0:3], whole[4:6]])) and gap.data_ptr() != whole.data_ptr()
    swapped = cat_rows([b, a])
    assert torch.equal(swapped, torch.cat([b, a])) and swapped.data_ptr() != whole.data_ptr()
    other = torch.zeros(2, 4)
    assert torch.equal(cat_rows([a, other]), torch.cat([a, other]))


def test_storage_order_puts_each_merged_buffer_back_to_back():
    layer = "model.layers.0"
    owners, names = {}, []
    for leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
        for b in ("packed", "d", "bias"):
            names.append(f"{layer}.self_attn.{leaf}.{b}")
            owners[names[-1]] = f"{layer}.self_attn.{leaf}"
    for leaf in ("up_proj", "gate_proj"):  # stored in any order: the group's order (gate, up) is what merge uses
        for b in ("step.packed", "step.d"):
            names.append(f"{layer}.mlp.{leaf}.{b}")
            owners[names[-1]] = f"{layer}.mlp.{leaf}"
    names.append("model.norm.weight")
    order = quant.storage_order(names, owners)
    assert sorted(order) == sorted(names)
    attn = [n.removeprefix(f"{layer}.self_attn.") for n in order if ".self_attn." in n]
    assert attn == ["q_proj.packed", "k_proj.packed", "v_proj.packed", "q_proj.d", "k_proj.d", "v_proj.d",
                    "q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.packed", "o_proj.d", "o_proj.bias"]
    mlp = [n.removeprefix(f"{layer}.mlp.") for n in order if ".mlp." in n]
    assert mlp == ["gate_proj.step.packed", "up_proj.step.packed", "gate_proj.step.d", "up_proj.step.d"]


def test_map_tensors_refuses_a_truncated_file(tmp_path):
    from draftwise.config import ConfigError

    path = tmp_path / "t.safetensors"
    st.write_tensors(path, [("a", (16,), torch.float32)], [("a", torch.ones(16))])
    raw = path.read_bytes()
    path.write_bytes(raw[:-8])
    with pytest.raises(ConfigError, match="truncated"):
        list(st.map_tensors(path))
