"""Linear-layer kernels for CPU inference, the machine probe that says which can run here, and the autotuner.

This package is the lowest layer: it imports torch, numpy, the standard library and draftwise.paths only. It owns
how a linear layer y = x W^T + b is computed (dense fp32/bf16, torch's weight-only int4/int8, fbgemm dynamic int8,
and our own int4-weight x int8-activation C++ kernel, `q4x8`) and which one is fastest on this machine for a
model's shapes; also one row-exact attention operator over a KV cache's tensors and the decoder's per-layer glue
ops (norms, RoPE + K/V write, gated activation). It knows nothing of checkpoints, decoders, requests or
speculation: callers hand it fp32 (or dequantized) weights and get back modules with
`forward(x [..., K]) -> [..., N]`.

    probe.py     what this CPU can do (instruction sets, threads, measured memory bandwidth: torch matvec and a
                 streaming sum in C, stream_read.c, built with the system C compiler, not in the library)
    q4x8.py      our kernel: build (JIT, cached), weight quantization/packing, the packed embedding table
    attention.py our row-exact decode/verification attention op (one call per layer; in q4x8's library)
    glue.py      the decoder's glue between the matmuls as row-exact C++ ops (in q4x8's library)
    stack.py     the decoder's layer loop over those ops in one C++ call, bitwise the Python loop (same library)
    linear.py    the one registry of linear implementations (LINEARS), each with where it runs, its dtype,
                 whether it is row-exact, its stored form and how it computes some of its rows
    plan.py      where a kernel is chosen: KernelPlan and resolve_plan (--weights / --dtype / auto)
    autotune.py  time the candidates on real shapes, choose one step kernel and one prefill kernel, cache it
    threads.py   fewer torch threads while other processes hold cores (row-exact plans), back when they stop
    hugepages.py opt-in: a loaded model's weight storages moved into transparent huge pages (2 MiB), bitwise
"""
from __future__ import annotations

