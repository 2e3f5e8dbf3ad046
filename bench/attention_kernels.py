"""Causal attention kernels on CUDA, forward + backward, bf16: the memory-efficient kernel with
is_causal (what sink attention and fp32 SDPA trace to, passes/causal_attention.py dropping the mask)
against flash (passes/flash_attention.py moves the first to it), and cuDNN's (what bf16 SDPA traces to
on Hopper) with the causal mask as a bias tensor against is_causal (passes/causal_attention.py), on the
shapes of the models fxshard benchmarks; then sliding windows (query i sees keys i - W + 1 .. i):
cuDNN's and the memory-efficient kernel with the window as a bias tensor (what bf16 / fp32 SDPA trace
to) against flash's window (`window_size_left = W - 1`, passes/flash_attention.py). Prints tables,
writes JSON.

    python bench/attention_kernels.py --out bench/attention_kernels.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

aten = torch.ops.aten
SHAPES = {  # name: (batch, heads, sequence, head dim)
    "gpt-oss bench (32 x 64)": (1, 32, 4096, 64),
    "llama 1b-ish (32 x 64)": (4, 32, 2048, 64),
    "llama 8b (32 x 128)": (1, 32, 4096, 128),
    "gpt 1b bench (16 x 128)": (1, 16, 2048, 128),
}

WINDOWS = {  # name: (batch, heads, sequence, head dim, window)
    "gpt-oss bench, W 128": (1, 32, 4096, 64, 128),
    "gemma 3 4b-ish, W 1024": (1, 8, 4096, 256, 1024),
    "gemma 3 4b-ish, W 1024, S 8192": (1, 8, 8192, 256, 1024),
    "mistral-ish, W 2048": (1, 32, 4096, 128, 2048),
}


def window_bias(q, window):
    """The additive window mask SDPA hands a kernel for transformers' boolean one (0 / -65536)."""
    i = torch.arange(q.shape[-2], device=q.device)
    allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    bias = torch.zeros(allowed.shape, device=q.device, dtype=q.dtype).masked_fill(~allowed, -65536.0)
    return bias.expand(q.shape[0], q.shape[1], *allowed.shape)


def efficient_window(q, k, v, grad, bias):
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, False)
    return aten._scaled_dot_product_efficient_attention_backward(grad, q, k, v, bias, out, lse, seed, offset, 0.0,
                                                                 [True, True, True, False], False)


def cudnn_window(q, k, v, grad, bias):
    return _cudnn(q, k, v, grad, bias, False)


def flash_window(q, k, v, grad, window):
    """Flash's own ops, on (batch, sequence, heads, dim) views, with the window as window_size_left."""
    s = q.shape[-2]
    q, k, v, grad = (t.transpose(1, 2) for t in (q, k, v, grad))
    flags = dict(window_size_left=window - 1, window_size_right=0)
    out, lse, rng, unused, _ = aten._flash_attention_forward(q, k, v, None, None, s, s, 0.0, True, False, **flags)
    return aten._flash_attention_backward(grad, q, k, v, out, lse, None, None, s, s, 0.0, True, rng, unused, **flags)


def efficient(q, k, v, grad):
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)
    return aten._scaled_dot_product_efficient_attention_backward(grad, q, k, v, None, out, lse, seed, offset, 0.0,
                                                                 [True, True, True, False], True)


def flash(q, k, v, grad):
    out, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)
    return aten._scaled_dot_product_flash_attention_backward(grad, q, k, v, out, lse, cq, ck, mq, mk, 0.0, True,
                                                             seed, offset)


def cudnn_masked(q, k, v, grad):
    s = q.shape[-2]
    bias = torch.zeros(s, s, device=q.device, dtype=q.dtype).masked_fill(
        ~torch.ones(s, s, dtype=torch.bool, device=q.device).tril(), float("-inf")).expand(q.shape[0], q.shape[1], s, s)
    return _cudnn(q, k, v, grad, bias, False)


def cudnn_causal(q, k, v, grad):
    return _cudnn(q, k, v, grad, None, True)


def _cudnn(q, k, v, grad, bias, causal):
    out, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0,
                                                                                        causal)
    return aten._scaled_dot_product_cudnn_attention_backward(grad, q, k, v, out, lse, seed, offset, bias, cq, ck, mq,
                                                             mk, 0.0, causal)


def timed(fn, args, repeats=30) -> float:
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="attention_kernels.json")
    args = parser.parse_args()
    rows = []
    print(f"{'shape':<28} {'B,H,S,D':<18} {'efficient ms':>12} {'flash ms':>9} {'ratio':>6} {'max |dq| diff':>13} "
          f"{'cudnn mask ms':>13} {'cudnn causal ms':>15} {'ratio':>6}")
    for name, (b, h, s, d) in SHAPES.items():
        torch.manual_seed(0)
        q, k, v, grad = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        e, f = timed(efficient, (q, k, v, grad)), timed(flash, (q, k, v, grad))
        diff = (efficient(q, k, v, grad)[0].float() - flash(q, k, v, grad)[0].float()).abs().max().item()
        cm, cc = timed(cudnn_masked, (q, k, v, grad)), timed(cudnn_causal, (q, k, v, grad))
        rows.append(dict(shape=name, bhsd=[b, h, s, d], efficient_ms=e, flash_ms=f, ratio=e / f, dq_max_diff=diff,
                         cudnn_masked_ms=cm, cudnn_causal_ms=cc))
        print(f"{name:<28} {str((b, h, s, d)):<18} {e:>12.3f} {f:>9.3f} {e / f:>6.2f} {diff:>13.2e} {cm:>13.3f} "
              f"{cc:>15.3f} {cm / cc:>6.2f}")
    windows = []
    print(f"\n{'sliding window':<32} {'B,H,S,D,W':<24} {'efficient bias ms':>17} {'cudnn bias ms':>13} "
          f"{'flash window ms':>15} {'cudnn / flash':>13} {'max |dq| diff':>13}")
    for name, (b, h, s, d, w) in WINDOWS.items():
        torch.manual_seed(0)
        q, k, v, grad = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        bias = window_bias(q, w)
        e, c = timed(efficient_window, (q, k, v, grad, bias)), timed(cudnn_window, (q, k, v, grad, bias))
        f = timed(flash_window, (q, k, v, grad, w))
        diff = (cudnn_window(q, k, v, grad, bias)[0].float()
                - flash_window(q, k, v, grad, w)[0].transpose(1, 2).float()).abs().max().item()
        windows.append(dict(shape=name, bhsdw=[b, h, s, d, w], efficient_bias_ms=e, cudnn_bias_ms=c, flash_window_ms=f,
                            dq_max_diff=diff))
        print(f"{name:<32} {str((b, h, s, d, w)):<24} {e:>17.3f} {c:>13.3f} {f:>15.3f} {c / f:>13.2f} {diff:>13.2e}")
    with open(args.out, "w") as file:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows, windows=windows), file,
                  indent=1)


if __name__ == "__main__":
    main()
