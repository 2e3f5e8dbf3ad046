"""`fxshard::grouped_mm`: one matmul per expert over contiguous row groups, the MoE experts' primitive.

    x        [T, in]       rows sorted by expert
    offsets  [E] int32     cumulative row ends: expert e owns rows offsets[e-1]:offsets[e]
    weight   [E, out, in]  (nn.Linear layout per expert)
    capacity None or C     the row layout: ragged (None), or capacity slots (T = E*C, expert e's
                           rows are the first min(count_e, C) of rows e*C:(e+1)*C; see grouped_mlp.py)
    result   [T, out]      result[rows of e] = x[rows of e] @ weight[e].T; rows no expert owns: 0 in
                           the ragged layout, unspecified in the slot layout (the padding rows @
                           weight[e].T on the CUDA backend: finite when x's are; consumers ignore them)

The backward is two separate graph nodes, the data gradient (`grouped_mm` again, on the transposed
weight) and the weight gradient (`grouped_mm_wgrad`), so schedulers can place them independently.
Where it runs is the grouped-MLP backend registry's choice (fxshard.ops.grouped_mlp_backends): on
a Hopper GPU in bf16, `torch._grouped_mm` with no host synchronization (so it can be captured in a
CUDA graph); elsewhere the reference loop over experts on the host (it reads the offsets there).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


@torch.library.custom_op("fxshard::grouped_mm", mutates_args=())
def grouped_mm(x: Tensor, offsets: Tensor, weight: Tensor, capacity: Optional[int] = None) -> Tensor:
    from .grouped_mlp_backends import backend_for, check_slots

    check_slots("grouped_mm", x, weight.shape[0], capacity)
    return backend_for(x, weight).gemm(x, offsets, weight, capacity=capacity).contiguous()


@grouped_mm.register_fake
def _grouped_mm_fake(x, offsets, weight, capacity=None):
    from .grouped_mlp_backends import check_slots

    check_slots("grouped_mm", x, weight.shape[0], capacity)
    return x.new_empty(x.shape[0], weight.shape[1])


@torch.library.custom_op("fxshard::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(grad_out: Tensor, x: Tensor, offsets: Tensor, n_experts: int,
                     capacity: Optional[int] = None) -> Tensor:
    """[E, out, in]: grad_weight[e] = grad_out[rows of e].T @ x[rows of e] (zero for empty experts).
    With the arguments swapped, (x, grad_out), the same gradient in the [E, in, out] layout (what
    grouped_mm's backward makes for experts stored that way)."""
    from .grouped_mlp_backends import backend_for

    return backend_for(grad_out, x).gemm_wgrad(grad_out, x, offsets, n_experts, capacity=capacity)


@grouped_mm_wgrad.register_fake
def _grouped_mm_wgrad_fake(grad_out, x, offsets, n_experts, capacity=None):
    return grad_out.new_empty(n_experts, grad_out.shape[1], x.shape[1])


def _setup_context(ctx, inputs, output):
    x, offsets, weight, *capacity = inputs
    ctx.save_for_backward(x, offsets, weight)
    ctx.capacity = capacity[0] if capacity else None


def _backward(ctx, grad_out):
    x, offsets, weight = ctx.saved_tensors
    slots = () if ctx.capacity is None else (ctx.capacity,)  # ragged programs keep their three-argument calls
    grad_x = grouped_mm(grad_out, offsets, weight.transpose(1, 2), *slots) if ctx.needs_input_grad[0] else None
    grad_weight = None
    if ctx.needs_input_grad[2] and _stored_transposed(weight):
        # the weight is a view of experts stored [E, in, out] (Llama 4's, GPT-OSS's): its gradient made in
        # that layout, x^T grad per expert, so the parameter's gradient, cast and update read it contiguous
        # (a gradient [E, out, in] transposed into it made every step over it a strided copy)
        grad_weight = grouped_mm_wgrad(x, grad_out, offsets, weight.shape[0], *slots).transpose(1, 2)
    elif ctx.needs_input_grad[2]:
        grad_weight = grouped_mm_wgrad(grad_out, x, offsets, weight.shape[0], *slots)
    return grad_x, None, grad_weight, None


def _stored_transposed(weight: Tensor) -> bool:
    """`weight` [E, out, in] is the transpose of a contiguous [E, in, out] tensor."""
    return not weight.is_contiguous() and weight.transpose(1, 2).is_contiguous()


grouped_mm.register_autograd(_backward, setup_context=_setup_context)


class RouteGroupedMM(torch.overrides.TorchFunctionMode):
    """While tracing: grouped GEMMs of the MoE forward form (2-D rows, 3-D [E, in, out] weights, int32
    cumulative row ends `offs`, no bias) run as `fxshard::grouped_mm` on the transposed weight view,
    which computes the same rows. Caught: `torch._grouped_mm`, `F.grouped_mm` (any dtype) and
    transformers' `transformers::grouped_mm_fallback` (what its experts call while torch.compiler
    says it is compiling and the weights are not bf16). Other forms pass through.

    Why: `fxshard::grouped_mm` is the one expert GEMM the passes read (expert parallelism, the fused
    grouped MLP, `passes/recognize_moe.py`), with its data and weight gradients as separate nodes;
    and torch's fake kernel of `aten._grouped_mm` accepts only bf16 although the CPU kernel runs fp32,
    so an fp32 model calling it could not be traced. Where the op runs is the backend registry's
    choice (on a Hopper GPU in bf16, `torch._grouped_mm` itself)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GROUPED_MM_FUNCTIONS or _op_name(func) == "transformers::grouped_mm_fallback":
            routed = _route(*args, **kwargs)
            if routed is not None:
                return routed
        return func(*args, **kwargs)


_GROUPED_MM_FUNCTIONS = tuple(f for f in (getattr(torch, "_grouped_mm", None),
                                          getattr(torch.nn.functional, "grouped_mm", None)) if f is not None)


def _op_name(func) -> str | None:
    """"namespace::name" of a torch.ops operator (packet or overload), else None."""
    if isinstance(func, torch._ops.OpOverload):
        return func._schema.name
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name
    return None


def _route(mat_a, mat_b, offs=None, bias=None, out_dtype=None, **unknown):
    if (unknown or bias is not None or offs is None or mat_a.dim() != 2 or mat_b.dim() != 3
            or mat_b.dtype != mat_a.dtype or (out_dtype is not None and out_dtype != mat_a.dtype)):
        return None
    return grouped_mm(mat_a, offs.to(torch.int32), mat_b.transpose(-2, -1))
