"""The static forward step: one Decoder's forward over a fixed-shape chunk, with its own preallocated K/V.

gpt-fast's static cache, built from the weights and the kernel plan a Decoder already holds: K/V for
`num_slots` sequence slots plus one scratch slot (where a batch bucket's padding sequences write), each
`capacity` positions long, indexed by position; RoPE angles for every position computed once at construction.
`forward(token_ids [B, W], positions [B, W], slots [B])` writes the chunk's K/V at its positions and returns
logits [B, W, V]; B and W are whatever bucket the caller pads to. Nothing in it reads a value back to the
host, branches on a tensor's value or allocates by data: the shapes of every tensor follow from (B, W) alone,
so `torch.compile(fullgraph=True)` traces it whole and, on CUDA, `mode="reduce-overhead"` captures it as a
CUDA graph. A sequence's length is not stored here: the caller's positions say where a chunk goes, and a
query attends keys up to its own position only, so entries past a sequence's end (rejected guesses, padding
rows) are invisible and overwritten by the next write. That position mask is the K/V rollback.

Two attention paths, one contract:
- "op": kernels/attention.py's row-exact C++ op (CPU; every query of the chunk counted real, padding rows
  attend like any other row and are ignored by the caller), with the decoder's own layer modules (fused glue
  where the decoder uses it). A real row is then bitwise the row Decoder.forward computes for it with
  `num_tokens` (the engine's call): same kernels, same order. Eager only (the C++ ops declare no shapes for
  the compiler).
- "sdpa": torch only (torch RMSNorm, RoPE, linears of the plan, one masked SDPA per layer over the slot's whole
  capacity, so a query's key sequence has one length whatever the bucket): what a GPU runs and what
  torch.compile traces. A row's result depends on the row alone where the plan's linear kernel is row-exact.

Knows nothing of requests, proposers, verification or sampling (spec_decode/static_spec.py drives it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftwise.kernels import attention as attention_op
from draftwise.models.transformer import Decoder, RMSNorm, rotate_half

ATTENTION_PATHS = ("op", "sdpa")


def default_attention(decoder: Decoder) -> str:
    """'op' where our row-exact attention op runs for this decoder (CPU, float32 / bfloat16, library built), else
    'sdpa'."""
    probe = torch.empty(1, dtype=decoder.dtype, device=decoder.device)
    return "op" if attention_op.usable(probe, probe) else "sdpa"


class StaticStep(nn.Module):
    """A Decoder's forward with static shapes and its own K/V (see the module docstring). An nn.Module whose
    K/V are buffers, so a compiled step (CUDA graphs included) sees them as static tensors it may write."""

    def __init__(self, decoder: Decoder, num_slots: int, capacity: int, attention: str | None = None,
                 kv_dtype: torch.dtype | None = None):  # K/V storage (the engine's --kv-cache-dtype); None: decoder's
        super().__init__()
        if attention is None:
            attention = default_attention(decoder)
        if attention not in ATTENTION_PATHS:
            raise ValueError(f"attention must be one of {ATTENTION_PATHS}, not {attention!r}")
        if num_slots < 1 or capacity < 2:
            raise ValueError(f"a static step needs num_slots >= 1 and capacity >= 2 (got {num_slots}, {capacity})")
        if attention == "op" and default_attention(decoder) != "op":
            raise ValueError("attention 'op' needs our C++ attention op (CPU, float32 or bfloat16, library built)")
        cfg = decoder.config
        self.decoder = decoder
        self.attention = attention
        self.num_slots = num_slots
        self.scratch_slot = num_slots  # padding sequences of a batch bucket write here
        self.capacity = capacity
        dev, dtype = decoder.device, kv_dtype or decoder.dtype
        shape = (num_slots + 1, cfg.num_kv_heads, capacity, cfg.head_dim)
        for i in range(len(cfg.layer_types)):
            self.register_buffer(f"keys_{i}", torch.zeros(shape, dtype=dtype, device=dev), persistent=False)
            self.register_buffer(f"values_{i}", torch.zeros(shape, dtype=dtype, device=dev), persistent=False)
        self.keys = [getattr(self, f"keys_{i}") for i in range(len(cfg.layer_types))]  # [S + 1, H_kv, C, D] each
        self.values = [getattr(self, f"values_{i}") for i in range(len(cfg.layer_types))]
        self.register_buffer("_head_index", torch.arange(cfg.num_kv_heads, device=dev)[None, :, None],
                             persistent=False)  # [1, H_kv, 1]
        self.register_buffer("_key_positions", torch.arange(capacity, device=dev), persistent=False)  # [C]
        all_positions = torch.arange(capacity, device=dev)[None]  # [1, C]
        # each kind's angles, read once from the decoder's own table (the rows Decoder.forward looks up)
        self._angles = {kind: decoder.angles(kind, all_positions, capacity) for kind in set(cfg.layer_types)}
        self._run = self._forward  # compile() swaps in the compiled forward
        self._graphs = False

    def compile(self, mode: str | None = None) -> None:
        """Compile the forward (fullgraph, static shapes: one graph per bucket, built at its first call). Mode
        "reduce-overhead" captures CUDA graphs; every call then starts a new step of the graph tree, so a call's
        logits are only valid until the next call (every caller reduces them to ids at once)."""
        kw = {"mode": mode} if mode else {}
        self._run = torch.compile(self._forward, fullgraph=True, dynamic=False, **kw)
        self._graphs = mode == "reduce-overhead"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def forward(
        self,
        token_ids: torch.Tensor,  # [B, W] int64
        positions: torch.Tensor,  # [B, W] int64, positions[b, t] = positions[b, 0] + t, all < capacity
        slots: torch.Tensor,  # [B] int64 (the scratch slot for a bucket's padding sequences)
    ) -> torch.Tensor:  # [B, W, V] logits
        if self._graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():  # (not inference_mode: its tensors cannot be mutated inside a compiled graph)
            return self._run(token_ids, positions, slots)

    def _forward(self, token_ids, positions, slots):
        decoder, cfg = self.decoder, self.decoder.config
        B, W = token_ids.shape
        x = decoder.model.embed_tokens(token_ids)
        if x.dtype != decoder.dtype:
            x = x.to(decoder.dtype)
        if cfg.embed_scale != 1.0:
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        index = positions.reshape(-1)
        angles = {kind: (cos.index_select(0, index), sin.index_select(0, index))  # [B * W, D / 2]
                  for kind, (cos, sin) in self._angles.items()}
        for i, layer in enumerate(decoder.model.layers):
            cos, sin = angles[cfg.layer_types[i]]
            if self.attention == "op":
                x = self._layer_op(layer, i, x, cos, sin, positions, slots)
            else:
                x = self._layer_sdpa(layer, i, x, cos, sin, positions, slots)
        if self.attention == "sdpa":
            return decoder.lm_head(_rms_norm(decoder.model.norm, x))
        return decoder.lm_head(decoder.model.norm(x))

    # ---- "op": the decoder's own modules, our attention op over this cache ----------------------------------
    def _layer_op(self, layer, i, x, cos, sin, positions, slots):  # x [B, W, hidden]
        B, W, _ = x.shape
        attn = layer.self_attn
        if attn.fused:
            rope = (cos, sin)
        else:  # the torch reference's [B, 1, W, D] form (Decoder.rope_for)
            c, s = cos.view(B, W, -1), sin.view(B, W, -1)
            rope = (torch.cat((c, c), -1)[:, None].to(x.dtype), torch.cat((s, s), -1)[:, None].to(x.dtype))
        tables = slots[:, None]  # [B, 1]: this cache is a paged pool of one block (the whole capacity) per slot
        return layer(x, rope, None, _CacheView(self), i, tables, positions, 0, [W] * B)

    # ---- "sdpa": torch only -----------------------------------------------------------------------------
    def _layer_sdpa(self, layer, i, x, cos, sin, positions, slots):  # x [B, W, hidden]
        h = self._attention_sdpa(layer.self_attn, i, _rms_norm(layer.input_layernorm, x), cos, sin, positions, slots)
        if layer.sandwich:
            x = x + _rms_norm(layer.post_attention_layernorm, h)
            return x + _rms_norm(layer.post_feedforward_layernorm,
                                 _mlp(layer.mlp, _rms_norm(layer.pre_feedforward_layernorm, x)))
        x = x + h
        return x + _mlp(layer.mlp, _rms_norm(layer.post_attention_layernorm, x))

    def _attention_sdpa(self, attn, i, x, cos, sin, positions, slots):  # x [B, W, hidden] -> [B, W, hidden]
        B, W, _ = x.shape
        if attn.qkv_proj is not None:
            q, k, v = attn.qkv_proj(x).split(attn.qkv_sizes, dim=-1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q = q.view(B, W, attn.num_heads, attn.head_dim)
        k = k.view(B, W, attn.num_kv_heads, attn.head_dim)
        v = v.view(B, W, attn.num_kv_heads, attn.head_dim).transpose(1, 2)  # [B, H_kv, W, D]
        if attn.qk_norm:
            q, k = _rms_norm(attn.q_norm, q), _rms_norm(attn.k_norm, k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        c, s = cos.view(B, W, -1), sin.view(B, W, -1)
        c = torch.cat((c, c), -1)[:, None].to(q.dtype)  # [B, 1, W, D]
        s = torch.cat((s, s), -1)[:, None].to(q.dtype)
        q = q * c + rotate_half(q) * s
        k = k * c + rotate_half(k) * s
        where = (slots[:, None, None], self._head_index, positions[:, None, :])
        self.keys[i].index_put_(where, k.to(self.keys[i].dtype))
        self.values[i].index_put_(where, v.to(self.values[i].dtype))
        keys, values = self.keys[i][slots].to(q.dtype), self.values[i][slots].to(q.dtype)  # [B, H_kv, C, D]
        q_pos = positions[:, None, :, None]  # [B, 1, W, 1]
        mask = self._key_positions <= q_pos  # [B, 1, W, C]
        if attn.window:
            mask = mask & (self._key_positions > q_pos - attn.window)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scale,
                                             enable_gqa=attn.num_kv_heads != attn.num_heads)  # [B, H, W, D]
        return attn.o_proj(out.transpose(1, 2).reshape(B, W, -1))


class _CacheView:
    """What Attention.forward reads of a KVCache on the row-exact path (keys, values, write, read), over a
    StaticStep's tensors: the decoder's own layer code writes and attends here. Its layout is kv_cache.py's paged
    pool [blocks, H_kv, block, D] with one block (the step's whole capacity) per slot, so a slot's table is [slot]."""

    def __init__(self, step: StaticStep):
        self.keys, self.values = step.keys, step.values
        self._head_index = step._head_index

    def write(self, layer, tables, positions, k, v) -> None:  # tables [B, 1], positions [B, T], k, v [B, H, T, D]
        where = (tables[:, :1, None], self._head_index, positions[:, None, :])
        self.keys[layer].index_put_(where, k.to(self.keys[layer].dtype))  # rounded as KVCache.write rounds
        self.values[layer].index_put_(where, v.to(self.values[layer].dtype))

    def read(self, layer, tables, kv_len, dtype):  # tables [B, 1] -> keys, values [B, H_kv, kv_len, D]
        slots = tables[:, 0]
        return (self.keys[layer][slots, :, :kv_len].to(dtype), self.values[layer][slots, :, :kv_len].to(dtype))


def _rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:  # [..., dim]: RMSNorm's torch reference
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
    if norm.weight_offset:
        return (xf * (norm.weight_offset + norm.weight.float())).to(x.dtype)
    return norm.weight * xf.to(x.dtype)


def _mlp(mlp, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]: MLP's torch reference
    if mlp.gate_up_proj is not None:
        g, u = mlp.gate_up_proj(x).split(mlp.intermediate, dim=-1)
    else:
        g, u = mlp.gate_proj(x), mlp.up_proj(x)
    return mlp.down_proj(mlp.act(g) * u)
