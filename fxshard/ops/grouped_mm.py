"""`fxshard::grouped_mm`: one matmul per expert over contiguous row groups, the MoE experts' primitive.

    x        [T, in]       rows sorted by expert
    offsets  [E] int32     cumulative row ends: expert e owns rows offsets[e-1]:offsets[e]
    weight   [E, out, in]  (nn.Linear layout per expert)
    result   [T, out]      result[rows of e] = x[rows of e] @ weight[e].T; rows past offsets[-1] are 0

The backward is two separate graph nodes, the data gradient (`grouped_mm` again, on the transposed
weight) and the weight gradient (`grouped_mm_wgrad`), so schedulers can place them independently.
Where it runs is the grouped-MLP backend registry's choice (fxshard.ops.grouped_mlp_backends): on
a Hopper GPU in bf16, `torch._grouped_mm` with no host synchronization (so it can be captured in a
CUDA graph); elsewhere the reference loop over experts on the host (it reads the offsets there).
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("fxshard::grouped_mm", mutates_args=())
def grouped_mm(x: Tensor, offsets: Tensor, weight: Tensor) -> Tensor:
    from .grouped_mlp_backends import backend_for

    return backend_for(x, weight).gemm(x, offsets, weight).contiguous()


@grouped_mm.register_fake
def _grouped_mm_fake(x, offsets, weight):
    return x.new_empty(x.shape[0], weight.shape[1])


@torch.library.custom_op("fxshard::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(grad_out: Tensor, x: Tensor, offsets: Tensor, n_experts: int) -> Tensor:
    """[E, out, in]: grad_weight[e] = grad_out[rows of e].T @ x[rows of e] (zero for empty experts)."""
    from .grouped_mlp_backends import backend_for

    return backend_for(grad_out, x).gemm_wgrad(grad_out, x, offsets, n_experts)


@grouped_mm_wgrad.register_fake
def _grouped_mm_wgrad_fake(grad_out, x, offsets, n_experts):
    return grad_out.new_empty(n_experts, grad_out.shape[1], x.shape[1])


def _setup_context(ctx, inputs, output):
    x, offsets, weight = inputs
    ctx.save_for_backward(x, offsets, weight)


def _backward(ctx, grad_out):
    x, offsets, weight = ctx.saved_tensors
    grad_x = grouped_mm(grad_out, offsets, weight.transpose(1, 2)) if ctx.needs_input_grad[0] else None
    grad_weight = grouped_mm_wgrad(grad_out, x, offsets, weight.shape[0]) if ctx.needs_input_grad[2] else None
    return grad_x, None, grad_weight


grouped_mm.register_autograd(_backward, setup_context=_setup_context)
