"""Triton kernels for fxshard::grouped_mlp's CUDA backend (imported only on CUDA).

Activation forward/backward over [T, H] rows (gated: gate columns [0, F), linear columns [F, 2F)),
computed in fp32, stored in the input dtype, with the rows no expert owns written as zero (ragged
layout: rows at or past offsets[-1]; slot layout, capacity C: rows past the first min(count, C) of
each expert's C-row slot); and `zero_tail_`, which zeroes the ragged layout's rows past offsets[-1]
of a GEMM output in place. The derivatives are written out
here and checked against autograd on the PyTorch definitions (tests/test_gpu.py).
"""

import torch
import triton
import triton.language as tl

_CODES = {"swiglu": 0, "geglu": 1, "quick_geglu": 2, "gelu": 3, "relu": 4}
_GATED = (0, 1, 2)


@triton.jit
def _gelu_tanh(g):
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
    dt = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
    return 0.5 * g * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * dt


@triton.jit
def _activation(g, u, limit, CODE: tl.constexpr, GATED: tl.constexpr):
    """fp32 in, fp32 out: (act, d act / d g, d act / d u); u and the last are unused when not GATED."""
    if CODE == 0:  # swiglu
        s = tl.sigmoid(g)
        f = g * s
        df = s * (1.0 + g * (1.0 - s))
    elif CODE == 1:  # geglu (tanh gelu)
        f, df = _gelu_tanh(g)
    elif CODE == 2:  # quick_geglu, clamped
        pass_g = g <= limit
        pass_u = (u >= -limit) & (u <= limit)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        s = tl.sigmoid(1.702 * g)
        f = g * s
        df = tl.where(pass_g, s + 1.702 * g * s * (1.0 - s), 0.0)
        u = u + 1.0
    elif CODE == 3:  # gelu (erf)
        f = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
        df = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476)) + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    else:  # relu
        f = tl.maximum(g, 0.0)
        df = tl.where(g > 0.0, 1.0, 0.0)
    if GATED:
        du = f
        if CODE == 2:
            du = tl.where(pass_u, f, 0.0)
        return f * u, df * u, du
    return f, df, df


@triton.jit
def _act_kernel(h_ptr, grad_ptr, out_ptr, act_ptr, offsets_ptr, n_experts, rows, width, limit, capacity,
                CODE: tl.constexpr, GATED: tl.constexpr, BACKWARD: tl.constexpr, SLOTS: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """width = F (the activation's output width). Forward: out [T, F] = act. Backward: out [T, H] =
    grad_h (gated: d/d gate in columns [0, F), d/d linear half in [F, 2F)) and act_ptr [T, F] = act.
    SLOTS: the slot layout (`capacity` rows per expert)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_bounds = (r[:, None] < rows) & (c[None, :] < width)
    if SLOTS:
        slot = r // capacity
        first = tl.load(offsets_ptr + slot - 1, mask=(slot > 0) & (r < rows), other=0)
        last = tl.load(offsets_ptr + slot, mask=r < rows, other=0)
        owned = r - slot * capacity < last - first
    else:
        owned = r < tl.load(offsets_ptr + n_experts - 1)
    live = in_bounds & owned[:, None]
    h_width = 2 * width if GATED else width
    r64 = r.to(tl.int64)
    g = tl.load(h_ptr + r64[:, None] * h_width + c[None, :], mask=live, other=0.0).to(tl.float32)
    u = g
    if GATED:
        u = tl.load(h_ptr + r64[:, None] * h_width + width + c[None, :], mask=live, other=0.0).to(tl.float32)
    value, d_g, d_u = _activation(g, u, limit, CODE, GATED)
    if BACKWARD:
        grad = tl.load(grad_ptr + r64[:, None] * width + c[None, :], mask=live, other=0.0).to(tl.float32)
        tl.store(out_ptr + r64[:, None] * h_width + c[None, :], (grad * d_g).to(out_ptr.dtype.element_ty),
                 mask=in_bounds)
        if GATED:
            tl.store(out_ptr + r64[:, None] * h_width + width + c[None, :], (grad * d_u).to(out_ptr.dtype.element_ty),
                     mask=in_bounds)
    target = act_ptr if BACKWARD else out_ptr
    tl.store(target + r64[:, None] * width + c[None, :], value.to(target.dtype.element_ty), mask=in_bounds)


def _launch(h, grad, out, act, offsets, name, limit, capacity, backward):
    code = _CODES[name]
    gated = code in _GATED
    rows, width = h.shape[0], h.shape[1] // (2 if gated else 1)
    block_r, block_c = 16, 128  # as fast as any other tried (bench/probes/act_kernel_blocks.py)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(width, block_c))
    if rows and width:
        _act_kernel[grid](h, grad if grad is not None else h, out, act if act is not None else out, offsets,
                          offsets.shape[0], rows, width, float(limit), capacity or 1, CODE=code, GATED=gated,
                          BACKWARD=backward, SLOTS=capacity is not None, BLOCK_R=block_r, BLOCK_C=block_c)
    return out


def activation_forward(h, offsets, name, limit, capacity=None):
    gated = _CODES[name] in _GATED
    out = h.new_empty(h.shape[0], h.shape[1] // (2 if gated else 1))
    return _launch(h.contiguous(), None, out, None, offsets, name, limit, capacity, backward=False)


def activation_backward(h, grad, offsets, name, limit, capacity=None):
    """(grad_h, act): the derivative and the recomputed activation, one pass over h."""
    gated = _CODES[name] in _GATED
    act = h.new_empty(h.shape[0], h.shape[1] // (2 if gated else 1))
    grad_h = _launch(h.contiguous(), grad.contiguous(), torch.empty_like(h), act, offsets, name, limit, capacity,
                     backward=True)
    return grad_h, act


@triton.jit
def _zero_tail_kernel(out_ptr, offsets_ptr, n_experts, rows, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """A fixed grid strides over the rows from offsets[-1] on: with no tail (every row routed, the
    common case) each program returns at once, where a grid over every row launched rows/BLOCK_R
    programs that mostly had nothing to do (41 us per call at T=65536, D=2048 on an H200)."""
    end = tl.load(offsets_ptr + n_experts - 1)
    c = tl.arange(0, BLOCK_C)
    zeros = tl.zeros((BLOCK_R, BLOCK_C), dtype=out_ptr.dtype.element_ty)
    for first in range(end + tl.program_id(0) * BLOCK_R, rows, tl.num_programs(0) * BLOCK_R):
        r = first + tl.arange(0, BLOCK_R)
        for c0 in range(0, width, BLOCK_C):
            mask = (r[:, None] < rows) & (c0 + c[None, :] < width)
            tl.store(out_ptr + r.to(tl.int64)[:, None] * width + c0 + c[None, :], zeros, mask=mask)


def zero_tail_(out, offsets):
    rows, width = out.shape
    if rows and width:
        programs = min(triton.cdiv(rows, 32), 4 * torch.cuda.get_device_properties(out.device).multi_processor_count)
        _zero_tail_kernel[(programs,)](out, offsets, offsets.shape[0], rows, width, BLOCK_R=32, BLOCK_C=128)
    return out
