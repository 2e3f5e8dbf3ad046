"""`fxshard::adamw_update`: one AdamW step on one tensor, a single graph node.

The reference implementation is the elementwise formula of torch.optim.AdamW (single-tensor path);
on CUDA, contiguous fp32 tensors take one fused Triton kernel that reads param, grad and both moments
once and writes them once (the unfused chain makes ~10 passes over each tensor). The gradient may
come in a narrower dtype than the parameter (bf16 gradients of fp32 masters): it is widened exactly
(as `grad.to(param.dtype)` would) where it is read, so no wide copy of it is ever written.
Per-step scalars (decay = 1 - lr*wd, step_size = lr / bias_correction1, bias_correction2_sqrt)
are 0-d tensors, so a schedule changes them without retracing or recapturing. `skip`, a 0-d bool
tensor, leaves all three tensors as they were when it is true (Config(nonfinite): a step whose
gradients are not finite), without a host synchronization and without reading them twice.
`grad_scale`, a 0-d float32 tensor, multiplies the widened gradient as it is loaded: the clipping
coefficient and the loss scale's inverse (fxshard/optimizer_graph.py), so no clipped or unscaled copy
of the gradient is written; the result is that of `adamw_update(param, grad.to(param.dtype) *
grad_scale, ...)` bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def adamw_reference(param, grad, exp_avg, exp_avg_sq, decay, step_size, bias_correction2_sqrt,
                    beta1: float, beta2: float, eps: float, grad_scale=None):
    grad = grad.to(param.dtype)
    if grad_scale is not None:
        grad = grad * grad_scale
    param = param * decay
    exp_avg = torch.lerp(exp_avg, grad, 1 - beta1)
    exp_avg_sq = torch.addcmul(exp_avg_sq * beta2, grad, grad, value=1 - beta2)
    denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
    if param.dtype in (torch.bfloat16, torch.float16):  # as torch's addcdiv_: in float32, rounded once
        return (param.float() + -step_size * exp_avg.float() / denom.float()).to(param.dtype), exp_avg, exp_avg_sq
    return param - step_size * (exp_avg / denom), exp_avg, exp_avg_sq


def _fused(param, grad, exp_avg, exp_avg_sq) -> bool:
    """The Triton kernel's case: CUDA, contiguous fp32 state, a contiguous fp32, bf16 or fp16 gradient."""
    return (param.is_cuda and all(t.dtype == torch.float32 and t.is_contiguous() for t in (param, exp_avg, exp_avg_sq))
            and grad.dtype in (torch.float32, torch.bfloat16, torch.float16) and grad.is_contiguous())


def _kept(skip, old, new):
    return new if skip is None else tuple(torch.where(skip, o, n) for o, n in zip(old, new))


@torch.library.custom_op("fxshard::adamw_update", mutates_args=())
def adamw_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, decay: Tensor,
                 step_size: Tensor, bias_correction2_sqrt: Tensor, beta1: float, beta2: float,
                 eps: float, skip: Optional[Tensor] = None,
                 grad_scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    if _fused(param, grad, exp_avg, exp_avg_sq):
        from ._triton_adamw import fused_adamw

        return fused_adamw(param, grad, exp_avg, exp_avg_sq, decay, step_size, bias_correction2_sqrt, beta1, beta2,
                           eps, skip=skip, grad_scale=grad_scale)
    new = adamw_reference(param, grad, exp_avg, exp_avg_sq, decay, step_size, bias_correction2_sqrt, beta1, beta2, eps,
                          grad_scale)
    return tuple(t.contiguous() for t in _kept(skip, (param, exp_avg, exp_avg_sq), new))


@torch.library.custom_op("fxshard::adamw_update_", mutates_args=("param", "exp_avg", "exp_avg_sq"))
def adamw_update_(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, decay: Tensor,
                  step_size: Tensor, bias_correction2_sqrt: Tensor, beta1: float, beta2: float,
                  eps: float, skip: Optional[Tensor] = None, grad_scale: Optional[Tensor] = None) -> None:
    """The same step written into `param`, `exp_avg` and `exp_avg_sq`: what the runtime lowers
    `adamw_update` to when nothing reads the old values afterwards (fxshard.runtime.reinplace)."""
    if _fused(param, grad, exp_avg, exp_avg_sq):
        from ._triton_adamw import fused_adamw

        fused_adamw(param, grad, exp_avg, exp_avg_sq, decay, step_size, bias_correction2_sqrt, beta1, beta2, eps,
                    out=(param, exp_avg, exp_avg_sq), skip=skip, grad_scale=grad_scale)
        return
    new = adamw_reference(param, grad, exp_avg, exp_avg_sq, decay, step_size, bias_correction2_sqrt, beta1, beta2, eps,
                          grad_scale)
    new = _kept(skip, (param, exp_avg, exp_avg_sq), new)
    for target, value in zip((param, exp_avg, exp_avg_sq), new):
        target.copy_(value)


@adamw_update.register_fake
def _adamw_update_fake(param, grad, exp_avg, exp_avg_sq, decay, step_size, bias_correction2_sqrt,
                       beta1, beta2, eps, skip=None, grad_scale=None):
    return torch.empty_like(param), torch.empty_like(exp_avg), torch.empty_like(exp_avg_sq)
