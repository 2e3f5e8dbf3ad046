"""Which attention kernel a training step should call: SDPA's backends side by side on one GPU.

A pipeline stage of GPT 1b (session 44's traces) spends ~15% of its GPU time in cuDNN's causal
attention, at ~300 TFLOP/s against ~650 for its GEMMs, while the step runs at the H200's power cap:
a faster (or less power-hungry) attention kernel is one of the few levers left on that step. This
times the forward and forward + backward of causal attention for the shape the model calls it with
(batch 1, 16 heads of 128, 2,048 tokens, bf16; q and k contiguous after RoPE, v a view of the QKV
projection, the output's gradient a transposed view, as in `models/blocks.Attention`), for each of
SDPA's CUDA backends and torch.compile'd flex attention, with the GPU's clock and power during each.
The backward is timed as (forward + backward) - forward, each from a CUDA graph of --iters calls.

    python bench/attention.py [--seq 2048] [--heads 16] [--head-dim 128] [--batch 1] [--iters 100]

Prints a table; writes bench/attention_<gpu>_<date>.json (or --json).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import traceback

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GpuClocks, device_name, write_json  # noqa: E402


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of causal attention: two matmuls forward, five backward, half masked."""
    forward = 2 * 2 * batch * heads * seq * seq * head_dim / 2
    return forward, forward * 2.5


def inputs(batch, heads, seq, head_dim, device):
    """q, k, v, the output's gradient and the QKV projection v is a view of, laid out as
    `models/blocks.Attention` makes them."""
    qkv = torch.randn(batch, seq, 3, heads, head_dim, device=device, dtype=torch.bfloat16)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    q, k = q.contiguous(), k.contiguous()
    for t in (q, k, qkv):
        t.requires_grad_(True)
    v = qkv.permute(2, 0, 3, 1, 4)[2]
    grad = torch.randn(batch, seq, heads, head_dim, device=device, dtype=torch.bfloat16).transpose(1, 2)
    return q, k, v, grad, qkv


def sdpa_call(backend):
    def call(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return call


def flex_call(seq, device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, seq, seq, device=device)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda q, k, v: compiled(q, k, v, block_mask=mask)


def time_ms(make_fn, iters: int, repeats: int = 10, during=contextlib.nullcontext()) -> float:
    """ms per call of `make_fn()` (a CUDA step), replayed from a CUDA graph of `iters` calls (eager
    launches would time the host: one call is ~0.1-0.5 ms of GPU work), `repeats` replays after one.
    `make_fn` runs on the capturing stream, so the autograd nodes of the leaves it makes live there;
    `during` (a context manager) encloses the timed replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn = make_fn()
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with during:
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / (iters * repeats)


def measure(name, call, args, tensors, iters, reference):
    q, k, v, grad, qkv = tensors  # every backend sees the same inputs

    def forward():
        def call_forward():
            with torch.no_grad():
                call(q, k, v)
        return call_forward

    def both():
        fresh_q, fresh_k, fresh_qkv = (t.detach().requires_grad_(True) for t in (q, k, qkv))
        fresh_v = fresh_qkv.permute(2, 0, 3, 1, 4)[2]
        return lambda: torch.autograd.grad(call(fresh_q, fresh_k, fresh_v), (fresh_q, fresh_k, fresh_qkv), grad)

    try:
        with torch.no_grad():
            out = call(q, k, v)
    except RuntimeError as error:  # a backend that does not take this shape or GPU
        return {"backend": name, "error": str(error).splitlines()[0][:160]}, None
    torch.cuda.synchronize()
    error_vs_ref = None
    if reference is not None:
        error_vs_ref = (out.float() - reference.float()).abs().max().item()

    try:
        fwd = time_ms(forward, iters)
        clocks = GpuClocks()
        total = time_ms(both, iters, during=clocks)
    except RuntimeError as error:  # e.g. a backend whose kernels do not capture
        traceback.print_exc()
        return {"backend": name, "error": f"timing failed: {str(error).splitlines()[0][:160]}"}, None
    fwd_flops, bwd_flops = attention_flops(args.batch, args.heads, args.seq, args.head_dim)
    summary = clocks.summary()
    row = {"backend": name, "fwd_ms": fwd, "bwd_ms": total - fwd, "fwd_bwd_ms": total,
           "fwd_tflops": fwd_flops / fwd / 1e9, "bwd_tflops": bwd_flops / (total - fwd) / 1e9,
           "fwd_bwd_tflops": (fwd_flops + bwd_flops) / total / 1e9, "max_abs_diff_vs_cudnn": error_vs_ref,
           "clocks": summary}
    if summary is not None:
        row["energy_mj_fwd_bwd"] = summary["power_w_mean"] * total
    return row, out.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=100, help="calls captured in one CUDA graph")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/attention.py times CUDA kernels: no GPU here")
    torch.manual_seed(0)
    candidates = [("cudnn", sdpa_call(SDPBackend.CUDNN_ATTENTION)), ("flash", sdpa_call(SDPBackend.FLASH_ATTENTION)),
                  ("efficient", sdpa_call(SDPBackend.EFFICIENT_ATTENTION)),
                  ("default", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
                  ("flex-compiled", None)]
    rows, reference = [], None
    tensors = inputs(args.batch, args.heads, args.seq, args.head_dim, "cuda")
    for name, call in candidates:
        if call is None:
            call = flex_call(args.seq, "cuda")
        row, out = measure(name, call, args, tensors, args.iters, reference)  # out: None where it did not run
        reference = out if reference is None else reference
        rows.append(row)
    shape = f"batch {args.batch}, {args.heads} heads x {args.head_dim}, {args.seq} tokens, causal, bf16"
    print(f"causal attention on {device_name()}: {shape}")
    print(f"{'backend':<14}{'fwd ms':>9}{'bwd ms':>9}{'fwd TF/s':>10}{'bwd TF/s':>10}{'f+b TF/s':>10}"
          f"{'mJ f+b':>9}{'max |diff|':>12}  clock")
    for row in rows:
        if "error" in row:
            print(f"{row['backend']:<14} not run: {row['error']}")
            continue
        clock = row["clocks"]
        print(f"{row['backend']:<14}{row['fwd_ms']:9.3f}{row['bwd_ms']:9.3f}{row['fwd_tflops']:10.0f}"
              f"{row['bwd_tflops']:10.0f}{row['fwd_bwd_tflops']:10.0f}{row.get('energy_mj_fwd_bwd', float('nan')):9.1f}"
              f"{(row['max_abs_diff_vs_cudnn'] or 0.0):12.2e}  {GpuClocks.line(clock)}")
    path = args.json or os.path.join(os.path.dirname(__file__),
                                     f"attention_{device_name().split()[-1].lower()}_{datetime.date.today()}.json")
    write_json(path, shape=shape, command=" ".join(sys.argv), rows=rows)


if __name__ == "__main__":
    main()
