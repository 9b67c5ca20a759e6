"""What the tests share: a tiny LLM (random qwen2 decoder + word-level tokenizer, assembled through
`LLM.from_parts`), a noisy draft, prompts, a real uvicorn server on a free loopback port with an `openai`
client and a /metrics reader, and the wide (GEMM) kernels' shapes, fixtures and exactness check. No downloads. Test files import from here, never from each other."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from draftwise.api import LLM
from draftwise.tokenizer import Tokenizer
from tests.tiny_models import tiny_decoder

VOCAB = 64
EOS = "<|im_end|>"
MODEL = "tiny"
CHAT_TEMPLATE = "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}{% if add_generation_prompt %}assistant{% endif %}"
PROMPTS = ["w1 w2 w3 w1 w2 w3 w1 w2", "w9 w8 w7", "w5 w5 w5 w5 w6 w5 w5 w5 w5", "w10 w20 w30 w40 w10 w20"]


def tiny_tokenizer() -> Tokenizer:
    words = ["[UNK]", "user", "assistant", "system"] + [f"w{i}" for i in range(VOCAB - 5)] + [EOS]
    backend = BackendTokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = WhitespaceSplit()
    return Tokenizer(backend, chat_template=CHAT_TEMPLATE, eos_token=EOS)


def tiny_llm(spec_config=None, max_num_seqs: int = 4, max_model_len: int = 256, k_max: int | None = None,
             kv_cache_memory=None) -> LLM:
    """api.LLM assembled around a tiny random model (no checkpoint loading); method draft_model gets a noisy
    copy of the target, whatever draft name is asked for."""
    tok = tiny_tokenizer()
    return LLM.from_parts(tiny_decoder("qwen2", 0, VOCAB), tok, name=MODEL, speculative_config=spec_config,
                          max_num_seqs=max_num_seqs, max_model_len=max_model_len, k_max=k_max,
                          kv_cache_memory=kv_cache_memory, load_draft=lambda name, dtype, weights: (noisy_draft(), tok, {"name": name}))


def noisy_draft():
    """The target's weights plus noise: agrees often, not always (both accept and reject paths run)."""
    draft = tiny_decoder("qwen2", 0, VOCAB)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return draft


# ---- structured outputs: JSON must be expressible, so a small byte-level BPE instead of the word-level one ----
JSON_EOS = "<|endoftext|>"
JSON_CORPUS = [
    '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"], "active": true}',
    '{"name": "Alan", "age": 41, "tags": [], "active": false, "city": null}',
    '{"tool": "get_weather", "arguments": {"location": "Paris", "unit": "celsius", "days": 3}}',
    '{"id": 12, "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-22", "qty": 10}], "total": 99.5}',
    "positive negative neutral mixed 2024-05-01 (1+2)*3-4/5 user assistant system",
] * 4
_json_tok: Tokenizer | None = None


def json_tokenizer() -> Tokenizer:
    """Byte-level BPE (~350 ids) trained on JSON_CORPUS (deterministic; built once per process)."""
    global _json_tok
    if _json_tok is None:
        backend = BackendTokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=350, special_tokens=[JSON_EOS], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        backend.train_from_iterator(JSON_CORPUS, trainer)
        _json_tok = Tokenizer(backend, chat_template=CHAT_TEMPLATE, eos_token=JSON_EOS)
    return _json_tok


def json_llm(spec_config=None, max_num_seqs: int = 4, max_model_len: int = 256, k_max: int | None = None,
             seed: int = 0, q4x8: bool = False) -> LLM:
    """tiny_llm's shape over json_tokenizer(): a random qwen2 decoder as wide as that vocabulary, and a noisy
    copy of it as the draft for method draft_model. `q4x8`: both in our q4x8 kernel (skips where it cannot be
    built), so every row is exact (prefix cache on, guesses verified inside the prefill)."""
    tok = json_tokenizer()
    vocab = tok.vocab_size

    def build(model):
        return row_exact(model) if q4x8 else model

    def draft(name, dtype, weights):
        d = tiny_decoder("qwen2", 0, vocab)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in d.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        return build(d), tok, {"name": name}

    return LLM.from_parts(build(tiny_decoder("qwen2", 0, vocab)), tok, name=MODEL, speculative_config=spec_config,
                          max_num_seqs=max_num_seqs, max_model_len=max_model_len, k_max=k_max,
                          load_draft=draft, seed=seed)


def row_exact(model):
    """`model` with its linears in our q4x8 kernel (skips where it cannot be built): a row's result then never depends
    on how many rows share the call, so rows of differently shaped forwards can be compared bitwise."""
    from draftwise.kernels import q4x8 as kernel
    from draftwise.kernels.plan import resolve_plan
    from draftwise.models import quant

    try:
        kernel.load()
    except kernel.KernelBuildError as e:
        pytest.skip(f"q4x8 cannot be built here: {e}")
    quant.build_linears(model, resolve_plan("q4x8", "auto", None))
    return model


class Server:
    """uvicorn serving `app` in a thread on a free 127.0.0.1 port."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def client(self, api_key="none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def metrics(self, headers=None) -> dict:
        """{(name, frozenset(labels)): value} for every sample (model_name label dropped)."""
        text = httpx.get(self.url + "/metrics", headers=headers).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
                out[(s.name, labels)] = s.value
        return out


def engine_run(target, proposer, k: int, prompts, params, max_num_seqs: int = 4, max_len: int = 96, eos=(0,),
               k_policy=None, scopes=None):
    """Run `prompts` through an Engine (engine tests: built directly) until done: (outputs, engine, requests)."""
    from draftwise.engine import Engine, Request

    eng = Engine(target, proposer, k, max_num_seqs, max_len, eos_token_ids=eos, k_policy=k_policy)
    reqs = [Request(f"r{i}", p, params, cache_scope=(scopes or [""] * len(prompts))[i]) for i, p in enumerate(prompts)]
    for r in reqs:
        eng.add_request(r)
    while eng.has_unfinished():
        eng.step()
    return [r.output_ids for r in reqs], eng, reqs


@contextlib.contextmanager
def real_model_server(model: str, spec_config: dict, **llm_kwargs):
    """A Server around a packaged real model (integration tests: loads it from the local cache)."""
    from draftwise.server.app import create_app

    llm = LLM(model, speculative_config=spec_config, **llm_kwargs)
    with Server(create_app(llm, model)) as s:
        yield s


def metric(m: dict, name: str, **labels) -> float:
    return m.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of tiny tensors: intra-op threads only add synchronisation (and stall on a busy 2-core box).
    Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")` after importing it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fixed_tune(step: str, prefill: str):
    """An injected autotuner (`tune=` of load_model / plan.resolve_plan / memory.estimate) whose timing table makes
    `step` the step kernel and `prefill` the prefill kernel: no timing, no cache."""
    from draftwise.kernels import autotune
    from draftwise.kernels.probe import probe

    ms = {n: {1: 1.0, 9: 1.0, 128: 1.0} for n in {step, prefill}}
    ms[step] = {1: 0.5, 9: 0.6, 128: 5.0}
    ms[prefill] = {**ms.get(prefill, {}), 128: 0.1, 1: ms[prefill].get(1, 1.0), 9: ms[prefill].get(9, 1.0)}
    table = {"rows": [1, 9, 128], "prefill_rows": 128, "ms": ms, "row_exact": {n: {"step": True, "prefill": True} for n in ms}}
    return lambda shapes: {"key": "injected", "probe": probe(bandwidth=False), "table": table,
                           "choice": autotune.choose(table)}


# The wide (GEMM) kernels' tests (tests/test_kernels_gemm*.py): the packaged models' projection shapes, the row
# widths, activations and the exactness check they share, and the fixtures `ops` (the module's WIDE_KIND kernel
# namespace, skipped where it cannot run), `side` (each wide side: the op name) and `threads` (torch's thread count,
# restored after the test).

# (N, K) of every projection of the packaged models, merged as the plans merge them (q|k|v, gate|up) and alone;
# the heads (vocabulary x hidden) cut to their first HEAD_ROWS rows
HEAD_ROWS = 2048
SHAPES = {
    "qwen2.5-coder-1.5b": [(2048, 1536), (1536, 1536), (256, 1536), (17920, 1536), (8960, 1536), (1536, 8960),
                           (HEAD_ROWS, 1536)],
    "qwen2.5-coder-0.5b": [(1152, 896), (896, 896), (128, 896), (9728, 896), (4864, 896), (896, 4864),
                           (HEAD_ROWS, 896)],
    "gemma-3-270m": [(1536, 640), (1024, 640), (256, 640), (640, 1024), (4096, 640), (2048, 640), (640, 2048),
                     (HEAD_ROWS, 640)],
}
KS = sorted({k for shapes in SHAPES.values() for _, k in shapes})  # 640 896 1024 1536 2048 4864 8960
WIDTHS = range(1, 513)


@pytest.fixture(scope="module")
def ops(request):
    """torch.ops.draftwise_<WIDE_KIND> (WIDE_KIND: "q4x8" or "q6k", set by the test module) with its wide kernel;
    the module is skipped where that kernel cannot run (no such CPU path, or a $DRAFTWISE_MAX_ISA cap below it)."""
    from draftwise.kernels import q4x8
    from draftwise.kernels.linear import available
    from draftwise.kernels.probe import probe

    kind = request.module.WIDE_KIND
    if kind not in available(probe(bandwidth=False)):
        pytest.skip(f"{kind} cannot run here")
    q4x8.load()  # the one library holds both kinds
    lib = getattr(torch.ops, f"draftwise_{kind}")
    if not lib.wide_available():
        pytest.skip("no wide kernel for this CPU (or capped by $DRAFTWISE_MAX_ISA): 'auto' stays on the GEMV")
    return lib


@pytest.fixture(params=["wide", "wide_vnni"])
def side(request, ops) -> str:
    """The op under test: `wide` (this process's wide side: AMX where it runs) or `wide_vnni` (the AVX-512 VNNI side,
    called explicitly: tested on AMX machines too)."""
    if request.param == "wide" and ops.wide_kind() == "vnni":
        pytest.skip("this process's wide side is the VNNI side (tested as wide_vnni)")
    return request.param


@pytest.fixture
def threads():
    """torch.set_num_threads, with the thread count restored after the test."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def wide_x(M: int, K: int, seed: int) -> torch.Tensor:  # [M, K]: rows of different scales, some with zero super-blocks
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-2, 2, M)[:, None]
    x[::7, :256] = 0.0
    return x


def first_inexact_width(fn, x: torch.Tensor, ref: torch.Tensor, widths) -> int | None:
    """The first width W at which fn(x[:W]) is not bitwise ref[:W] (ref: the GEMV's rows), or None."""
    for W in widths:
        if not torch.equal(fn(x[:W]), ref[:W]):
            return W
    return None


def assert_wide_is_gemv(lin, wide, x: torch.Tensor, widths, threads, spot) -> None:
    """A wide side against its GEMV: `lin` (the GEMV) on x [M, K] is each row alone at the `spot` rows, and
    wide(x[:W]) is bitwise the GEMV's rows for every W in `widths`, on 1 and 2 threads (`threads`: the fixture)."""
    ref = lin(x)
    for i in spot:
        assert torch.equal(lin(x[i:i + 1]), ref[i:i + 1]), i
    for n in (1, 2):
        threads(n)
        assert first_inexact_width(wide, x, ref, widths) is None, n


def wide_state(kernel: str, **env: str) -> list:
    """A kernel's wide side as a fresh process with `env` sees it (the ISA cap and the width override are read once
    per process): [wide_available, wide_min_rows, wide_takes(4096), wide_kind] of torch.ops.draftwise_<kernel>."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, torch; from draftwise.kernels import library; library.load(); "
            f"o = torch.ops.draftwise_{kernel}; "
            "print(json.dumps([o.wide_available(), o.wide_min_rows(), o.wide_takes(4096), o.wide_kind()]))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=600, check=True).stdout.strip().splitlines()[-1]
    return json.loads(out)

