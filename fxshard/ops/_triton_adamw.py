"""Triton kernel for fxshard::adamw_update (imported only on CUDA)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _adamw_kernel(param_ptr, grad_ptr, m_ptr, v_ptr, out_p, out_m, out_v, decay_ptr, step_size_ptr, bc2_ptr,
                  skip_ptr, scale_ptr, n, beta1, beta2, eps, BLOCK: tl.constexpr, SKIP: tl.constexpr,
                  IN_PLACE: tl.constexpr, SCALE: tl.constexpr, PTX: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    if SKIP and IN_PLACE:  # a skipped step reads and writes nothing
        mask = mask & (tl.load(skip_ptr) == 0)
    p0 = tl.load(param_ptr + offsets, mask=mask)
    g = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)  # a bf16 / fp16 gradient widened exactly
    if SCALE:  # clipping's coefficient, the loss scale's inverse: one fp32 multiply, as grad.float() * s;
        # mul.rn is never contracted into the moments' arithmetic (a plain `*` would become FMAs there),
        # so the step has the bits of the one that reads the multiplied gradient
        scale = tl.broadcast_to(tl.load(scale_ptr), [BLOCK])
        if PTX:
            g = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [g, scale], dtype=tl.float32,
                                          is_pure=True, pack=1)
        else:  # ROCm: no PTX; the product may be fused into the moments' arithmetic (rounded once less)
            g = g * scale
    m0 = tl.load(m_ptr + offsets, mask=mask)
    v0 = tl.load(v_ptr + offsets, mask=mask)
    decay = tl.load(decay_ptr)
    step_size = tl.load(step_size_ptr)
    bc2 = tl.load(bc2_ptr)
    m = m0 + (1 - beta1) * (g - m0)
    v = v0 * beta2 + (1 - beta2) * g * g
    denom = tl.sqrt(v) / bc2 + eps
    p = p0 * decay - step_size * (m / denom)
    if SKIP and not IN_PLACE:  # a skipped step copies the old values
        skip = tl.load(skip_ptr) != 0
        p = tl.where(skip, p0, p)
        m = tl.where(skip, m0, m)
        v = tl.where(skip, v0, v)
    tl.store(out_p + offsets, p, mask=mask)
    tl.store(out_m + offsets, m, mask=mask)
    tl.store(out_v + offsets, v, mask=mask)

def fused_adamw(param, grad, exp_avg, exp_avg_sq, decay, step_size, bc2, beta1, beta2, eps, out=None, skip=None,
                grad_scale=None):
    """New (param, exp_avg, exp_avg_sq); written into `out` when given (which may be the inputs: each
    element is read before it is written, by the same program instance). With `skip` (a 0-d bool
    tensor) true, the old values. `grad_scale` (0-d) multiplies the widened gradient."""
    in_place = out is not None and all(o is i for o, i in zip(out, (param, exp_avg, exp_avg_sq)))
    if out is None:
        out = torch.empty_like(param), torch.empty_like(exp_avg), torch.empty_like(exp_avg_sq)
    out_p, out_m, out_v = out
    n = param.numel()
    if n:
        block = 1024
        _adamw_kernel[(triton.cdiv(n, block),)](param, grad, exp_avg, exp_avg_sq, out_p, out_m, out_v,
                                                decay.float(), step_size.float(), bc2.float(),
                                                skip if skip is not None else decay,
                                                grad_scale.float() if grad_scale is not None else decay,
                                                n, beta1, beta2, eps, BLOCK=block, SKIP=skip is not None,
                                                IN_PLACE=in_place, SCALE=grad_scale is not None,
                                                PTX=torch.version.hip is None)
    return out_p, out_m, out_v
