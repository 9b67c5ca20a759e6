"""One decoder-only transformer for the llama, mistral, qwen2, qwen3 and gemma3 families and the mixture-of-experts
qwen2_moe, qwen3_moe, mixtral and olmoe (its q/k norms over the whole projection).

Families differ only by ModelConfig fields (qkv bias, q/k norm, sandwich norms and norm weight offset,
embedding scale, activation, attention scale, sliding-window layers with their own RoPE base, tied
embeddings, experts: a sparse layer's MLP is a SparseMoE, a router over expert MLPs and qwen2_moe's gated shared
expert); there is no per-family copy of the forward pass. Experts are ordinary MLPs under transformers'
checkpoint names (`mlp.experts.{e}.gate_proj`), so each expert's linears are built, merged and mapped like any other
linear. Parameter names equal HF transformers' names
so a checkpoint's tensors load as they are. After loading, `merge_projections` puts each layer's q/k/v and
gate/up into one module each where that is bitwise the separate calls (kernels/linear.py, merge: q4x8),
and `use_fused_glue` routes the glue between the matmuls (RMSNorm, residual add + norm, q/k norm + RoPE + the
K/V cache write, act(gate) * up, a step's router logits) through kernels/glue.py's C++ ops for float32 on CPU;
the torch code here is their reference and what other dtypes and devices run. Both keep the decoder row-exact. Where every layer
qualifies (q4x8 / q6k / q8_0 projections, gate/up merged, fused glue, our attention op, no sandwich norms; mixture
layers grouped, in calls of at most Router.FUSED_MAX_ROWS rows), `forward` runs all layers in
one C++ call (kernels/stack.py: the same ops in the same order, bitwise this file's loop; `Decoder.stack = False`
keeps the loop).

Contract (docs/ARCHITECTURE.md): forward(token_ids[B,T], positions[B,T], cache, slots[B]) -> logits[B,T,V].
The forward reserves the cache blocks its positions need (kv_cache.CacheFull when the pool is short), writes K/V
at `positions` through each slot's block table and extends each slot's length to max(position)+1 (with
`num_tokens`: to its last real token + 1; padding rows go to the cache's null block);
rollback is the caller's `cache.truncate`. Knows nothing about requests, sampling or speculation.
With `num_tokens` (every engine call: prefill, decode, verification) attention is row-exact: `Attention._attend_exact`,
one C++ call per layer (kernels/attention.py) or, without it, one SDPA call per query of a short chunk.
"""
from __future__ import annotations

import math
from typing import Iterable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from draftwise.config import ModelConfig
from draftwise.kernels import attention as attention_op
from draftwise.kernels import experts as experts_op
from draftwise.kernels import glue
from draftwise.kernels import stack as stack_op
from draftwise.kernels import linear
from draftwise.kernels.plan import KernelPlan, default_plan
from draftwise.kv_cache import KVCache


class RMSNorm(nn.Module):
    fused = False  # Decoder.use_fused_glue: one C++ call (kernels/glue.py) instead of the torch reference below

    def __init__(self, dim: int, eps: float, weight_offset: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if weight_offset else torch.ones(dim))
        self.eps = float(eps)
        self.weight_offset = float(weight_offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if self.fused:
            return glue.rms_norm(x, self.weight, self.eps, self.weight_offset)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:  # gemma: computed in float32, scaled by (1 + w)
            return (xf * (self.weight_offset + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:  # [head_dim/2]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in ("default", None):
        return inv_freq
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":  # Llama 3.1 frequency-dependent scaling (Meta's reference recipe)
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


ROW_EXACT_MAX_TOKENS = 16  # without our attention op: chunks up to this many tokens attend one query at a time


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    fused = False  # Decoder.use_fused_glue: q/k norm + RoPE + the K/V write in one C++ call; rope [B * T, D / 2]

    def __init__(self, cfg: ModelConfig, layer_type: str):
        super().__init__()
        hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.q_proj = nn.Linear(cfg.hidden_size, nh * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, nkv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, nkv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(nh * hd, cfg.hidden_size, bias=False)
        if cfg.qk_norm or cfg.qk_norm_full:  # per head [head_dim], or (olmoe) over the whole projection
            self.q_norm = RMSNorm(nh * hd if cfg.qk_norm_full else hd, cfg.rms_norm_eps, cfg.norm_weight_offset)
            self.k_norm = RMSNorm(nkv * hd if cfg.qk_norm_full else hd, cfg.rms_norm_eps, cfg.norm_weight_offset)
        self.qk_norm = cfg.qk_norm and not cfg.qk_norm_full  # the per-head norm (in the fused call where fused)
        self.qk_norm_full = cfg.qk_norm_full
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.scale = (cfg.query_pre_attn_scalar or hd) ** -0.5
        self.sliding = layer_type == "sliding_attention"
        self.window = cfg.sliding_window if self.sliding else None
        self.qkv_proj = None  # q | k | v in one module once merge_projections found an exact merge
        self.qkv_sizes = (nh * hd, nkv * hd, nkv * hd)

    def merge_projections(self, merge) -> bool:
        """Replace q_proj, k_proj, v_proj with merge([q, k, v]) (one call, its output split into views) unless
        that is None (no exact merge: the separate calls stay)."""
        if self.qkv_proj is not None or (merged := merge([self.q_proj, self.k_proj, self.v_proj])) is None:
            return False
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = merged
        return True

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [B, 1, T, head_dim] (fused: [B * T, head_dim / 2])
        mask: torch.Tensor | None,  # [B, 1, T, kv_len] bool, True = attend
        cache: KVCache,
        layer: int,
        tables: torch.Tensor,  # [B, nb] int64: each sequence's block-table row (KVCache.table)
        positions: torch.Tensor,  # [B, T]
        kv_len: int,
        num_tokens: list[int] | None = None,  # real (unpadded) tokens per row: the row-exact path
        ancestors: torch.Tensor | None = None,  # [B, T] int64 token-tree masks (Decoder.forward), with num_tokens
    ) -> torch.Tensor:  # [B, T, hidden]
        B, T, _ = x.shape
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)  # views of one [B, T, Nq + 2 Nkv] output
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm_full:  # olmoe: each row's whole q and k normalised before they are cut into heads
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        if self.fused:  # one C++ call: q/k norm, RoPE, K/V into the cache (float32 / bfloat16) as KVCache.write does;
            # bitwise the reference below up to the q/k norm's summation (kernels/glue.py)
            qn, kn = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
            eps, off = (self.q_norm.eps, self.q_norm.weight_offset) if self.qk_norm else (0.0, 0.0)
            q = glue.rope_qk_cache(q, k, v, cos, sin, self.head_dim, qn, kn, eps, off, cache.keys[layer],
                                   cache.values[layer], tables, positions)
            q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        else:
            v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q = q.view(B, T, self.num_heads, self.head_dim)
            k = k.view(B, T, self.num_kv_heads, self.head_dim)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, D]
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            cache.write(layer, tables, positions, k, v)
        if num_tokens is None:
            keys, values = cache.read(layer, tables, kv_len, q.dtype)  # [B, H_kv, kv_len, D]
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads
            )
        else:
            out = self._attend_exact(q, cache, layer, tables, positions, num_tokens, ancestors)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def _attend_exact(self, q: torch.Tensor, cache: KVCache, layer: int, tables: torch.Tensor,  # q [B, H, T, D]
                      positions: torch.Tensor, num_tokens: list[int],
                      ancestors: torch.Tensor | None = None) -> torch.Tensor:  # ancestors [B, T]; -> [B, H, T, D]
        """Attention whose result for a token does not depend on what else is in the batch, nor on how its
        sequence was cut into forwards. Each sequence is attended on its own, over exactly its keys (no padding).
        With our C++ op (kernels/attention.py: each query a fixed float sequence over exactly its keys, read from
        the cache in place; built, and the dtype float32 / bfloat16) every query of every chunk goes through ONE
        call: k + 1 verified rows equal k + 1 single steps bit for bit, and a prompt prefilled after a cached
        prefix (or in chunks) equals the prompt prefilled whole — with row-exact linear kernels, greedy
        speculation equals plain decoding and the prefix cache changes no token, even where int8 activations
        would amplify the last-bit differences of differently shaped matmuls. (The op is also faster than
        masked SDPA at prompt lengths: docs/PERFORMANCE.md, attention.)
        Without it: chunks of up to ROW_EXACT_MAX_TOKENS tokens (decode, verification) one SDPA call per query,
        equally row-exact; longer chunks (prompts) one causal call.
        With `ancestors` (a token tree): each row attends the keys before the chunk, then its ancestors' rows in the
        chunk (kernels/attention.py attend_tree, or one SDPA call per row over exactly that key list), so a node's
        result is bitwise its path's chain forward's."""
        if ancestors is not None:
            return self._attend_tree(q, cache, layer, tables, positions, num_tokens, ancestors)
        if attention_op.usable(q, cache.keys[layer]):
            return attention_op.attend_rows(q, cache.keys[layer], cache.values[layer], tables, positions, num_tokens,
                                            self.scale, self.window)  # padding rows: zero
        out = torch.zeros_like(q)
        gqa = self.num_kv_heads != self.num_heads
        for b, n in enumerate(num_tokens):
            if n == 0:
                continue
            first = int(positions[b, 0])
            keys, values = cache.read(layer, tables[b : b + 1], first + n, q.dtype)  # [1, H_kv, first + n, D]
            if n <= ROW_EXACT_MAX_TOKENS:
                for t in range(n):
                    end = first + t + 1
                    start = max(0, end - self.window) if self.window else 0
                    out[b : b + 1, :, t : t + 1] = F.scaled_dot_product_attention(
                        q[b : b + 1, :, t : t + 1], keys[:, :, start:end], values[:, :, start:end], scale=self.scale,
                        enable_gqa=gqa)
                continue
            key_pos = torch.arange(first + n, device=q.device)
            q_pos = positions[b, :n, None]  # [n, 1]
            mask = key_pos <= q_pos
            if self.window:
                mask = mask & (key_pos > q_pos - self.window)
            out[b : b + 1, :, :n] = F.scaled_dot_product_attention(
                q[b : b + 1, :, :n], keys, values, attn_mask=mask[None, None], scale=self.scale, enable_gqa=gqa)
        return out

    def _attend_tree(self, q: torch.Tensor, cache: KVCache, layer: int, tables: torch.Tensor,  # q [B, H, T, D]
                     positions: torch.Tensor, num_tokens: list[int],
                     ancestors: torch.Tensor) -> torch.Tensor:  # ancestors [B, T] int64; -> [B, H, T, D]
        if attention_op.usable(q, cache.keys[layer]):
            return attention_op.attend_tree(q, cache.keys[layer], cache.values[layer], tables, positions, num_tokens,
                                            ancestors, self.scale, self.window)
        out = torch.zeros_like(q)
        masks = ancestors.tolist()
        for b, n in enumerate(num_tokens):
            first = int(positions[b, 0])
            keys, values = cache.read(layer, tables[b : b + 1], first + n, q.dtype)  # [1, H_kv, first + n, D]
            for t in range(n):
                index = list(range(first)) + [first + i for i in range(t + 1) if masks[b][t] >> i & 1]
                if self.window:
                    index = index[-self.window:]
                index = torch.tensor(index, device=q.device)
                out[b : b + 1, :, t : t + 1] = F.scaled_dot_product_attention(
                    q[b : b + 1, :, t : t + 1], keys[:, :, index], values[:, :, index], scale=self.scale,
                    enable_gqa=self.num_kv_heads != self.num_heads)
        return out


class MLP(nn.Module):
    fused = False  # Decoder.use_fused_glue: act(gate) * up in one C++ call (glue.GLU_TOLERANCE for silu)

    def __init__(self, cfg: ModelConfig, intermediate: int | None = None):  # default: cfg.intermediate_size
        super().__init__()
        intermediate = intermediate or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, cfg.hidden_size, bias=False)
        self.gate_up_proj = None  # gate | up in one module once merge_projections found an exact merge
        self.intermediate = intermediate
        if cfg.hidden_act == "silu":
            self.act, self.act_name = F.silu, "silu"
        elif cfg.hidden_act in ("gelu_pytorch_tanh", "gelu_tanh"):
            self.act, self.act_name = (lambda t: F.gelu(t, approximate="tanh")), "gelu_tanh"
        else:
            raise ValueError(f"unsupported activation {cfg.hidden_act!r}")

    def merge_projections(self, merge) -> bool:
        """Replace gate_proj and up_proj with merge([gate, up]) unless that is None (as Attention's)."""
        if self.gate_up_proj is not None or (merged := merge([self.gate_proj, self.up_proj])) is None:
            return False
        del self.gate_proj, self.up_proj
        self.gate_up_proj = merged
        return True

    def forward(self, x: torch.Tensor, tokens: int | None = None) -> torch.Tensor:  # x [..., hidden] -> [..., hidden]
        """`tokens`: the call's tokens per sequence, where x's shape does not say it (an expert's rows [n, hidden]:
        a split linear picks its step or prefill kernel by it, never by how many rows the expert got)."""
        run = (lambda m, t: m(t)) if tokens is None else (lambda m, t: _for_tokens(m, tokens)(t))  # noqa: E731
        if self.gate_up_proj is not None:
            gu = run(self.gate_up_proj, x)  # [..., 2 I]: gate | up
            if self.fused:
                return run(self.down_proj, glue.glu(gu, None, self.act_name))
            g, u = gu.split(self.intermediate, dim=-1)
        else:
            g, u = run(self.gate_proj, x), run(self.up_proj, x)
            if self.fused:
                return run(self.down_proj, glue.glu(g, u, self.act_name))
        return run(self.down_proj, self.act(g) * u)


class Router(nn.Module):
    """A mixture's router (weight [experts, hidden]: llama.cpp's ffn_gate_inp) or a shared expert's gate
    ([1, hidden]). Not an nn.Linear, so no plan swaps it for a quantized kernel (llama.cpp keeps ffn_gate_inp in
    F32 too). forward(x [M, hidden]) -> logits [M, out] float64: the float32 values multiplied in float64 (every
    product exact) and summed there; rounded to float32 (the router) or through the sigmoid first (the shared
    gate), a value is the float32 nearest the exact result unless that lies within ~1e-16 of a rounding boundary,
    so a row's routing does not depend on the rows beside it (a float32 GEMM's blocking may change with the row
    count, an elementwise sigmoid rounds its vectorised body and its scalar tail differently, and the last bit of
    a logit can move a top-k choice).
    Fused (Decoder.use_fused_glue), a call of at most FUSED_MAX_ROWS rows (a decode or verification step) runs
    kernels/glue.py's router_logits instead: the same exact products, summed in one fixed order for any row count
    and thread split, read from the float32 weight (half the bytes of the float64 copy, which a step streams
    every layer); longer calls (prompts) keep the float64 matmul (their value differs from the op's only in the
    summation order, below the float32 rounding as above)."""

    fused = False  # Decoder.use_fused_glue: few-row calls through the C++ router_logits
    FUSED_MAX_ROWS = 16

    def __init__(self, out: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out, dim))
        self._weight64: torch.Tensor | None = None  # float64 copy of weight, made at the first unfused call

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [M, hidden] -> [M, out] float64
        if self.fused and x.shape[0] <= self.FUSED_MAX_ROWS and x.dtype == torch.float32:
            return glue.router_logits(x, self.weight)
        w = self._weight64
        if w is None or w.device != self.weight.device:
            w = self._weight64 = self.weight.detach().to(torch.float64)
        return F.linear(x.to(torch.float64), w)


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP (qwen2_moe, qwen3_moe, mixtral; transformers' names: `gate` the router, `experts.{e}`
    MLPs, qwen2_moe's `shared_expert` and `shared_expert_gate`). Routing is transformers': softmax over the router's
    logits in float32, the num_experts_per_tok largest probabilities, divided by their sum where norm_topk_prob
    (mixtral always). Dispatch: the selected (row, expert) pairs grouped by expert, each expert's MLP run once over
    its rows, each product scaled by its routing weight into its own slot [M, k, hidden]; a row then sums its k
    slots in ascending expert order (transformers adds the experts' outputs in that order), then the shared
    expert's sigmoid-gated output. A row's result is a function of that row alone (row-exact, with row-exact
    expert linears): which other rows share its experts changes no bit of it. Where the experts qualify
    (kernels/experts.py `grouped`: merged gate/up and down of the table's block kernels, fused glue) the dispatch
    is one C++ call per layer (csrc/experts.cpp: each routed expert's kernels once over all its rows, the wide
    kernels for a prompt's rows), bitwise the loop below (`SparseMoE.grouped = False` keeps the loop). A step of at
    most Router.FUSED_MAX_ROWS rows runs the grouped path's same ops inside the one-call layer loop
    (Decoder._stack_weights: kernels/stack.py), which hands back each layer's experts for `touched`."""

    grouped = True  # False: always the Python loop over experts (tests compare the two)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg.num_experts, cfg.hidden_size)
        self.experts = nn.ModuleList(MLP(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.shared = bool(cfg.shared_expert_intermediate_size)
        if self.shared:
            self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Router(1, cfg.hidden_size)
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob or cfg.architecture == "mixtral"
        self._touched = 0  # distinct experts the last call ran (the weights it read): Decoder.experts_touched
        self._last: torch.Tensor | None = None  # the last call's experts [M, k] (touched counted when asked)
        self._experts_op: object | None = None  # kernels/experts.py's handle over the experts' buffers
        self._experts_key: tuple | None = None  # the expert modules it was built over (rebuilt when they change)

    @property
    def touched(self) -> int:
        """Distinct experts the last forward ran (the expert weights it read)."""
        if self._last is not None:
            self._touched, self._last = int(torch.unique(self._last).numel()), None
        return self._touched

    def _grouped_op(self) -> object | None:
        """The grouped-experts handle over the current expert modules, or None where they do not qualify."""
        # a plan swaps every expert's modules, and kernels/hugepages.py every buffer: the ends tell (cheaply: read
        # every forward of the Python loop, so through the modules' dicts, not ModuleList's indexing)
        experts = self.experts._modules
        ends = (experts["0"], experts[str(len(experts) - 1)])
        key = tuple((m.fused, _first_buffer(m._modules.get("gate_up_proj")), _first_buffer(m._modules["down_proj"]))
                    for m in ends)
        if key != self._experts_key:
            self._experts_op, self._experts_key = experts_op.grouped(list(self.experts)), key
        return self._experts_op

    def merge_projections(self, merge) -> bool:
        """Each expert's (and the shared expert's) gate/up into one module where `merge` can (MLP's)."""
        mlps = list(self.experts) + ([self.shared_expert] if self.shared else [])
        return sum(m.merge_projections(merge) for m in mlps) > 0

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x [M, hidden]
        """(experts [M, k] int64 in ascending order, weights [M, k] float32) of each row. Fused
        (Decoder.use_fused_glue), after the router: kernels/glue.py's route, one C++ call of the same steps (its
        float32 softmax within a few ulps of torch's), for any M."""
        logits = self.gate(x)  # [M, E] float64
        if self.gate.fused:
            return glue.route(logits, self.top_k, self.norm_topk_prob)
        probs = torch.softmax(logits.to(torch.float32), dim=-1)  # [M, E] float32, as transformers
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [M, k], largest first
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        experts, order = experts.sort(dim=-1)
        return experts, weights.gather(-1, order)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, hidden] -> [B, T, hidden]
        B, T, H = x.shape
        rows = x.reshape(B * T, H)  # [M, H]
        experts, weights = self.route(rows)  # [M, k]
        op = self._grouped_op() if self.grouped and rows.dtype == torch.float32 and rows.device.type == "cpu" else None
        if op is not None:
            self._last = experts
            out = experts_op.run(op, rows, experts, weights)  # [M, H]
            if self.shared:
                scale = torch.sigmoid(self.shared_expert_gate(rows)).to(x.dtype)  # [M, 1]
                out = out + scale * self.shared_expert(rows, tokens=T)
            return out.view(B, T, H)
        M, k = experts.shape
        slots = rows.new_empty(M * k, H)  # slot m * k + j: row m's j-th expert's weighted output
        flat = experts.reshape(-1)  # [M * k]
        by_expert = torch.argsort(flat, stable=True)  # slots grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        self._touched, self._last = self.num_experts - counts.count(0), None
        w = weights.reshape(-1, 1).to(x.dtype)  # [M * k, 1]
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            sel = by_expert[start:start + n]  # [n] slot indices, ascending
            start += n
            y = self.experts[e](rows.index_select(0, sel // k), tokens=T)  # [n, H]
            slots[sel] = y * w[sel]
        slots = slots.view(M, k, H)
        out = slots[:, 0]
        for j in range(1, k):
            out = out + slots[:, j]
        if self.shared:
            scale = torch.sigmoid(self.shared_expert_gate(rows)).to(x.dtype)  # [M, 1], in float64 first (Router)
            out = out + scale * self.shared_expert(rows, tokens=T)
        return out.view(B, T, H)


def _first_buffer(m: nn.Module | None) -> tuple[int, int]:
    """(the module's id, where its first buffer's data lies): what changes when a module or its buffers are swapped."""
    b = next(iter(m._buffers.values()), None) if m is not None else None
    return id(m), b.data_ptr() if b is not None else 0


def _for_tokens(m: nn.Module, tokens: int) -> nn.Module:
    """The module that runs `m` for a call with `tokens` tokens per sequence (a SplitLinear's half; else `m`)."""
    return m.module_for(tokens) if hasattr(type(m), "module_for") else m


class DecoderLayer(nn.Module):
    fused = False  # Decoder.use_fused_glue: the residual add and the pre-MLP norm in one C++ call

    def __init__(self, cfg: ModelConfig, layer_type: str, layer: int = 0):
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset)  # noqa: E731
        self.self_attn = Attention(cfg, layer_type)
        self.mlp = SparseMoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg)
        self.input_layernorm = norm()
        # HF naming: in llama/qwen "post_attention_layernorm" is the pre-MLP norm; gemma3 has four norms
        self.post_attention_layernorm = norm()
        self.sandwich = cfg.sandwich_norm
        if cfg.sandwich_norm:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(self, x, rope, mask, cache, layer, tables, positions, kv_len, num_tokens=None, ancestors=None):
        h = self.self_attn(self.input_layernorm(x), rope, mask, cache, layer, tables, positions, kv_len, num_tokens,
                           ancestors)
        if self.sandwich:
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if self.fused:
            norm = self.post_attention_layernorm
            x, h = glue.add_rms_norm(x, h, norm.weight, norm.eps, norm.weight_offset)
            return x + self.mlp(h)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t, i) for i, t in enumerate(cfg.layer_types))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset)


class Decoder(nn.Module):
    fused = False  # use_fused_glue: the per-layer glue through kernels/glue.py (from_tensors turns it on)
    stack = True  # False: never kernels/stack.py's one-call layer loop (tests compare it with the Python loop)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._rope_tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._angles_table: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # kind -> cos, sin [n, D/2]
        self.act_dtype: torch.dtype | None = None  # activations (and the KV cache); None: the embedding's dtype
        self._plan: KernelPlan | None = None  # the kernels it was built with (kernels/plan.py); None: its nn.Linears
        self._stack_built: dict[tuple, StackArgs | None] = {}  # _stack_for's lists by what they depend on

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_tensors(
        cls,
        cfg: ModelConfig,
        tensors: Iterable[tuple[str, torch.Tensor | nn.Module]],
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        embed_dtype: torch.dtype | None = None,
    ) -> "Decoder":
        """`tensors` yields (parameter name, tensor) or (linear module path, prepared module): a module built by
        models/quant.py (a kernel's packed weights) takes that nn.Linear's place with its weight and bias, and a
        prepared "model.embed_tokens" (e.g. q4x8's packed table) the embedding's; a
        prepared "lm_head" is used even when the embeddings are tied. `embed_dtype` (default `dtype`): the
        embedding table's storage dtype; looked-up rows are cast to `dtype`."""
        with torch.device("meta"):
            model = cls(cfg)
        params = dict(model.named_parameters())
        linears = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
        loaded = set()
        prepared_head = False
        for name, t in tensors:
            if isinstance(t, nn.Module):
                want = linears.get(name)
                if want is None:
                    raise ValueError(f"prepared module {name!r} has no linear or embedding layer to replace")
                if _dims(t) != _dims(want):
                    raise ValueError(f"{name}: prepared shape {_dims(t)} != expected {_dims(want)}")
                _set_module(model, name, t.to(device))
                loaded.update(p for p in (f"{name}.weight", f"{name}.bias") if p in params)
                prepared_head |= name == "lm_head"
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the {cfg.architecture} decoder")
            if tuple(t.shape) != tuple(params[name].shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != expected {tuple(params[name].shape)}")
            want_dtype = embed_dtype if embed_dtype is not None and name == "model.embed_tokens.weight" else dtype
            _set_param(model, name, t.to(device=device, dtype=want_dtype))
            loaded.add(name)
        if cfg.tie_word_embeddings and not prepared_head:
            model.lm_head.weight = model.model.embed_tokens.weight
            loaded.add("lm_head.weight")
        model.act_dtype = dtype
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        model._build_rope(device)
        model.merge_projections()
        model.use_fused_glue()
        return model.eval()

    @property
    def plan(self) -> KernelPlan:
        """The kernels this decoder was built with (api.load_model sets it); a decoder built from plain nn.Linear
        layers runs them dense in its dtype (kernels/plan.py default_plan)."""
        if self._plan is None:
            return default_plan("bfloat16" if self.dtype == torch.bfloat16 else "float32", self.device.type)
        return self._plan

    @plan.setter
    def plan(self, plan: KernelPlan) -> None:
        self._plan = plan

    def merge_projections(self, merge=linear.merge) -> int:
        """Each layer's q/k/v and gate/up into one module each where `merge` can (default: kernels/linear.py's
        merge, which merges only where the result is bitwise the separate calls': q4x8); returns how many were
        merged. from_tensors and quant.build_linears call it; parameter names stay HF's until then."""
        return sum(layer.self_attn.merge_projections(merge) + layer.mlp.merge_projections(merge)
                   for layer in self.model.layers)

    def use_fused_glue(self, enable: bool = True) -> bool:
        """Route the norms, RoPE (after the q/k norm) and the gated activation through kernels/glue.py's C++ ops,
        or (enable=False) back to the torch reference. On only for float32 activations on CPU where the library
        builds; returns whether it is on. The ops are row-exact; against the reference they differ only in the
        RMSNorm's summation (glue.NORM_TOLERANCE) and silu's exp (glue.GLU_TOLERANCE)."""
        on = bool(enable) and self.dtype == torch.float32 and self.device.type == "cpu" and glue.available()
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, MLP, DecoderLayer, Decoder, Router)):
                m.fused = on
        return on

    def experts_touched(self) -> list[int]:
        """Per sparse layer, how many distinct experts the last forward ran ([] for a dense model): what that
        forward read of the experts' weights. A verification's rows touch the union of their experts, so its cost
        grows with the union, not with its width alone (docs/ARCHITECTURE.md, mixtures of experts)."""
        return [layer.mlp.touched for layer in self.model.layers if isinstance(layer.mlp, SparseMoE)]

    def _build_rope(self, device) -> None:
        cfg = self.config
        for kind in set(cfg.layer_types):
            local = kind == "sliding_attention" and cfg.rope_local_theta is not None
            theta = cfg.rope_local_theta if local else cfg.rope_theta
            inv_freq = rope_inv_freq(cfg.head_dim, theta, None if local else cfg.rope_scaling)
            self._rope_tables[kind] = (inv_freq.to(device), None)

    def angles(self, kind: str, positions: torch.Tensor,
               kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [B * T, D/2] float32
        """Each position's RoPE cos / sin, looked up in a per-kind table that only ever grows: a position's row is
        computed once (float32 position * inv_freq, then cos / sin, as HF does) and never again, so its angles do
        not depend on the batch it is in (an elementwise cos over a tensor may round its vectorised body and its
        scalar tail differently). `kv_len`: max(positions) + 1 when the caller knows it."""
        cos, sin = self._angles_table.get(kind, (None, None))
        have = 0 if cos is None else cos.shape[0]
        need = int(positions.max()) + 1 if kv_len is None else kv_len
        if need > have:
            inv_freq = self._rope_tables[kind][0]  # [D/2]
            freqs = torch.arange(have, max(need, 2 * have, 256), device=inv_freq.device).float()[:, None] * inv_freq
            c, s = freqs.cos(), freqs.sin()
            cos, sin = (c, s) if cos is None else (torch.cat((cos, c)), torch.cat((sin, s)))
            self._angles_table[kind] = (cos, sin)
        index = positions.reshape(-1)
        return cos.index_select(0, index), sin.index_select(0, index)

    def rope_for(self, kind: str, positions: torch.Tensor, dtype,
                 kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [B, 1, T, D]
        B, T = positions.shape
        cos, sin = self.angles(kind, positions, kv_len)
        cos, sin = cos.view(B, T, -1), sin.view(B, T, -1)
        return torch.cat((cos, cos), dim=-1)[:, None].to(dtype), torch.cat((sin, sin), dim=-1)[:, None].to(dtype)

    @property
    def dtype(self) -> torch.dtype:  # of the activations and the KV cache
        return self.act_dtype or self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device  # (the embedding may be a prepared module without a `weight`)

    # ---- forward ------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor,  # [B, T] int64
        cache: KVCache,
        slots: torch.Tensor,  # [B] int64
        last_only: bool = False,
        logit_index: torch.Tensor | None = None,  # [B] or [B, J]: only these positions' logits per row
        num_tokens: list[int] | None = None,  # real tokens per row (the rest is padding): row-exact attention
        head: nn.Module | None = None,  # in place of lm_head: hidden [..., H] -> logits [..., V] (a draft's own)
        ancestors: torch.Tensor | None = None,  # [B, T] int64: a token tree (spec_decode/tree.py), with num_tokens
        rope_positions: torch.Tensor | None = None,  # [B, T] int64 RoPE positions of a tree (default: positions)
    ) -> torch.Tensor:  # [B, T, V] (or [B, 1, V] when last_only / logit_index [B] is given, [B, J, V] for [B, J])
        """A token tree: row t of sequence b is written to the cache at positions[b, t] but rotated at
        rope_positions[b, t] (first + its depth), and attends its ancestors' rows only (`ancestors`), so each row is
        bitwise the last row of the chain forward of its root-to-row path."""
        cfg = self.config
        if ancestors is not None and num_tokens is None:
            raise ValueError("a token-tree forward needs num_tokens (the row-exact attention)")
        kv_len = int(positions.max()) + 1
        slot_list = slots.tolist()
        if num_tokens is not None:  # real tokens only: padding rows write into the cache's null block
            ends = [int(p) + n for p, n in zip(positions[:, 0].tolist(), num_tokens)]
        else:
            ends = (positions.max(dim=1).values + 1).tolist()
        cache.reserve(slot_list, ends)  # the blocks those positions need (kv_cache.CacheFull: none taken)
        tables = cache.table(slots, kv_len)  # [B, nb]: where each sequence's positions live
        rope_at, rope_len = (positions, kv_len) if rope_positions is None else (rope_positions, None)
        x = self.model.embed_tokens(token_ids)
        if x.dtype != self.dtype:  # an embedding table stored narrower than the activations (bf16 rows -> fp32)
            x = x.to(self.dtype)
        if cfg.embed_scale != 1.0:
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        one_call = self.fused and num_tokens is not None and attention_op.usable(x, cache.keys[0])
        stacked = self._stack_for(token_ids.shape[1], token_ids.numel()) if one_call else None
        if stacked is not None:  # every layer in one C++ call: bitwise the loop below (kernels/stack.py)
            a = stacked
            angles = {kind: self.angles(kind, rope_at, rope_len) for kind in self._rope_tables}  # (no masks: row-exact)
            if len(angles) == 1:
                (cos1, sin1), = angles.values()
                cos, sin = [cos1] * len(cfg.layer_types), [sin1] * len(cfg.layer_types)
            else:
                cos = [angles[kind][0] for kind in cfg.layer_types]
                sin = [angles[kind][1] for kind in cfg.layer_types]
            tail = a.head if (last_only or logit_index is not None) and head is None else None  # norm + head too
            index = None if logit_index is None else logit_index if logit_index.dim() == 2 else logit_index[:, None]
            x, routed = stack_op.layers(x, a.weights, a.kinds, a.ffn, a.experts, cache.keys, cache.values, cos, sin,
                                        tables, positions, num_tokens, a.windows, a.dims, a.norm, a.qk_norm, a.scale,
                                        ancestors, tail, index)
            for mixture, chosen in zip(a.mixtures, routed):  # what each mixture layer read (SparseMoE.touched);
                _set_plain(mixture, "_last", chosen)  # a plain attribute: not through nn.Module.__setattr__'s checks
            if tail is not None:  # x: the logits [B, 1, V] of each row's last token ([B, J, V]: logit_index's)
                cache.extend(slot_list, ends)
                return x
        else:
            ropes = {kind: self.angles(kind, rope_at, rope_len) if self.fused else
                     self.rope_for(kind, rope_at, x.dtype, rope_len) for kind in self._rope_tables}
            masks = {kind: None if num_tokens is not None else self._mask(kind, positions, kv_len)
                     for kind in self._rope_tables}
            for i, layer in enumerate(self.model.layers):
                kind = cfg.layer_types[i]
                x = layer(x, ropes[kind], masks[kind], cache, i, tables, positions, kv_len, num_tokens, ancestors)
        cache.extend(slot_list, ends)
        if logit_index is not None:
            idx = logit_index if logit_index.dim() == 2 else logit_index[:, None]  # [B, J]
            x = x[torch.arange(x.shape[0], device=x.device)[:, None], idx]  # [B, J, dim]
        elif last_only:
            x = x[:, -1:]
        return (self.lm_head if head is None else head)(self.model.norm(x))

    def _stack_for(self, tokens: int, rows: int) -> StackArgs | None:
        """_stack_weights(tokens, rows), built again only when what it read may have changed: a module, parameter or
        buffer rebound anywhere since (kernels/stack.py generation: torch's registration hooks),
        the switches it reads (Decoder.stack, the fused glue, SparseMoE.grouped), the tokens per sequence (a split
        linear's half) or the rows' side of Router.FUSED_MAX_ROWS. The walk over every layer's modules costs
        ~60 us hot and ~300 us a decode step (the step's weights have evicted those objects from the caches: the
        4-layer MoE file, 1 thread); a step reuses the lists of the step before."""
        key = (tokens, rows <= Router.FUSED_MAX_ROWS, stack_op.generation(), self.stack, self.fused,
               SparseMoE.grouped)
        built = self._stack_built
        if key in built:
            return built[key]
        if len(built) >= 8 or any(k[2] != key[2] for k in built):  # stale lists, or a prompt's many chunk widths
            built.clear()
        result = built[key] = self._stack_weights(tokens, rows)
        return result

    def _stack_weights(self, tokens: int, rows: int = 1) -> StackArgs | None:
        """kernels/stack.py's arguments when every layer can run in its one C++ call for a forward with `tokens`
        tokens per sequence and `rows` rows in all (B * T), else None: the Python loop runs. Qualify: projections by kernels the loop runs (q4x8 and
        the table's block kernels; q/k/v merged or separate, gate/up merged), our attention op and glue, no sandwich
        norms; a mixture layer where its experts are grouped (kernels/experts.py) and its router takes the few-row
        op (rows <= Router.FUSED_MAX_ROWS: decode and verification; prompts keep the Python loop, whose router is a
        float64 matmul there), its shared expert (qwen2_moe) as a dense MLP would. Read from the modules at every
        call (~50-80 us: their `_modules` / `_parameters` dicts directly, not nn.Module's slow attribute lookup), so a
        module or buffer swapped after loading is never missed."""
        if self.stack is False or not stack_op.available() or not len(self.model.layers):
            return None
        weights, kinds, ffn, experts, mixtures, acts = stack_op.WeightList(), [], [], [], [], set()
        for layer in self.model.layers:
            mods = layer._modules
            attn, mlp = mods["self_attn"], mods["mlp"]
            a = attn._modules
            if layer.sandwich or attn.qk_norm_full:
                return None
            router = shared_gate = experts_set = None
            top_k = 0
            if isinstance(mlp, SparseMoE):
                if not (mlp.grouped and mlp.gate.fused and rows <= Router.FUSED_MAX_ROWS):
                    return None
                experts_set = mlp._grouped_op()
                if experts_set is None:
                    return None
                router, top_k = mlp.gate._parameters["weight"], mlp.top_k
                acts.add(mlp.experts._modules["0"].act_name)  # (the ExpertSet holds it; the loop's glu too)
                dense = mlp._modules["shared_expert"] if mlp.shared else None
                if dense is not None:
                    gate = mlp._modules["shared_expert_gate"]
                    if not gate.fused:
                        return None
                    shared_gate = gate._parameters["weight"]
            else:
                dense = mlp
            if dense is not None:
                m = dense._modules
                if m.get("gate_up_proj") is None:
                    return None
                gate_up, down = _stackable(m["gate_up_proj"], tokens), _stackable(m["down_proj"], tokens)
                if gate_up is None or down is None:
                    return None
                acts.add(dense.act_name)
            else:
                gate_up = down = None
            qkv = ("qkv_proj",) if a.get("qkv_proj") is not None else ("q_proj", "k_proj", "v_proj")
            projections = [_stackable(a[n], tokens) for n in qkv] + [_stackable(a["o_proj"], tokens)]
            if None in projections:
                return None
            *qkv, o = projections
            q, k, v = qkv if len(qkv) == 3 else (qkv[0], None, None)
            qn, kn = (a["q_norm"]._parameters["weight"], a["k_norm"]._parameters["weight"]) if attn.qk_norm else (None, None)
            w, kind, shape = stack_op.layer_weights(
                mods["input_layernorm"]._parameters["weight"], q, k, v, qn, kn, o,
                mods["post_attention_layernorm"]._parameters["weight"], gate_up, down,
                dense.intermediate if dense is not None else 0, router, top_k,
                top_k and mlp.norm_topk_prob, shared_gate)
            weights += w
            kinds += kind
            ffn += shape
            experts.append(experts_set)
            if experts_set is not None:
                mixtures.append(mlp)
        if len(acts) != 1:
            return None
        first = self.model.layers._modules["0"]._modules
        attn, norm = first["self_attn"], first["input_layernorm"]
        qk = (attn.q_norm.eps, attn.q_norm.weight_offset) if attn.qk_norm else (0.0, 0.0)
        final, lm_head = self.model._modules["norm"], _stackable(self._modules["lm_head"], 1)
        head = None  # the last_only tail (x[:, -1:], the final norm, lm_head) in the same call where both qualify
        if isinstance(final, RMSNorm) and final.fused and lm_head is not None:
            head = (final._parameters["weight"], lm_head, final.eps, final.weight_offset)
        return StackArgs(weights, kinds, ffn, experts, mixtures,
                         (attn.num_heads, attn.num_kv_heads, attn.head_dim, glue.ACTIVATIONS[acts.pop()]),
                         (norm.eps, norm.weight_offset), qk, attn.scale,
                         [int(layer._modules["self_attn"].window or 0) for layer in self.model.layers], head)

    def _mask(self, kind: str, positions: torch.Tensor, kv_len: int) -> torch.Tensor | None:
        window = self.config.sliding_window if kind == "sliding_attention" else None
        B, T = positions.shape
        if B == 1 and T == 1 and (window is None or kv_len <= window):
            return None  # a single query at the end sees every cached key
        key_pos = torch.arange(kv_len, device=positions.device)  # [kv_len]
        q_pos = positions[:, None, :, None]  # [B, 1, T, 1]
        mask = key_pos <= q_pos
        if window is not None:
            mask = mask & (key_pos > q_pos - window)
        return mask  # [B, 1, T, kv_len]


class StackArgs(NamedTuple):
    """Decoder._stack_weights' answer: kernels/stack.py layers' arguments that come from the modules."""
    weights: list  # SLOTS per layer (stack.layer_weights), a stack.WeightList (keeps its C++ copy)
    kinds: list[int]  # KINDS_PER_LAYER per layer
    ffn: list[int]  # FFN_PER_LAYER per layer
    experts: list  # per layer: a mixture's ExpertSet, or None
    mixtures: list  # the SparseMoE layers, in order (the call returns their experts)
    dims: tuple[int, int, int, int]  # num_heads, num_kv_heads, head_dim, activation (glue id)
    norm: tuple[float, float]  # eps, weight offset of the layer norms
    qk_norm: tuple[float, float]  # of the q/k norms ((0, 0) without them)
    scale: float  # attention softmax scale
    windows: list[int]  # per layer: sliding window, 0 for none
    head: tuple | None  # (final norm weight, lm_head's kernel module, eps, offset): kernels/stack.py layers' `head`


_set_plain = object.__setattr__  # an attribute that is no parameter, buffer or module: what nn.Module's setattr ends in


def _stackable(m: nn.Module, tokens: int) -> nn.Module | None:
    """The module that runs `m` for calls with `tokens` tokens per sequence (a SplitLinear's half), if
    kernels/stack.py's loop can call it (kernel_of: q4x8, q6k, q8_0 on the 'auto' path)."""
    if hasattr(type(m), "module_for"):  # (on the class: a module's own getattr miss raises, slowly)
        m = m.module_for(tokens)
    return stack_op.kernel_of(m)


def _dims(m: nn.Module) -> tuple[int, int]:
    """(rows, columns) a prepared module must match: an embedding's (rows, dim), a linear's (out, in)."""
    if hasattr(m, "num_embeddings"):
        return m.num_embeddings, m.embedding_dim
    return m.out_features, m.in_features


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    *path, leaf = name.split(".")
    parent = model
    for p in path:
        parent = getattr(parent, p)
    setattr(parent, leaf, module)


def _set_param(model: nn.Module, name: str, value: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    mod = model
    for p in path:
        mod = getattr(mod, p)
    setattr(mod, leaf, nn.Parameter(value, requires_grad=False))
