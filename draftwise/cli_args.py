"""Command-line arguments shared by the sub-commands: model/engine flags, sampling flags, and the two
conversions argparse values → `api.LLM` and → `SamplingParams`.

Owns flag names, defaults and help text; imports nothing from the sub-command modules (they import this).
Catalog defaults come from models/catalog.py; the work itself lives in the modules each command calls.
"""
from __future__ import annotations

import argparse

from draftwise.config import DTYPE_CHOICES, SIZE_HELP, ConfigError, check_weights, parse_kv_cache_memory
from draftwise.config import parse_size as config_parse_size
from draftwise.models.catalog import DEFAULT_TARGET


def int_list(s: str) -> list[int]:
    """'2,4,6' -> [2, 4, 6], or a ConfigError naming the value."""
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"expected comma-separated integers, got {s!r}") from None


def k_list(s: str) -> list[int | str]:
    """--num-speculative-tokens: '2,4,auto' -> [2, 4, 'auto'] ('auto': the cost-model policy), or a ConfigError."""
    parts = [x.strip() for x in s.split(",") if x.strip()]
    try:
        return [x if x == "auto" else int(x) for x in parts]
    except ValueError:
        raise ConfigError(f"expected comma-separated integers or 'auto', got {s!r}") from None


# byte sizes on the command line (--memory-limit, --kv-cache-memory; config.parse_size): a binary unit (KiB, MiB, GiB, TiB), a decimal
# one (KB, MB, GB, TB), or a bare K / M / G / T, which is BINARY (8G = 8 GiB = 8589934592 bytes, as in docker, free
# and ulimit); no unit: bytes. Case and spaces do not matter.
class ByteSize(int):
    """A size parsed from the command line: bytes, remembering the text it came from (the startup log shows
    both)."""

    text: str = ""

    def describe(self) -> str:
        return f"{self.text} = {int(self)} bytes ({int(self) / 2**30:.2f} GiB)"


def parse_size(text: str | int, flag: str = "size") -> ByteSize:
    """config.parse_size's bytes as a ByteSize that remembers the text (the startup log shows both)."""
    size = ByteSize(config_parse_size(text, flag))
    size.text = str(text).strip()
    return size


def kv_cache_memory_value(text: str | int | float | None) -> int | float | None:
    """--kv-cache-memory: config.parse_kv_cache_memory's bytes (as a ByteSize) or fraction of the RAM available;
    None stays None (the default budget)."""
    if text is None or isinstance(text, (int, float)):
        return text
    value = parse_kv_cache_memory(text, "--kv-cache-memory")
    return parse_size(text, "--kv-cache-memory") if isinstance(value, int) else value


def arg_type(convert):
    """An argparse `type` from a converter that raises ConfigError (argparse prints its message)."""
    def arg(text: str):
        try:
            return convert(text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    arg.__name__ = convert.__name__
    return arg


def weights_arg(text: str) -> str:
    """argparse type of --weights / --draft-weights: config.check_weights, its message as argparse's error."""
    try:
        return check_weights(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_model_args(p: argparse.ArgumentParser, speculative: bool = True) -> None:
    p.add_argument("--model", default=DEFAULT_TARGET, help="catalog name, .gguf file, HF checkpoint dir or hub id")
    p.add_argument("--dtype", default="auto", choices=list(DTYPE_CHOICES),
                   help="activation dtype; auto: what the chosen kernels want (float32 for q4x8)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    from draftwise.kernels.plan import weights_help

    p.add_argument("--weights", default="auto", type=weights_arg,
                   help="the linear layers' kernels (kernels/plan.py): " + weights_help().replace("%", "%%") +
                        "; `draftwise kernels` shows auto's table")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-thread-guard", dest="thread_guard", action="store_false",
                   help="keep --threads even while other processes hold cores (default: fewer threads then, "
                        "where the kernel plan is row-exact and results cannot change)")
    p.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", default=None,
                   action=argparse.BooleanOptionalAction,
                   help="reuse the K/V of a prompt's longest prefix seen before (default: on where it changes no "
                        "token: a row-exact kernel plan, e.g. q4x8 for every width with our attention op)")
    p.add_argument("--kv-cache-memory", default=None, type=arg_type(kv_cache_memory_value),
                   help="K/V pool budget: a size (2GiB, 512MiB, 2GB; " + SIZE_HELP + ") or a fraction of available "
                        "RAM (e.g. 0.25); paged, so memory is used only as tokens are held (default 4GiB; a draft "
                        "model's pool holds the same tokens)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="K/V storage; auto: bfloat16 where our fused CPU kernels run (float32 activations: our "
                        "attention widens it exactly, fp32 accumulation; half the K/V memory), else the activation "
                        "dtype (config.auto_kv_cache_dtype)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="engine seed (requests without their own seed derive from it)")
    if speculative:
        p.add_argument("--speculative-config", default=None,
                       help='vLLM-style JSON, e.g. \'{"method":"ngram","num_speculative_tokens":5}\'')


def llm_from_args(args, **overrides):
    from draftwise.api import LLM

    kw = dict(model=args.model, dtype=args.dtype, device=args.device, weights=args.weights, threads=args.threads,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, seed=args.seed,
              speculative_config=getattr(args, "speculative_config", None),
              thread_guard=getattr(args, "thread_guard", True),
              enable_prefix_caching=getattr(args, "enable_prefix_caching", None),
              kv_cache_memory=getattr(args, "kv_cache_memory", None),
              kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
    kw.update(overrides)
    return LLM(**kw)


def plan_lines(llm) -> list[str]:
    """The load log's kernel lines: each loaded model's plan (KernelPlan.describe: kernels, source, when and
    under what load auto timed them, provisional), then the K/V cache (dtype, as auto picked it; pool; context)."""
    lines = [f"draftwise: {role} {info['plan']['summary']}" for role, info in
             (("target", llm.model_info), ("draft", llm.draft_info)) if info and info.get("plan")]
    cache = llm.engine.cache
    return lines + [f"draftwise: K/V {str(cache.keys[0].dtype).removeprefix('torch.')} "
                    f"(--kv-cache-dtype {llm.config.kv_cache_dtype}), pool {cache.num_blocks} blocks of "
                    f"{cache.block_size} tokens ({cache.nbytes / 2**30:.2f} GiB, used as tokens are held), "
                    f"context {llm.max_model_len}"]


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--request-seed", dest="request_seed", type=int, default=None,
                   help="per-request sampling seed (default: derived from --seed)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def sampling_from_args(args):
    from draftwise.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.request_seed, stop=args.stop,
                          ignore_eos=args.ignore_eos)
