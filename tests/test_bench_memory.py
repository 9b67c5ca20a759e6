"""`draftwise memory`'s estimate: shapes from metadata only, the KV formula by hand, and cache sizes that are
the engine's own (the estimate and the engine call the same capacity functions, kv_cache.py's)."""
import pytest

from draftwise.bench import memory
from draftwise.config import ModelConfig
from draftwise.kv_cache import draft_cache_capacity, target_cache_capacity


def test_kv_bytes_by_hand():
    cfg = ModelConfig("qwen2", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=28, num_heads=12,
                      num_kv_heads=2, head_dim=128)
    # 2 (K, V) x 28 layers x 2 kv heads x 128 dims x 2 bytes (bf16) x 1008 tokens (63 blocks of 16) x 4 slots
    assert memory.kv_bytes(cfg, "bfloat16", 1000, 4) == 2 * 28 * 2 * 128 * 2 * 1008 * 4
    # a budget of 10 MiB: whole blocks of 16 positions (28,672 bytes a position) that fit
    assert memory.kv_bytes(cfg, "bfloat16", 1000, 4, 10 * 2**20) == 10 * 2**20 // (16 * 28672) * 16 * 28672


def test_shapes_from_gguf_metadata_match_the_loaded_model(tiny_gguf_path):
    from draftwise.models.gguf import GGUFFile

    s = memory.model_shapes(str(tiny_gguf_path))
    g = GGUFFile(tiny_gguf_path)
    assert s.config == g.config
    assert s.num_params == sum(t.numel() for _, t in g.tensors())
    assert 0 < s.num_linear_params < s.num_params
    plan = lambda dtype, weights: memory.resolve_plan(s, dtype, weights)  # noqa: E731
    assert memory.weight_bytes(s, plan("auto", "bf16")) == 2 * s.num_params
    assert (memory.weight_bytes(s, plan("float32", "int4")) < memory.weight_bytes(s, plan("float32", "int8"))
            < 4 * s.num_params)


def test_safetensors_header_only(tiny_hf_dir):
    from draftwise.models.safetensors import header_specs, weight_files

    specs = [x for f in weight_files(tiny_hf_dir) for x in header_specs(f)]
    assert specs and all(isinstance(shape, tuple) for _, shape in specs)
    s = memory.model_shapes(str(tiny_hf_dir))
    assert s.num_params > 0


def test_estimate_phases(tiny_gguf_path, monkeypatch):
    e = memory.estimate(str(tiny_gguf_path), str(tiny_gguf_path), 512, 4, "bfloat16", weights="bf16",
                        draft_weights="bf16")
    rows = e["bytes"]
    assert set(rows) == {"target_weights", "target_kv_cache", "draft_weights", "draft_kv_cache", "runtime_overhead"}
    assert e["serving_bytes"] == sum(rows.values())
    assert e["total_bytes"] == max(e["serving_bytes"], *e["loading_peak_bytes"].values())
    monkeypatch.setattr(memory, "available_memory", lambda device="cpu": (1, "test"))
    assert not memory.estimate(str(tiny_gguf_path), None, 512, 4, "float32", "fp32")["fits"]
    assert "WARNING" in memory.format_estimate(memory.estimate(str(tiny_gguf_path), None, 512, 4, "float32", "fp32"))


@pytest.mark.parametrize("spec_config", [None, {"method": "ngram", "num_speculative_tokens": 3},
                                         {"method": "draft_model", "model": "tiny-draft", "num_speculative_tokens": 5}])
@pytest.mark.parametrize("budget", [None, 20_000])  # the default (every slot at full context fits), a few blocks
def test_kv_estimate_equals_what_the_engine_allocates(spec_config, budget):
    from draftwise.kv_cache import draft_pool_blocks
    from tests.harness import tiny_llm

    llm = tiny_llm(spec_config, max_num_seqs=3, max_model_len=200, kv_cache_memory=budget)
    k = llm.k_max
    capacity = target_cache_capacity(200, k)
    mem = budget or memory.DEFAULT_KV_CACHE_MEMORY
    kv = str(llm.kv_cache_dtype).removeprefix("torch.")  # as auto resolved it (bfloat16 on our fused CPU path)
    assert kv == memory.kv_dtype_name(llm.model.plan)
    assert memory.kv_bytes(llm.model.config, kv, capacity, 3, mem) == llm.engine.cache.nbytes
    blocks = memory.kv_blocks(llm.model.config, kv, capacity, 3, mem)
    assert blocks == llm.engine.cache.num_blocks and (budget is None) == (blocks == 3 * 13)
    if spec_config and spec_config["method"] == "draft_model":
        capacity = draft_cache_capacity(200, k)
        draft_blocks = draft_pool_blocks(blocks, 3, capacity)
        assert memory.kv_bytes(llm.proposer.model.config, kv, capacity, 3,
                               blocks=draft_blocks) == llm.proposer.cache.nbytes


def held_bytes(model) -> int:
    """What a loaded model really holds: every distinct storage behind its parameters and buffers, once; a tensor
    mapped from its prepared file (models/safetensors.py map_tensors: all share the file's one storage) by its
    own bytes."""
    from draftwise.models.safetensors import mapped_file

    storages, spans = {}, []
    for t in [*model.parameters(), *model.buffers()]:
        if mapped_file(t) is not None:
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
        else:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    mapped, end = 0, 0
    for lo, hi in sorted(spans):  # the union of the mapped tensors' byte ranges (views may overlap: a merged bias)
        mapped += max(0, hi - max(lo, end))
        end = max(end, hi)
    return sum(storages.values()) + mapped


PLANS = [("q4x8", "q4x8"), ("q4x8", "fp32"), ("q4x8", "bf16"), ("int4", "int4"),
         ("fp32", "fp32"), ("bf16", "bf16")]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("step,prefill", PLANS, ids=["/".join(p) for p in PLANS])
def test_weight_and_kv_estimates_equal_what_the_loaded_model_allocates(step, prefill, tied, tiny_gguf_path,
                                                                       tiny_llama_gguf_path, tmp_path):
    """For every plan `auto` can pick (injected timing tables): the estimate's weight bytes, computed from shapes
    and the formats' layouts alone (q4x8 4.75 bits per weight, a compact embedding shared with a tied head,
    lm_heads a kernel cannot take left dense), equal the bytes the loaded model's tensors occupy, first load and
    reload from the prepared cache alike; the draft (its own auto) gets the same; the KV rows in the resolved
    activation dtype equal the engine's caches."""
    from draftwise.api import LLM, load_model
    from draftwise.kernels.linear import LINEARS
    from draftwise.kernels.probe import probe
    from tests.harness import fixed_tune

    if not all(LINEARS[n].available(probe(bandwidth=False)) for n in (step, prefill)):
        pytest.skip(f"{step}/{prefill} cannot run here")
    path, cache = str(tiny_llama_gguf_path if tied else tiny_gguf_path), str(tmp_path / "cache")
    tune = fixed_tune(step, prefill)
    e = memory.estimate(path, path, 64, 2, k=4, cache_dir=cache, tune=tune)
    model, tok, info = load_model(path, cache_dir=cache, tune=tune)
    assert e["plans"]["target"]["step"] == step and e["plans"]["target"]["dtype"] == info["dtype"]
    assert e["bytes"]["target_weights"] == held_bytes(model) == e["bytes"]["draft_weights"]
    again, _, _ = load_model(path, cache_dir=cache, tune=tune)  # from the prepared cache, mapped like the first
    # (a merged q/k/v's bias a view of its parts', where a SplitLinear's float32 prefill parts keep them)
    assert held_bytes(again) == held_bytes(model)
    assert f"step {step}, prefill {prefill}" in memory.format_estimate(e)
    assert not any("prefix" in row for row in e["bytes"])  # its blocks live in the K/V pool: no row of its own
    llm = LLM.from_parts(model, tok, max_num_seqs=2, max_model_len=64, k_max=4,
                         speculative_config={"method": "draft_model", "model": "d", "num_speculative_tokens": 4},
                         load_draft=lambda name, d, w: (again, tok, {"name": name}))
    assert e["bytes"]["target_kv_cache"] == llm.engine.cache.nbytes
    assert e["bytes"]["draft_kv_cache"] == llm.proposer.cache.nbytes


def test_the_faithful_plan_costs_each_tensor_in_its_stored_types_kernel(tmp_path):
    """A GGUF of mixed types (Q4_K linears, a Q5_0 v_proj and embedding table, a Q8_0 head): `auto` is the faithful
    plan for the target, and the estimate's weight bytes — each linear in its stored type's kernel (Q4_K q4x8, Q5_0 /
    Q8_0 q8_0), the Q5_0 table as the file's rows — equal what the loaded model holds; the draft gets its own
    auto (the draft role: the fastest plan, here the injected q4x8), as LLM loads it. Planted: costing the
    faithful target as the all-q4x8 plan (the estimate before it knew the stored types) misses the bytes."""
    from draftwise.api import load_model
    from draftwise.kernels.linear import available
    from draftwise.kernels.probe import probe
    from tests.harness import fixed_tune
    from tests.tiny_checkpoints import Q4K_DIMS, write_tiny_gguf

    if not {"q4x8", "q8_0"} <= set(available(probe(bandwidth=False))):
        pytest.skip("our C++ kernels do not build here")
    path = tmp_path / "tiny-mixed.gguf"
    write_tiny_gguf(path, "qwen2", dims=Q4K_DIMS, quantize=("lm_head.weight",), q5_0=("v_proj.weight", "embed_tokens.weight"),
                    q4k=("q_proj.weight", "k_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight",
                         "down_proj.weight"))
    cache, tune = str(tmp_path / "cache"), fixed_tune("q4x8", "q4x8")
    e = memory.estimate(str(path), str(path), 64, 2, k=4, cache_dir=cache, tune=tune)
    target, _, _ = load_model(str(path), cache_dir=cache, tune=tune)
    draft, _, _ = load_model(str(path), cache_dir=cache, tune=tune, role="draft")
    assert target.plan.faithful and e["plans"]["target"]["weights"] == "faithful"
    assert e["plans"]["draft"]["weights"] == draft.plan.label == "q4x8"
    assert e["bytes"]["target_weights"] == held_bytes(target)
    assert e["bytes"]["draft_weights"] == held_bytes(draft)
    assert not any("prefix" in row for row in e["bytes"])
    shapes = memory.model_shapes(str(path), cache)
    lossy = memory.weight_bytes(shapes, memory.resolve_plan(shapes, "auto", "q4x8", tune=tune))
    assert lossy != held_bytes(target)  # the planted estimate: every tensor costed as q4x8


def test_one_definition_of_the_bytes_a_decode_step_reads(tiny_gguf_path, tiny_llama_gguf_path, tmp_path):
    """The step bytes the comparison scripts print (scripts/compare.py, scripts/moe_vs_llamacpp.py): on an F32 file
    loaded under the fp32 plan (every tensor held as stored) the file's count and the loaded model's agree to the
    byte, untied head and tied (the embedding table read whole as the head, plus one row); a mixture's stacked
    experts count for top-k / experts on both sides and then agree too where the routers' forward is fused (a step
    reads their float32 weights), or differ by the routers' float64 copies alone where it is not; a
    q4x8 step kernel with a dense prefill half (SplitLinear) reads what the all-q4x8 plan reads, its step half.
    Planted (below): the file's count without its norms, or without the tied head, or the plan's with both halves
    of a SplitLinear, each misses."""
    from draftwise.api import load_model
    from draftwise.kernels.linear import LINEARS, SplitLinear
    from draftwise.kernels.probe import probe
    from draftwise.models.gguf import GGUFFile
    from draftwise.models.transformer import Router
    from tests.harness import fixed_tune
    from tests.tiny_checkpoints import write_tiny_moe_gguf

    cache = str(tmp_path / "cache")
    for path in (tiny_gguf_path, tiny_llama_gguf_path):
        stored = memory.file_step_bytes(path)
        tensors = {t.name: int(t.n_bytes) for t in GGUFFile(path).reader.tensors}
        table = tensors["token_embd.weight"]
        vocab = GGUFFile(path).config.vocab_size
        head = 0 if "output.weight" in tensors else table  # tied: the table is the head
        assert stored.total == sum(tensors.values()) - table + table / vocab + head
        assert stored.parts["router and norms"] > 0 and stored.parts["experts"] == 0
        model, _, _ = load_model(str(path), cache_dir=cache, weights="fp32")
        assert memory.plan_step_bytes(model) == stored.total, path.name

    moe = tmp_path / "moe.gguf"
    write_tiny_moe_gguf(moe, "qwen2_moe")
    stored = memory.file_step_bytes(moe)
    g = GGUFFile(moe)
    experts = sum(int(t.n_bytes) for t in g.reader.tensors if "_exps" in t.name)
    assert stored.parts["experts"] == experts * g.config.num_experts_per_tok / g.config.num_experts > 0
    model, _, _ = load_model(str(moe), cache_dir=cache, weights="fp32")
    routers = [m for m in model.modules() if isinstance(m, Router)]
    assert routers and len({m.fused for m in routers}) == 1
    copies = 0 if routers[0].fused else sum(m.weight.nbytes for m in routers)
    assert memory.plan_step_bytes(model) == stored.total + copies
    model.use_fused_glue(not routers[0].fused)  # the other way: the float64 copies come and go
    assert memory.plan_step_bytes(model) == stored.total + sum(m.weight.nbytes for m in routers) - copies

    if not all(LINEARS[n].available(probe(bandwidth=False)) for n in ("q4x8", "fp32")):
        return
    split, _, _ = load_model(str(tiny_gguf_path), cache_dir=cache, tune=fixed_tune("q4x8", "fp32"))
    packed, _, _ = load_model(str(tiny_gguf_path), cache_dir=cache, tune=fixed_tune("q4x8", "q4x8"))
    assert any(isinstance(m, SplitLinear) for m in split.modules())
    assert not any(isinstance(m, SplitLinear) for m in packed.modules())
    assert memory.plan_step_bytes(split) == memory.plan_step_bytes(packed) < memory.file_step_bytes(tiny_gguf_path).total
