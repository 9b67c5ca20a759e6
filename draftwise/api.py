"""The public Python API in vLLM's shape: LLM, SamplingParams, RequestOutput.

Owns model loading into an Engine (target + proposer), prompt handling (text, token ids, chat messages),
compiling a request's structured_outputs for the target's tokenizer (once per request; grammars are cached per
schema) and turning finished engine requests into RequestOutputs with timing and speculation stats. Knows no HTTP.
"""
from __future__ import annotations

import os
import time
import uuid
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

import torch

from draftwise.config import ConfigError, EngineConfig, SpecConfig, parse_kv_cache_memory, parse_spec_config
from draftwise.engine import PREFILL_CHUNK_TOKENS, Engine, Request, StepOutput  # noqa: F401 (the chunk: bench/memory.py)
from draftwise.kernels import heap, hugepages, step_cost
from draftwise.kernels.plan import KernelPlan, resolve_plan
from draftwise.kernels.threads import ThreadGuard
from draftwise.models.static_step import StaticStep
from draftwise.kv_cache import (BLOCK_SIZE, blocks_for_budget, budget_bytes, bytes_per_token, kv_dtype, pool_blocks,
                                target_cache_capacity)
from draftwise.models.transformer import Decoder
from draftwise.output import TextStream
from draftwise.prefix_cache import PrefixCache
from draftwise.sampling import SamplingParams, TokenLogprob
from draftwise.spec_decode import static_spec
from draftwise.spec_decode.adaptive import AdaptiveK, FixedK, KPolicy
from draftwise.spec_decode.builders import ProposerContext, build_proposer
from draftwise.spec_decode.proposer import Proposer
from draftwise.spec_decode.stats import SpecStats

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "load_model"]

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # a plan's dtype as torch's
_OLD_K_MAX_KEYWORD = "max_lookahead"  # LLM(k_max=...)'s keyword before the rename: still accepted, deprecated


def _k_max_or_old(k_max: int | None, old: dict, where: str) -> int | None:
    """k_max, or the value given under its old keyword (with a DeprecationWarning); any other keyword: TypeError."""
    unknown = sorted(set(old) - {_OLD_K_MAX_KEYWORD})
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}")
    if _OLD_K_MAX_KEYWORD not in old:
        return k_max
    if k_max is not None:
        raise TypeError(f"{where}() got both k_max and {_OLD_K_MAX_KEYWORD} (its old name)")
    warnings.warn(f"{where}({_OLD_K_MAX_KEYWORD}=...) is deprecated; use k_max=...", DeprecationWarning, stacklevel=3)
    return old[_OLD_K_MAX_KEYWORD]


@dataclass(frozen=True)
class EngineStatus:
    running: int  # requests decoding
    waiting: int  # requests queued for a slot
    free_slots: int
    spec_stats: SpecStats  # cumulative speculation counters (the engine's own, read live)
    prefix_cache: PrefixCache | None  # its counters (prefix_cache_queries / hits), None when off
    kv_blocks_free: int = 0  # the target's K/V pool: free blocks (of kv_block_size tokens) for admission
    kv_blocks: int = 0
    kv_block_size: int = 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None  # the target's raw logprobs per token, when params.logprobs is set


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    ttft_s: float | None = None
    total_s: float | None = None
    spec: dict | None = None  # speculation stats (None when speculation is off)
    metrics: dict = field(default_factory=dict)
    error: str | None = None  # what failed when the finish reason is "error" (engine.Request.error)
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache (vLLM's RequestOutput field)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens of every sample (n > 1: summed, as OpenAI's usage counts them)."""
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float | None:
        if not self.total_s:
            return None
        return self.num_output_tokens / self.total_s


def load_model(name: str, dtype: str = "auto", device: str = "cpu", weights: str = "auto",
               cache_dir: str | None = None, tune=None, role: str = "target"):
    """Resolve and load a checkpoint: returns (Decoder, Tokenizer, info dict). The one loader of the package.

    The decoder is built with the KernelPlan kernels/plan.py resolves for `weights` / `dtype` on `device` ("auto"
    weights: the kernels the autotuner measured fastest here for this model's shapes; `tune` injects its result
    in tests) and owns it (`Decoder.plan`); `role` "draft": a speculation draft, whose "auto" is the fastest plan,
    lossy allowed (kernels/plan.py resolve_plan). A GGUF on the CPU is built straight from its blocks and cached in
    the plan's stored form; otherwise the dense weights load and the plan's kernels are built from them. info
    gets the resolved `weights` (the plan's label), `dtype` and `plan` (its dict)."""
    from draftwise.models import quant
    from draftwise.models.sources import load_checkpoint

    check_device(device)  # before the checkpoint is read
    ckpt = load_checkpoint(name, cache_dir=cache_dir)
    # a GGUF built from its blocks on the CPU: the plan knows the file's stored types (auto keeps them: faithful)
    types = ckpt.tensor_types() if "converted_path" in ckpt.info and device == "cpu" else None
    stored = quant.type_census(types, ckpt.config) if types else None
    plan = resolve_plan(weights, dtype, ckpt.config, device, tune=tune, stored_types=stored, role=role)
    torch_dtype = TORCH_DTYPES[plan.dtype]
    cfg = ckpt.config
    # a GGUF on the CPU: built from its blocks, cached in the plan's stored form, no dense float32 copy on disk
    # (the prepared modules and their cache are CPU layouts; on a GPU the kernels are built from the dense weights
    # there; int8_dynamic has no stored form)
    if "converted_path" in ckpt.info and device == "cpu" and "int8_dynamic" not in (plan.step, plan.prefill):
        embed_dtype = quant.embed_storage_dtype(cfg.vocab_size, cfg.hidden_size, plan)
        model = Decoder.from_tensors(cfg, ckpt.prepared(plan, embed_dtype), dtype=torch_dtype, device=device,
                                     embed_dtype=embed_dtype)
        model.plan = plan
    else:
        model = Decoder.from_tensors(cfg, ckpt.tensors(torch_dtype), dtype=torch_dtype, device=device)
        quant.build_linears(model, plan)
    info = dict(ckpt.info, dtype=plan.dtype, weights=plan.label, plan=plan.to_dict())
    # opt-in (DRAFTWISE_HUGE_PAGES=1): 2 MiB pages for the weights every step streams; not shown to pay end to end
    # here (docs/PERFORMANCE.md, huge pages), while the copy and the collapse cost seconds of load
    if device == "cpu" and os.environ.get("DRAFTWISE_HUGE_PAGES", "0") == "1":
        placed = hugepages.place_in_huge_pages(model)
        info["huge_pages"] = {"thp": placed["mode"], "bytes": placed["moved_bytes"]}
    return model, ckpt.tokenizer, info


def check_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but this torch build sees no CUDA device; use --device cpu")


class LLM:
    """An engine over one target model, optionally speculating with a proposer (vLLM's `LLM` shape).

    The one place an engine is assembled: `LLM(...)` loads the checkpoint(s) and calls the same assembly as
    `LLM.from_parts(...)` (an already built decoder and tokenizer: tests, scripts). `set_speculation` switches
    the proposer and k policy between runs (built once per configuration and cached); `run` steps the engine
    until the given requests are done and is what generate, the bench, `draftwise verify` and the tests use.
    The server's engine thread steps it by hand: `add_request`, `step`, `abort`, `has_unfinished`, `status`."""

    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        device: str = "cpu",
        speculative_config: str | dict | SpecConfig | None = None,
        weights: str = "auto",
        threads: int | None = None,
        max_num_seqs: int = 8,
        max_model_len: int | None = None,
        seed: int = 0,
        cache_dir: str | None = None,
        k_max: int | None = None,
        thread_guard: bool = True,
        enable_prefix_caching: bool | None = None,
        kv_cache_memory: str | int | float | None = None,
        kv_cache_dtype: str = "auto",
        **old_keywords,
    ):
        k_max = _k_max_or_old(k_max, old_keywords, "LLM")
        config = EngineConfig(model=model, dtype=dtype, device=device, weights=weights, threads=threads,
                              max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                              spec_config=parse_spec_config(speculative_config), seed=seed, thread_guard=thread_guard,
                              enable_prefix_caching=enable_prefix_caching,
                              kv_cache_memory=parse_kv_cache_memory(kv_cache_memory), kv_cache_dtype=kv_cache_dtype)
        if threads:
            torch.set_num_threads(threads)
        self._cache_step_costs = True  # a loaded checkpoint's grids are cached per machine (from_parts: measured)
        t0 = time.perf_counter()
        target, tokenizer, info = load_model(model, config.dtype, config.device, config.weights, cache_dir)

        def load_draft(name: str, draft_dtype: str, draft_weights: str | None):
            # the one place a draft's plan is decided: draft_weights as given, else "auto" in the draft role — the
            # fastest plan the autotuner measures for its shapes, lossy allowed even under a faithful target (a
            # draft's precision never changes the output: every guess is verified exactly by the target)
            return load_model(name, draft_dtype, config.device, draft_weights or "auto", cache_dir, role="draft")

        self._assemble(config, target, tokenizer, info, load_draft, k_max)
        self.load_time_s = time.perf_counter() - t0
        hugepages.collapse_pending()  # loading is over: the kernel may now back the weights with huge pages
        if config.device == "cpu":  # loading is over: a forward's temporaries are reused from the heap from now on
            heap.keep_temporaries_on_heap()

    @classmethod
    def from_parts(cls, model: Decoder, tokenizer, *, name: str = "model", dtype: str = "float32",
                   speculative_config: str | dict | SpecConfig | None = None, max_num_seqs: int = 8,
                   max_model_len: int | None = None, seed: int = 0, k_max: int | None = None,
                   load_draft: Callable[[str, str, str | None], tuple] | None = None,
                   model_info: dict | None = None, enable_prefix_caching: bool | None = None,
                   kv_cache_memory: str | int | float | None = None, kv_cache_dtype: str = "auto",
                   **old_keywords) -> "LLM":
        """An LLM around an already built decoder and tokenizer; `load_draft(name, dtype, weights)` returns
        (Decoder, Tokenizer, info) for method draft_model."""
        k_max = _k_max_or_old(k_max, old_keywords, "LLM.from_parts")
        llm = cls.__new__(cls)
        config = EngineConfig(model=name, dtype=dtype, device=str(model.device.type), max_num_seqs=max_num_seqs,
                              max_model_len=max_model_len, spec_config=parse_spec_config(speculative_config),
                              seed=seed, enable_prefix_caching=enable_prefix_caching,
                              kv_cache_memory=parse_kv_cache_memory(kv_cache_memory), kv_cache_dtype=kv_cache_dtype)
        llm._assemble(config, model, tokenizer, model_info or {}, load_draft, k_max)
        llm.load_time_s = 0.0
        return llm

    def _assemble(self, config: EngineConfig, model: Decoder, tokenizer, model_info: dict, load_draft,
                  k_max: int | None) -> None:
        mc = model.config
        self.model, self.tokenizer, self.model_info = model, tokenizer, model_info
        # the model's own context by default, within what the K/V pool holds (its budget at this model's width)
        self.kv_cache_dtype = kv_dtype(config.kv_cache_dtype, model.dtype, getattr(model, "fused", False))
        self.max_model_len = config.max_model_len or self._context_in_pool(config, model, k_max)
        self.config = replace(config, max_model_len=self.max_model_len)
        self.draft_info: dict | None = None
        self._load_draft = load_draft
        self._proposers: dict[SpecConfig, Proposer] = {}  # by the config without k
        self._k_policies: dict[SpecConfig, KPolicy] = {}
        self._step_costs: dict[tuple[int, str], step_cost.StepCost] = {}  # (id(model), logits) -> its live grid
        k_max = max(k_max or 0, config.spec_config.k_max)
        # the target's K/V pool from the budget (a draft model's pool follows it: spec_decode/builders.py)
        self.kv_cache_blocks = pool_blocks(
            config.kv_cache_memory, bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                                                    self.kv_cache_dtype.itemsize),
            config.max_num_seqs, target_cache_capacity(self.max_model_len, k_max))
        proposer, k_policy = self._proposer_and_policy(config.spec_config, k_max)
        eos = tuple(tokenizer.eos_token_ids) or tuple(mc.eos_token_ids)
        self.eos_token_ids = eos  # what ends a sequence; a grammar allows them exactly when the output is complete
        self.engine = Engine(model, proposer, k_max, config.max_num_seqs, self.max_model_len, eos,
                             seed=config.seed, k_policy=k_policy, thread_guard=self._thread_guard(config, model.plan),
                             prefix_cache=self._prefix_cache(config, model.plan),
                             speculate_in_prefill=model.plan.row_exact, kv_cache_blocks=self.kv_cache_blocks,
                             kv_cache_dtype=self.kv_cache_dtype)
        self._static: dict | None = None  # use_static_step: the static step and its runner per spec config
        if model.device.type == "cuda":
            self.use_static_step()

    @staticmethod
    def _context_in_pool(config: EngineConfig, model: Decoder, k_max: int | None) -> int:
        """The model's context (max_position_embeddings), cut to the tokens the K/V budget holds for one
        sequence (less a verification's look-ahead)."""
        mc = model.config
        k = max(k_max or 0, config.spec_config.k_max)
        kv = kv_dtype(config.kv_cache_dtype, model.dtype, getattr(model, "fused", False))
        per_token = bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, kv.itemsize)
        pooled = blocks_for_budget(budget_bytes(config.kv_cache_memory), per_token) * BLOCK_SIZE - k - 1
        return max(1, min(mc.max_position_embeddings, pooled))

    @staticmethod
    def _thread_guard(config: EngineConfig, plan: KernelPlan) -> ThreadGuard | None:
        """A ThreadGuard where a thread count cannot change a result (the plan is row-exact)."""
        if not config.thread_guard or not plan.row_exact:
            return None
        return ThreadGuard(config.threads)  # None: the thread count torch runs with now

    @staticmethod
    def _prefix_cache(config: EngineConfig, plan: KernelPlan) -> PrefixCache | None:
        """A PrefixCache when asked; by default where it cannot change a token: where the plan is row-exact, so a
        prompt prefilled after a cached prefix is bitwise one prefilled whole."""
        enabled = config.enable_prefix_caching
        if enabled is None:
            enabled = plan.row_exact
        return PrefixCache() if enabled else None

    def prefix_caches(self) -> dict[str, PrefixCache]:
        """The prefix caches in use: "target" and each built draft model's (by its model name)."""
        caches = {"target": self.engine.prefix_cache}
        for identity, p in self._proposers.items():
            vocab = f" (draft_vocab_size {identity.draft_vocab_size})" if identity.draft_vocab_size else ""
            caches[f"draft {identity.model}{vocab}"] = getattr(p, "prefix_cache", None)
        return {name: c for name, c in caches.items() if c is not None}

    # ---- stepping by hand (the server's engine thread) ----------------------------------------
    @property
    def max_num_seqs(self) -> int:
        """KV-cache slots: the most requests decoded at once (more wait for a free slot)."""
        return self.config.max_num_seqs

    @property
    def k_max(self) -> int:
        """The engine's cap on k: the guesses one verification may hold (it sized the KV caches)."""
        return self.engine.k_max

    @property
    def thread_guard(self) -> ThreadGuard | None:
        """The engine's ThreadGuard (None: off): its thread counts and changes, for a run's manifest."""
        return self.engine.thread_guard

    def add_request(self, req: Request) -> None:
        """Queue a request from `new_request`; it joins the next step. Raises ContextLengthError when its prompt
        plus max_tokens exceed max_model_len, ConfigError for other requests that cannot run."""
        self.engine.add_request(req)

    def step(self) -> list[StepOutput]:
        """One engine step over every running request (admitting waiting ones into free slots)."""
        return self.engine.step()

    def abort(self, request_id: str) -> None:
        """Drop a request, waiting or running (its slot is free for the next step); unknown ids are ignored."""
        self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def status(self) -> EngineStatus:
        """What a monitor reads (the server's /metrics): queue lengths, free slots and the cumulative counters."""
        e = self.engine
        return EngineStatus(len(e.running), len(e.waiting), e.num_free_slots, e.stats, e.prefix_cache,
                            e.cache.num_available_blocks, e.cache.num_blocks, e.cache.block_size)

    # ---- speculation --------------------------------------------------------------------------
    @property
    def spec_config(self) -> SpecConfig:
        return self.config.spec_config

    @property
    def proposer(self) -> Proposer:
        return self.engine.proposer

    def set_speculation(self, speculative_config: str | dict | SpecConfig | None) -> SpecConfig:
        """Switch to another speculative config between runs (the engine must be idle). Its k must fit the
        engine's look-ahead (`k_max` at construction). Proposers are built once per config."""
        spec_config = parse_spec_config(speculative_config)
        proposer, k_policy = self._proposer_and_policy(spec_config, self.engine.k_max)
        self.engine.set_speculation(proposer, k_policy)
        self.config = replace(self.config, spec_config=spec_config)
        hugepages.collapse_pending()  # a draft model this config loaded
        return spec_config

    def _proposer_and_policy(self, spec_config: SpecConfig, k_max: int) -> tuple[Proposer, KPolicy]:
        """The proposer is built once per proposer identity (the config without k: arms that differ only in k
        share it, so a draft model loads once); the k policy once per config (AdaptiveK calibrates)."""
        if spec_config.k_max > k_max:
            raise ConfigError(f"num_speculative_tokens {spec_config.k_max} exceeds the engine's "
                              f"look-ahead of {k_max} tokens; build the LLM with k_max >= it")
        proposer = self._proposer(spec_config, k_max)
        if spec_config not in self._k_policies:
            if spec_config.adaptive:
                draft = getattr(proposer, "model", None)  # a draft model's forwards cost by its own grid
                policy = AdaptiveK(spec_config.k_max, self.step_cost(self.model),
                                   self.step_cost(draft, "last") if draft is not None else None)
                policy.align_draft(self.model, draft)  # grids timed at different loads: their ratio now
                self._k_policies[spec_config] = policy
                if hasattr(proposer, "step_cost"):  # a tree proposer sizes its trees by the same live grid
                    proposer.step_cost = policy.target
            else:
                self._k_policies[spec_config] = FixedK(spec_config.k_max)
        return proposer, self._k_policies[spec_config]

    def step_cost(self, model: Decoder, logits: str = "all") -> step_cost.StepCost:
        """`model`'s step-cost grid (kernels/step_cost.py: seconds per step of B rows x width tokens; logits "last":
        a draft's forwards), measured once per LLM (a loaded checkpoint's from the per-machine cache) and shared by
        every k policy, whose engine steps correct it online."""
        key = (id(model), logits)
        if key not in self._step_costs:
            self._step_costs[key] = step_cost.load_or_measure(
                model, self.config.max_num_seqs, step_cost.GRID_WIDTHS, logits,
                cache=getattr(self, "_cache_step_costs", False))
        return self._step_costs[key]

    def _proposer(self, spec_config: SpecConfig, k_max: int) -> Proposer:
        # arms that differ only in k share a proposer, except suffix's: its cache of earlier outputs must hold its
        # own arm's only (another arm's output of the same prompt would be a perfect guess)
        identity = spec_config if spec_config.method == "suffix" else replace(spec_config, num_speculative_tokens=0)
        if identity not in self._proposers:
            self._proposers[identity] = build_proposer(spec_config, self._proposer_context(k_max))
        return self._proposers[identity]

    def _proposer_context(self, k_max: int) -> ProposerContext:
        def load_draft(name: str, dtype: str, weights: str | None):
            model, tok, info = self._load_draft(name, dtype, weights)
            self.draft_info = info
            return model, tok, info

        return ProposerContext(
            target_name=self.config.model, target_vocab_size=self.model.config.vocab_size,
            target_tokenizer=self.tokenizer, max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len, k_max=k_max, dtype=self.config.dtype,
            load_draft=load_draft if self._load_draft is not None else None,
            prefix_caching=self.config.enable_prefix_caching, kv_cache_blocks=self.kv_cache_blocks,
            kv_cache_dtype=self.config.kv_cache_dtype,
            proposer_for=lambda spec_config: self._proposer(spec_config, k_max))  # grammar + X shares X's proposer

    # ---- prompts ------------------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return None, list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ConfigError("a prompt must be text, a list of token ids, or {'prompt_token_ids': [...]}")

    def new_request(self, prompt, params: SamplingParams) -> tuple[Request, TextStream]:
        text, ids = self._prompt_ids(prompt)
        bad = [t for t in ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise ConfigError(f"prompt token ids out of the vocabulary (size {self.model.config.vocab_size}): {bad[:5]}")
        self.engine.check_vocab_limit(ids)  # a draft model with fewer embedding rows than the target
        beyond = [t for t in params.logit_bias if t >= self.model.config.vocab_size]
        if beyond:
            raise ConfigError(f"logit_bias: token id {beyond[0]} is out of the vocabulary (size "
                              f"{self.model.config.vocab_size})", param="logit_bias")
        if params.n != 1:
            raise ConfigError("new_request builds one sample: split n > 1 with SamplingParams.samples()")
        stream = TextStream.for_params(self.tokenizer, params)
        req = Request(uuid.uuid4().hex[:16], ids, params, on_token=stream.add, prompt_text=text,
                      grammar=self.compile_grammar(params))
        return req, stream

    def compile_grammar(self, params: SamplingParams):
        """params.structured_outputs compiled for the target's tokenizer (cached per constraint), or None."""
        if params.structured_outputs is None:
            return None
        from draftwise.structured.grammar import compile_constraint

        return compile_constraint(params.structured_outputs, self.tokenizer, self.eos_token_ids)

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError(f"{len(params)} sampling params for {len(prompts)} prompts")
        # n > 1: n requests of one prompt (seed + index); admitted in turn, so the prefix cache shares the prompt
        groups = [[self.new_request(p, one) for one in (sp or SamplingParams()).samples()]
                  for p, sp in zip(prompts, params)]
        bar = _progress(len(groups)) if use_tqdm else None
        self.run([req for g in groups for req, _ in g],
                 on_finished=(lambda req: bar.update(1)) if bar else None)
        if bar:
            bar.close()
        return [self.merge_outputs([self._finish_output(req, stream) for req, stream in g]) for g in groups]

    @staticmethod
    def merge_outputs(samples: list[RequestOutput]) -> RequestOutput:
        """The n samples of one prompt as one RequestOutput: outputs indexed 0..n-1, the first's id and timings."""
        if len(samples) == 1:
            return samples[0]
        outputs = [replace(s.outputs[0], index=i) for i, s in enumerate(samples)]
        return replace(samples[0], outputs=outputs, finished=all(s.finished for s in samples),
                       error=next((s.error for s in samples if s.error), None))

    # ---- the static step (models/static_step.py, spec_decode/static_spec.py): the CUDA path ------------------
    def use_static_step(self, enable: bool = True, compile_mode: str | None = None) -> bool:
        """Route `run`'s eligible batches (static_spec.eligible: greedy, plain or n-gram, nothing the engine adds)
        through the static step instead of the engine. On by default on CUDA, compiled there with CUDA graphs
        (`compile_mode` "reduce-overhead"; each bucket compiles at its first use); off on the CPU, where the engine's
        C++ path is faster. Returns whether it is on."""
        if not enable or self.config.max_num_seqs > static_spec.BATCH_BUCKETS[-1]:
            self._static = None
            return False
        capacity = self.max_model_len + static_spec.WIDTH_BUCKETS[-1] + static_spec.PREFILL_CHUNK
        step = StaticStep(self.model, self.config.max_num_seqs, capacity, kv_dtype=self.kv_cache_dtype)
        mode = compile_mode or ("reduce-overhead" if self.model.device.type == "cuda" else None)
        if mode is not None:
            step.compile(mode)
        self._static = {"step": step, "runners": {}}
        return True

    def _static_runner(self, requests: Sequence[Request]):
        sc = self.spec_config
        if self._static is None or not requests or not static_spec.eligible(requests, sc.method, self.max_model_len):
            return None
        runners = self._static["runners"]
        if sc not in runners:
            k = sc.num_speculative_tokens if sc.method == "ngram" else 4
            if k != "auto":
                k = min(k, static_spec.WIDTH_BUCKETS[-1] - 1)
            runners[sc] = static_spec.StaticSpecDecoder(
                self._static["step"], self.eos_token_ids, None if sc.method == "none" else sc.method, k,
                sc.prompt_lookup_min, sc.prompt_lookup_max)
            if k == "auto":
                runners[sc].calibrate()
        return runners[sc]

    def run(self, requests: Sequence[Request], on_finished: Callable[[Request], None] | None = None) -> None:
        """Add the requests and step the engine until nothing is left unfinished (the one run-until-done loop);
        with use_static_step on, an eligible batch runs through the static step instead."""
        static = self._static_runner(requests)
        if static is not None:
            static.run_requests(requests, self.eos_token_ids, on_finished)
            return
        for req in requests:
            self.engine.add_request(req)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished and on_finished is not None:
                    on_finished(out.request)

    def stream(self, prompt, params: SamplingParams) -> Iterator[str | RequestOutput]:
        """Yield text deltas as tokens arrive, then the final RequestOutput (one request at a time)."""
        req, stream = self.new_request(prompt, params)
        self.engine.add_request(req)
        while not req.finished:
            self.engine.step()
            delta = stream.delta()
            if delta:
                yield delta
        tail = stream.finish()
        if tail:
            yield tail
        yield self.to_output(req, stream.text)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = False):
        """One conversation (a list of {role, content}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.tokenizer.encode_chat(c)} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _finish_output(self, req: Request, stream: TextStream) -> RequestOutput:
        stream.finish()
        return self.to_output(req, stream.text)

    def to_output(self, req: Request, text: str) -> RequestOutput:
        ttft = req.first_token_time - req.arrival_time if req.first_token_time else None
        total = req.finish_time - req.arrival_time if req.finish_time else None
        spec_stats = req.spec_stats.to_dict() if self.spec_config.enabled else None
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt_text, prompt_token_ids=req.prompt_ids,
            outputs=[CompletionOutput(0, text, list(req.output_ids), req.finish_reason,
                                      list(req.logprobs) if req.params.logprobs is not None else None)],
            finished=req.finished, ttft_s=ttft, total_s=total, spec=spec_stats, error=req.error,
            num_cached_tokens=req.num_cached_tokens,
        )


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req")
