"""The block-type table (kernels/blocktypes.py): its rows agree with the gguf package's type ids and block sizes,
every kernel a row names is a registered linear that declares those types and brings C++ units that exist, and
the readers of the table (the faithful plan, the loader's block kernels, `draftwise memory`'s stored bytes, the
plan's named slow path) answer from it. Needs no compiler and no download."""
from __future__ import annotations

import pytest
import torch

from draftwise.kernels import blocktypes, ggml_blocks
from draftwise.kernels.library import CSRC, ISA_FLAGS
from draftwise.kernels.linear import LINEARS
from draftwise.kernels.plan import FAITHFUL_KERNELS, KernelPlan, faithful_kernel


def test_rows_are_ggmls_ids_and_block_sizes():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for name, t in blocktypes.TYPES.items():
        gt = GGMLQuantizationType[name]
        assert int(gt) == t.type_id, name
        assert GGML_QUANT_SIZES[gt] == (t.values, t.block_bytes), name


def test_every_kernel_row_is_a_registered_linear_holding_its_types():
    for k in blocktypes.KERNELS.values():
        assert k.name in LINEARS, k.name
        assert k.activation in ("Q8_K", "Q8_0", "Q8_1", "F32"), k.name
        assert (k.activation == "F32") == bool(k.element), k.name  # a float row: float32 activations
        for src, isa in k.units:
            assert (CSRC / src).exists(), src
            assert isa == blocktypes.MAIN or isa in ISA_FLAGS, (src, isa)
        if k.name in blocktypes.block_kernels():
            assert set(LINEARS[k.name].GGUF_TYPES) == set(blocktypes.types_of(k.name)), k.name
    for t in blocktypes.TYPES.values():
        assert t.kernel is None or t.kernel in blocktypes.KERNELS, t.name
        assert t.quantized or t.kernel is None or blocktypes.KERNELS[t.kernel].element, t.name


def test_the_plan_and_the_loader_read_the_table():
    assert FAITHFUL_KERNELS == {t.name: t.kernel for t in blocktypes.TYPES.values() if t.kernel}
    for name in blocktypes.TYPES:
        assert faithful_kernel(name) == blocktypes.kernel_of(name)
    assert faithful_kernel("NOT_A_TYPE") == blocktypes.FALLBACK
    assert ggml_blocks.BLOCK_BYTES["Q6_K"] == 210 and ggml_blocks.BLOCK_VALUES["Q8_0"] == 32


def test_memory_costs_a_stored_tensor_by_its_row():
    from draftwise.bench.memory import _stored_bytes

    assert _stored_bytes("Q5_K", (1536, 8960)) == 1536 * 8960 // 256 * 176
    assert _stored_bytes("BF16", (10, 32)) == 640
    with pytest.raises(KeyError, match="no GGUF type"):
        _stored_bytes("Q9_X", (1, 32))


def test_a_type_without_a_kernel_is_named_with_what_its_fallback_costs():
    without = next(t for t in blocktypes.TYPES.values() if t.quantized and t.kernel is None)
    plan = KernelPlan("q4x8", "q4x8", "float32", faithful=True,
                      stored_types={"Q4_K": 100, without.name: 7, "F32": 2})
    assert plan.fallback_types == {without.name: 7}  # a float type is dense, not a slow path
    ratio = blocktypes.FALLBACK_BITS / without.bits
    assert f"SLOW PATH: no kernel of its own for {without.name} x7" in plan.describe()
    assert f"{ratio:.1f}x their memory" in plan.describe()
    assert plan.to_dict()["fallback_types"] == {without.name: 7}
    held = KernelPlan("q4x8", "q4x8", "float32", faithful=True, stored_types={"Q4_K": 100, "F32": 2})
    assert held.fallback_types == {} and "SLOW PATH" not in held.describe()
    named = KernelPlan("q4x8", "q4x8", "float32", stored_types={without.name: 7})
    assert named.fallback_types == {}  # a named plan computes every tensor with its own kernels (lossy, said)


def test_describe_says_what_a_type_is_held_in():
    assert blocktypes.describe("Q6_K").startswith("Q6_K: 6.56 bits stored -> q6k (Q8_K activations")
    assert "fp32 fallback" in blocktypes.describe(next(
        t.name for t in blocktypes.TYPES.values() if t.quantized and t.kernel is None))
    assert blocktypes.describe("F32").endswith("dense")
    assert blocktypes.describe("F16") == "F16: 16.00 bits stored -> f16 (F32 activations, 16.00 bits)"
    # a 32-block type is held with its scales in its own form (csrc/q8_0.h): IQ4_XS's SUB8, Q4_0's fp16
    assert blocktypes.describe("IQ4_XS").startswith("IQ4_XS: 4.25 bits stored -> q4c (Q8_0 activations, 4.31 bits")
    # Q5_K on q4x8's arithmetic with a fifth-bit plane (csrc/q4x8.h)
    assert blocktypes.describe("Q5_K") == "Q5_K: 5.50 bits stored -> q5x8 (Q8_K activations, 5.75 bits, wide kernel)"
    assert blocktypes.describe("Q4_0").startswith("Q4_0: 4.50 bits stored -> q4c (Q8_0 activations, 4.50 bits")


def test_a_float_row_brings_its_header_and_the_familys_units():
    from draftwise.kernels.library import _units

    for k in blocktypes.KERNELS.values():
        if k.element:
            assert k.units == blocktypes.FLOAT_UNITS and (CSRC / f"{k.name}.h").exists(), k.name
            assert f"{k.name}_float.o" in {obj for _, _, obj in _units()}, k.name


def test_auto_is_the_faithful_plan_for_a_float_type_with_a_kernel():
    from draftwise.kernels.plan import faithful_by_default

    assert faithful_by_default({"F16": 196, "F32": 57}) and not faithful_by_default({"F32": 196})
    assert faithful_by_default({"Q4_K": 1, "F32": 2})


def test_the_prepared_files_key_follows_each_stored_types_row(monkeypatch, tmp_path):
    """A faithful plan's prepared file is keyed by the kernel and scale form each stored type is held in, so a
    file prepared before a row changed (Q5_K on q8_1, then q5m with SUB8 scales, now q5x8) is not read as the
    new layout. Planted: the row of Q5_K moved back to q5m, then to another scale form there: both new keys."""
    import dataclasses
    from types import SimpleNamespace

    from draftwise.models.sources import prepared_path

    ckpt = SimpleNamespace(info={"sha256": "0" * 64, "converted_path": str(tmp_path)})
    plan = KernelPlan("q4x8", "q4x8", "float32", faithful=True, stored_types={"Q5_K": 196, "Q6_K": 28})
    keys = [prepared_path(ckpt, plan, torch.float32)]
    for change in ({"kernel": "q5m", "scales": "sub8"}, {"scales": "f32"}):
        monkeypatch.setitem(blocktypes.TYPES, "Q5_K", dataclasses.replace(blocktypes.TYPES["Q5_K"], **change))
        keys.append(prepared_path(ckpt, plan, torch.float32))
    assert len(set(keys)) == 3, keys
    assert prepared_path(ckpt, KernelPlan("q4x8", "q4x8", "float32", faithful=True, stored_types={"Q6_K": 1}),
                         torch.float32) not in keys
    q3k_m = KernelPlan("q4x8", "q4x8", "float32", faithful=True, stored_types={"Q3_K": 113, "Q4_K": 81})
    now = prepared_path(ckpt, q3k_m, torch.float32)
    monkeypatch.setitem(blocktypes.TYPES, "Q3_K", dataclasses.replace(blocktypes.TYPES["Q3_K"], kernel="q6k"))
    assert prepared_path(ckpt, q3k_m, torch.float32) != now  # a file prepared with Q3_K on q6k (before q3k)


def test_writing_a_prepared_file_removes_the_ones_no_key_reaches(monkeypatch, tmp_path):
    """The old prepared files leave the disk: a folder holding files of an older format, of a table row since
    moved (Q5_K on another kernel), without a record (format <= 8) and a dead writer's partial file keeps only the
    current one, a live writer's partial file and the lock. Planted: a file recorded under the current key inputs
    must stay, and moving the row back makes the moved file's record current again."""
    import dataclasses
    import json
    import os
    from types import SimpleNamespace

    from draftwise.models import quant
    from draftwise.models import safetensors as st
    from draftwise.models.sources import drop_unreachable, prepared_key_inputs, unreachable

    sha = "1" * 64
    ckpt = SimpleNamespace(info={"sha256": sha, "converted_path": str(tmp_path)})
    plan = KernelPlan("q4x8", "q4x8", "float32", faithful=True, stored_types={"Q5_K": 196, "Q6_K": 28})
    now = prepared_key_inputs(ckpt, plan, torch.float32)

    def write(name, what):
        meta = {"format": "draftwise-prepared"} | ({"key_inputs": json.dumps(what)} if what is not None else {})
        t = torch.zeros(2)
        st.write_tensors(tmp_path / name, [("x", (2,), torch.float32)], [("x", t)], meta)

    write("prepared-current.safetensors", now)
    write("prepared-format.safetensors", [sha, quant.PREPARED_FORMAT_VERSION - 1] + now[2:])
    write("prepared-other-gguf.safetensors", ["2" * 64] + now[1:])
    write("prepared-unrecorded.safetensors", None)
    moved = json.loads(json.dumps(now))
    moved[-1]["Q5_K"][0] = "q8_1"  # recorded while Q5_K's row named another kernel
    write("prepared-moved.safetensors", moved)
    for name in (f"prepared-x.safetensors.tmp-{os.getpid()}", "prepared-y.safetensors.tmp-999999999",
                 "prepared-current.safetensors.lock"):
        (tmp_path / name).write_bytes(b"")
    monkeypatch.setitem(blocktypes.TYPES, "Q5_K", dataclasses.replace(blocktypes.TYPES["Q5_K"], kernel="q8_1"))
    assert not unreachable(moved, sha)  # the planted move back: its record is current again
    monkeypatch.undo()
    gone = {p.name for p in drop_unreachable(tmp_path, sha)}
    assert gone == {"prepared-format.safetensors", "prepared-other-gguf.safetensors", "prepared-unrecorded.safetensors",
                    "prepared-moved.safetensors", "prepared-y.safetensors.tmp-999999999"}, gone
    assert {p.name for p in tmp_path.iterdir()} == {"prepared-current.safetensors", "prepared-current.safetensors.lock",
                                                     f"prepared-x.safetensors.tmp-{os.getpid()}"}
