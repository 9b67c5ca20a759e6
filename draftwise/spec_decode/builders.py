"""Which proposer a `--speculative-config` method builds: one explicit table, method name → builder.

Owns the ProposerContext (the slice of the engine's world a builder may use) and `build_proposer`. Each
builder receives the parsed SpecConfig and the context and returns a Proposer; loading a draft model goes
through the context's `load_draft`, so this module never touches checkpoints itself. Knows nothing of the
engine's scheduling or of how k is chosen.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from draftwise.config import DRAFT_P_MIN, ConfigError, SpecConfig
from draftwise.kv_cache import draft_cache_capacity, draft_pool_blocks, kv_dtype
from draftwise.prefix_cache import PrefixCache
from draftwise.spec_decode.draft_model import DraftModelProposer, check_compatible
from draftwise.spec_decode.grammar import GrammarProposer
from draftwise.spec_decode.ngram import NgramProposer
from draftwise.spec_decode.proposer import NoProposer, Proposer
from draftwise.spec_decode.suffix import SuffixProposer


@dataclass
class ProposerContext:
    """What a proposer builder may need from the engine's world: a slice, not the whole engine config."""

    target_name: str
    target_vocab_size: int
    target_tokenizer: object
    max_num_seqs: int
    max_model_len: int
    k_max: int  # the engine's cap on guesses per step (sizes the draft's cache)
    dtype: str
    # (name, dtype, weights) -> (Decoder, Tokenizer, info dict); None when drafts cannot be loaded
    load_draft: Callable[[str, str, str | None], tuple] | None = None
    # the caller's cached builder (a composite method reuses the proposer its part already has); None = build
    proposer_for: Callable[[SpecConfig], Proposer] | None = None
    prefix_caching: bool | None = None  # a draft model's own prefix cache: on / off / None = where it is exact
    kv_cache_blocks: int | None = None  # the target's K/V pool (blocks); a draft's pool follows it. None: full
    kv_cache_dtype: str = "auto"  # config.KV_CACHE_DTYPES, resolved per draft model (kv_cache.kv_dtype)


def _build_none(spec_config: SpecConfig, ctx: ProposerContext) -> Proposer:
    return NoProposer()


def _build_ngram(spec_config: SpecConfig, ctx: ProposerContext) -> Proposer:
    return NgramProposer(spec_config.prompt_lookup_min, spec_config.prompt_lookup_max)


def _build_draft_model(spec_config: SpecConfig, ctx: ProposerContext) -> Proposer:
    if ctx.load_draft is None:
        raise ConfigError("method draft_model needs a way to load the draft model")
    model, tok, info = ctx.load_draft(spec_config.model, spec_config.draft_dtype or ctx.dtype, spec_config.draft_weights)
    if ctx.target_tokenizer is not None and tok is not None:
        check_compatible(ctx.target_tokenizer, tok, ctx.target_name, spec_config.model)
    capacity = draft_cache_capacity(ctx.max_model_len, ctx.k_max)
    # a trimmed head keeps every id that ends a turn: the tokenizer's and the checkpoint config's EOS ids
    eos = (*(getattr(tok, "eos_token_ids", None) or ()), *model.config.eos_token_ids)
    prefix = ctx.prefix_caching
    if prefix is None:  # exact only: a sampled request's tokens depend on the draft's q, which must not move
        prefix = model.plan.row_exact
    blocks = None if ctx.kv_cache_blocks is None else draft_pool_blocks(ctx.kv_cache_blocks, ctx.max_num_seqs, capacity)
    return DraftModelProposer(model, ctx.max_num_seqs, capacity, ctx.target_vocab_size,
                              draft_vocab_size=spec_config.draft_vocab_size, eos_token_ids=eos,
                              prefix_cache=PrefixCache() if prefix else None, num_blocks=blocks,
                              kv_cache_dtype=kv_dtype(ctx.kv_cache_dtype, model.dtype, getattr(model, "fused", False)),
                              min_guess_prob=DRAFT_P_MIN if spec_config.draft_p_min is None else spec_config.draft_p_min)


def _build_grammar(spec_config: SpecConfig, ctx: ProposerContext) -> Proposer:
    """The grammar's forced tokens first, then `spec.then` (ngram / draft_model) fills the rest of k."""
    if spec_config.then is None:
        return GrammarProposer()
    then = ctx.proposer_for(spec_config.then) if ctx.proposer_for is not None else build_proposer(spec_config.then, ctx)
    return GrammarProposer(then)


def _build_suffix(spec_config: SpecConfig, ctx: ProposerContext) -> Proposer:
    return SuffixProposer(spec_config.suffix_decoding_max_tree_depth, spec_config.suffix_decoding_max_cached_requests,
                          spec_config.suffix_decoding_max_spec_factor, spec_config.suffix_decoding_min_token_prob,
                          spec_config.suffix_cache_max_bytes, tree=spec_config.suffix_tree)


PROPOSER_BUILDERS: dict[str, Callable[[SpecConfig, ProposerContext], Proposer]] = {
    "none": _build_none,
    "ngram": _build_ngram,
    "draft_model": _build_draft_model,
    "grammar": _build_grammar,
    "suffix": _build_suffix,
}


def build_proposer(spec_config: SpecConfig, ctx: ProposerContext) -> Proposer:
    if spec_config.method not in PROPOSER_BUILDERS:
        raise ConfigError(f"no proposer for method {spec_config.method!r}; known: {sorted(PROPOSER_BUILDERS)}")
    return PROPOSER_BUILDERS[spec_config.method](spec_config, ctx)
