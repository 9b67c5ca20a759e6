"""The static step is capturable: torch._dynamo traces the whole device step (n-gram lookup, the torch-only
target forward, greedy acceptance, the history write) into one graph at every batch x width bucket, and a
dispatch-mode counter sees no device -> host read inside a step and exactly one per step outside it (the
[B, W + 1] result), plus one per prefilled prompt (its first token). Each check has a planted `.item()` and a
planted data-dependent branch that must make it fail. Tiny dims, 2 layers: tracing all buckets takes seconds;
one fullgraph inductor compile (a C++ compiler on the box) takes longer and checks the compiled step's tokens."""
from __future__ import annotations

import shutil

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from draftwise.models.static_step import StaticStep
from draftwise.spec_decode.static_spec import BATCH_BUCKETS, WIDTH_BUCKETS, StaticSpecDecoder
from tests.harness import one_torch_thread  # noqa: F401 (fixture)
from tests.tiny_models import tiny_decoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [9, 8, 7], [5, 5, 5, 5, 6, 5, 5, 5, 5]]

_READ_METHODS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
                 torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}
_READ_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}


class HostReads(TorchFunctionMode):
    """Counts device -> host reads: the tensor methods that hand a value to Python (item, tolist, cpu, numpy,
    bool / int / float / index), and the aten ops that do so under any other name (_local_scalar_dense, nonzero:
    boolean indexing, torch.where(cond), masked_select...) or copy a device tensor to the CPU. (On a CPU tensor
    .cpu() is free, yet it is counted: it is what the same code does on CUDA.)"""

    def __init__(self):
        super().__init__()
        self.count, self.names, self._inside = 0, [], False
        self._ops = _ReadOps(self)

    def __enter__(self):
        self._ops.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._ops.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READ_METHODS and not self._inside:
            self._record(getattr(func, "__name__", str(func)))
            self._inside = True
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self._inside = False
        return func(*args, **(kwargs or {}))

    def _record(self, name: str) -> None:
        self.count += 1
        self.names.append(name)


class _ReadOps(TorchDispatchMode):
    def __init__(self, reads: HostReads):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_host = (func in (torch.ops.aten._to_copy.default,) and kwargs.get("device") is not None
                   and torch.device(kwargs["device"]).type == "cpu" and args[0].device.type != "cpu")
        if (func in _READ_OPS or to_host) and not self.reads._inside:
            self.reads._record(str(func))
        return func(*args, **kwargs)


def torch_only(seed=0, family="qwen2", layers=None):
    model = tiny_decoder(family, seed=seed, vocab_size=VOCAB, num_layers=layers)
    model.use_fused_glue(False)  # torch ops only: what a GPU runs
    return model


def compilable_runner(method="ngram", k=4, slots=8) -> StaticSpecDecoder:
    draft = StaticStep(torch_only(7, "llama", 1), slots, 96, "sdpa") if method == "draft_model" else None
    return StaticSpecDecoder(StaticStep(torch_only(), slots, 96, "sdpa"), (), method, k, draft=draft)


class PlantedItem(StaticSpecDecoder):
    """A step that reads a count back in the middle (as a host-side acceptance loop would)."""

    def device_step(self, slots, live, k_per_seq, width, **kw):
        out = super().device_step(slots, live, k_per_seq, width, **kw)
        most = out[:, 0].max().item()
        return out + (most - most)


class PlantedBranch(StaticSpecDecoder):
    """A step that branches on a tensor's value (skipping work when nothing was accepted)."""

    def device_step(self, slots, live, k_per_seq, width, **kw):
        out = super().device_step(slots, live, k_per_seq, width, **kw)
        if (out[:, 0] > 1).any():
            return out.clone()
        return out


def bucket_inputs(runner: StaticSpecDecoder, B: int, W: int):
    live_rows = min(B, 3)
    slots = torch.tensor(list(range(live_rows)) + [runner.target.scratch_slot] * (B - live_rows))
    live = torch.arange(B) < live_rows
    return slots, live, torch.full((B,), W - 1), W


def prefilled(runner: StaticSpecDecoder) -> StaticSpecDecoder:
    for slot, prompt in enumerate(PROMPTS):
        runner.prefill(slot, prompt)
    return runner


def graph_breaks(runner: StaticSpecDecoder, B: int, W: int) -> int:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(runner.device_step)(*bucket_inputs(runner, B, W))
    return explained.graph_break_count


def test_no_graph_breaks_at_any_bucket():
    runner = prefilled(compilable_runner())
    buckets = [(B, 4) for B in BATCH_BUCKETS] + [(2, W) for W in WIDTH_BUCKETS]
    for B, W in buckets:
        assert graph_breaks(runner, B, W) == 0, (B, W)
    plain = prefilled(compilable_runner(method=None))
    assert graph_breaks(plain, 4, 1) == 0
    drafted = prefilled(compilable_runner(method="draft_model"))  # the draft's k forwards inside the same graph
    assert graph_breaks(drafted, 2, 4) == 0


def test_rejection_sampling_traces_whole():
    from draftwise.spec_decode.static_spec import rejection_accept

    B, W, V = 2, 4, VOCAB
    p = torch.softmax(torch.randn(B, W, V), -1)
    q = torch.softmax(torch.randn(B, W - 1, V), -1)
    args = (p, q, torch.randint(0, V, (B, W - 1)), torch.tensor([3, 1]), torch.rand(B, W - 1),
            torch.empty(B, W, V).exponential_())
    torch._dynamo.reset()
    assert torch._dynamo.explain(rejection_accept)(*args).graph_break_count == 0
    with HostReads() as reads:
        rejection_accept(*args)
    assert reads.count == 0


@pytest.mark.parametrize("planted", [PlantedItem, PlantedBranch])
def test_a_planted_host_read_breaks_the_graph(planted):
    model = tiny_decoder("qwen2", seed=0, vocab_size=VOCAB)
    model.use_fused_glue(False)
    runner = prefilled(planted(StaticStep(model, 8, 96, "sdpa"), (), "ngram", 4))
    assert graph_breaks(runner, 2, 4) > 0


def count_reads(runner: StaticSpecDecoder) -> tuple[int, int]:
    """(host reads counted during generate, reads allowed: one per step plus one per prefilled prompt)."""
    with HostReads() as reads:
        runner.generate(PROMPTS, 16)
    return reads.count, runner.host_reads + len(PROMPTS)


@pytest.mark.parametrize("attention", ["sdpa", "op"])
@pytest.mark.parametrize("method", [None, "ngram", "draft_model"])
def test_one_host_read_per_step(method, attention):
    model = tiny_decoder("qwen2", seed=0, vocab_size=VOCAB)
    if attention == "sdpa":
        model.use_fused_glue(False)
    draft = None
    if method == "draft_model":
        draft = StaticStep(tiny_decoder("qwen2", seed=0, vocab_size=VOCAB), 8, 96, "op")
        if attention == "sdpa":
            draft = StaticStep(torch_only(), 8, 96, "sdpa")
    runner = StaticSpecDecoder(StaticStep(model, 8, 96, attention), (), method, 4, draft=draft)
    counted, allowed = count_reads(runner)
    assert counted == allowed and runner.host_reads > 0


@pytest.mark.parametrize("planted", [PlantedItem, PlantedBranch])
def test_a_planted_host_read_is_counted(planted):
    model = tiny_decoder("qwen2", seed=0, vocab_size=VOCAB)
    model.use_fused_glue(False)
    counted, allowed = count_reads(planted(StaticStep(model, 8, 96, "sdpa"), (), "ngram", 4))
    assert counted > allowed


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None, reason="inductor needs a C++ compiler")
def test_compiled_step_gives_the_eager_step():
    """StaticStep.compile (what api.use_static_step and scripts/gpu_check.py call; inductor, fullgraph, one bucket:
    4 sequences x width 8, one of them padding): the same emitted counts, tokens and history as the eager step,
    twice in a row (inductor fuses differently, so logits may differ in the last bits; these argmaxes do not
    depend on them)."""
    eager, runner = prefilled(compilable_runner()), prefilled(compilable_runner())
    torch._dynamo.reset()
    runner.target.compile()
    for _ in range(2):
        want = eager.device_step(*bucket_inputs(eager, 4, 8))
        assert torch.equal(runner.device_step(*bucket_inputs(runner, 4, 8)), want)
        assert torch.equal(runner.lengths, eager.lengths)
        assert torch.equal(runner.history[:3], eager.history[:3])
