"""A synthetic GGUF with Qwen3-30B-A3B's layer shapes (hidden 2048, 128 experts top-8 of width 768, 32 query / 4 K/V
heads of 128, q/k norms), layers cut to --layers, random blocks in the Q4_K_M mix (experts' gate/up and attention
Q4_K, experts' down and V Q6_K, the table and head Q6_K; router and norms F32), the tiny byte-level BPE vocabulary
(so the head costs nothing next to the layers: the real 151,936-row head is not in these numbers). Measures with the
plan `auto` picks (faithful): the forward time by width (1 = a plain decode step, k + 1 = verifying k guesses)
after a --context-token prompt, and how many distinct experts each width's rows touch per layer (the union a
verification step reads). Random routers route close to uniformly, so the union here is an upper end: a real
model's routing of consecutive tokens overlaps more. Not a test.

    .venv/bin/python scripts/moe_shapes.py --layers 4 --rounds 5
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.tiny_checkpoints: the writer's helpers

QWEN3_30B_A3B = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, moe_intermediate=768,
                     intermediate=6144)


def write_gguf(path: Path, layers: int, seed: int = 0) -> None:
    import gguf

    from tests.tiny_checkpoints import TINY_CHAT_TEMPLATE, TINY_SPECIAL_TOKENS, _random_blocks, _train_tiny_bpe

    d = QWEN3_30B_A3B
    tokens, merges = _train_tiny_bpe()
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name("synthetic Qwen3-30B-A3B shapes")
    w.add_block_count(layers)
    w.add_context_length(40960)
    w.add_embedding_length(d["hidden"])
    w.add_feed_forward_length(d["intermediate"])
    w.add_head_count(d["heads"])
    w.add_head_count_kv(d["kv_heads"])
    w.add_key_length(d["head_dim"])
    w.add_value_length(d["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    w.add_expert_count(d["experts"])
    w.add_expert_used_count(d["top_k"])
    w.add_expert_feed_forward_length(d["moe_intermediate"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in TINY_SPECIAL_TOKENS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(TINY_CHAT_TEMPLATE)
    H, E, I, V = d["hidden"], d["experts"], d["moe_intermediate"], len(tokens)
    q, kv = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]

    def blocks(kind: str, *shape: int) -> None:  # shape [..., N, K]
        *lead, N, K = shape
        out = np.stack([_random_blocks(kind, N, K, rng) for _ in range(int(np.prod(lead or [1])))])
        return out.reshape(*lead, N, -1), getattr(gguf.GGMLQuantizationType, kind)

    def add(name: str, kind: str, *shape: int) -> None:
        if kind == "F32":
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            return
        data, qtype = blocks(kind, *shape)
        w.add_tensor(name, data if len(shape) > 2 else data.reshape(shape[0], -1), raw_dtype=qtype)

    add("token_embd.weight", "Q6_K", V, H)
    add("output_norm.weight", "F32", H)
    add("output.weight", "Q6_K", V, H)
    for i in range(layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", "F32", H)
        add(p + "attn_q.weight", "Q4_K", q, H)
        add(p + "attn_k.weight", "Q4_K", kv, H)
        add(p + "attn_v.weight", "Q6_K", kv, H)
        add(p + "attn_output.weight", "Q4_K", H, q)
        add(p + "attn_q_norm.weight", "F32", d["head_dim"])
        add(p + "attn_k_norm.weight", "F32", d["head_dim"])
        add(p + "ffn_norm.weight", "F32", H)
        w.add_tensor(p + "ffn_gate_inp.weight", (0.05 * rng.standard_normal((E, H))).astype(np.float32))
        add(p + "ffn_gate_exps.weight", "Q4_K", E, I, H)
        add(p + "ffn_up_exps.weight", "Q4_K", E, I, H)
        add(p + "ffn_down_exps.weight", "Q6_K", E, H, I)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def measure(model, widths: list[int], context: int, repeats: int, rounds: int, clock=time.perf_counter) -> list[dict]:
    from draftwise.kv_cache import KVCache

    c = model.config
    V = c.vocab_size
    g = torch.Generator().manual_seed(0)
    warm = max(context, 256)  # a prompt long enough to touch every expert once (mapped pages faulted in)
    cache = KVCache(c.num_layers, 1, c.num_kv_heads, warm + max(widths) + 1, c.head_dim, model.dtype)
    slot = torch.tensor([0])
    times = {w: [] for w in widths}
    union = {w: [] for w in widths}
    with torch.inference_mode():
        prompt = torch.randint(3, V, (1, warm), generator=g)
        model(prompt, torch.arange(warm)[None], cache, slot, num_tokens=[warm])
        cache.truncate(0, context)
        for _ in range(rounds):
            for w in widths:
                samples = []
                for _ in range(repeats):
                    ids = torch.randint(3, V, (1, w), generator=g)
                    t0 = clock()
                    model(ids, torch.arange(context, context + w)[None], cache, slot, num_tokens=[w], last_only=True)
                    samples.append(clock() - t0)
                    cache.truncate(0, context)
                    union[w].append(statistics.mean(model.experts_touched()))
                times[w].append(statistics.median(samples))
    one = statistics.median(times[widths[0]])
    return [{"width": w, "ms": 1e3 * statistics.median(times[w]), "x_one": statistics.median(times[w]) / one,
             "experts_per_layer": statistics.mean(union[w])} for w in widths]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--path", default="/tmp/qwen3-30b-a3b-shapes.gguf")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: the calling thread's CPU time (with --threads 1 every kernel runs on it; time "
                         "spent descheduled by other processes counts for no width)")
    ap.add_argument("--loop", action="store_true", help="the Python loop over experts (SparseMoE.grouped = False) "
                    "instead of the grouped C++ call, to compare")
    args = ap.parse_args()
    if args.loop:
        from draftwise.models.transformer import SparseMoE

        SparseMoE.grouped = False
    if args.threads:
        torch.set_num_threads(args.threads)
    path = Path(args.path)
    if not path.exists():
        t0 = time.perf_counter()
        write_gguf(path, args.layers)
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s")
    from draftwise.api import load_model

    t0 = time.perf_counter()
    model, _, _ = load_model(str(path), weights="auto", cache_dir=args.cache_dir)
    print(f"loaded in {time.perf_counter() - t0:.0f} s: {model.plan.describe()}")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    rows = measure(model, list(range(1, 10)), args.context, args.repeats, args.rounds, clock)
    print(f"threads {torch.get_num_threads()}, {args.clock} clock, context {args.context}, median of {args.rounds} "
          f"rounds x {args.repeats}")
    print(f"| width | ms / forward ({model.config.num_layers} layers) | x width 1 | experts touched per layer |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['width']} | {r['ms']:.1f} | {r['x_one']:.2f} | {r['experts_per_layer']:.1f} |")
    print(f"decode (width 1): {1e3 / rows[0]['ms']:.2f} forwards/s over {model.config.num_layers} layers "
          f"(~{1e3 / rows[0]['ms'] * model.config.num_layers / 48:.2f} tok/s scaled to 48 layers, head excluded)")


if __name__ == "__main__":
    main()
