"""Probe: block shapes of the grouped MLP's Triton activation kernels (SwiGLU, bf16, H200).

Times fxshard's `_act_kernel` forward (reads h [T, 2F], writes act [T, F]) and backward (reads h and
grad [T, F], writes grad_h [T, 2F] and act) at the grouped-MLP bench's shapes for several
(BLOCK_R, BLOCK_C, num_warps), CUDA-graph replay, median; prints the bytes moved per second, the
figure that matters for a memory-bound pass. Each config's outputs are checked equal to the shipped
launch's first.

    python3 bench/probes/act_kernel_blocks.py
"""

import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
from grouped_gemm_parts import median_ms  # noqa: E402

from fxshard.ops._triton_grouped_mlp import _CODES, _act_kernel, activation_backward, activation_forward  # noqa: E402

SHAPES = [(8, 16384, 1408), (64, 65536, 768)]  # (E, T, F)
CONFIGS = [(16, 128, 4), (32, 128, 4), (32, 256, 8), (64, 128, 8), (8, 256, 4), (16, 256, 4), (64, 64, 4)]


def launch(h, grad, out, act, offsets, width, backward, block_r, block_c, warps):
    grid = (triton.cdiv(h.shape[0], block_r), triton.cdiv(width, block_c))
    _act_kernel[grid](h, grad if grad is not None else h, out, act if act is not None else out, offsets,
                      offsets.shape[0], h.shape[0], width, 7.0, 1, CODE=_CODES["swiglu"], GATED=True,
                      BACKWARD=backward, SLOTS=False, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)


def main():
    for experts, tokens, width in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        offsets = torch.bincount(torch.randint(0, experts, (tokens,), device="cuda", generator=g),
                                 minlength=experts).cumsum(0).to(torch.int32)
        h = torch.randn(tokens, 2 * width, device="cuda", dtype=torch.bfloat16, generator=g)
        grad = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16, generator=g)
        want_act = activation_forward(h, offsets, "swiglu", 7.0)
        want_grad_h, _ = activation_backward(h, grad, offsets, "swiglu", 7.0)
        act, grad_h, act2 = torch.empty_like(grad), torch.empty_like(h), torch.empty_like(grad)
        forward_bytes, backward_bytes = 3 * tokens * width * 2, 6 * tokens * width * 2
        for block_r, block_c, warps in CONFIGS:
            def forward():
                launch(h, None, act, None, offsets, width, False, block_r, block_c, warps)

            def backward():
                launch(h, grad, grad_h, act2, offsets, width, True, block_r, block_c, warps)

            forward()
            backward()
            same = torch.equal(act, want_act) and torch.equal(grad_h, want_grad_h) and torch.equal(act2, want_act)
            f_ms, b_ms = median_ms(forward), median_ms(backward)
            print(f"E={experts} T={tokens} F={width} block {block_r}x{block_c} warps {warps}: forward {f_ms * 1e3:.1f} us "
                  f"({forward_bytes / f_ms / 1e9:.2f} TB/s), backward {b_ms * 1e3:.1f} us "
                  f"({backward_bytes / b_ms / 1e9:.2f} TB/s), equal to shipped: {same}", flush=True)


if __name__ == "__main__":
    main()
