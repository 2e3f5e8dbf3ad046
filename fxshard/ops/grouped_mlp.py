"""`fxshard::grouped_mlp`: an MoE expert MLP (grouped GEMM -> activation -> grouped GEMM) as one op.

    x        [T, D]        tokens sorted by expert
    offsets  [E] int32     cumulative row ends (expert e owns rows offsets[e-1]:offsets[e])
    w1       [E, H, D]     fc1, nn.Linear layout; H = 2F for gated activations (gate rows, then
                           linear rows: the plain "[W; V]" layout), H = F otherwise
    w2       [E, D, F]     fc2
    b1, b2   [E, H], [E, D] optional per-expert biases
    capacity None or C     the row layout (below)
    result   [T, D]        rows no expert owns are zero

Two row layouts. Ragged (capacity=None): expert e owns rows offsets[e-1]:offsets[e], rows past
offsets[-1] belong to no expert. Capacity slots (capacity=C, T = E*C): expert e owns the first
min(count_e, C) rows of its slot e*C:(e+1)*C, count_e = offsets[e] - offsets[e-1]; the rest of the
slot is padding. Rows no expert owns never reach a result (their outputs and input gradients are
zero), provided they hold finite values (a padding row with an Inf or NaN would make a weight
gradient NaN: the slot layout's GEMMs multiply them by zero rather than skip them). The slot layout
lets the CUDA backend run every GEMM as one cuBLAS batched GEMM over [E, C, .], which is much
faster than a grouped GEMM over ragged groups (see grouped_mlp_backends.CudaBackend), at the cost of
computing the padding.

Activations (`ACTIVATIONS`): `swiglu` silu(g)*u; `geglu` gelu_tanh(g)*u (Megatron's bias_geglu
uses the tanh approximation); `quick_geglu` the clamped variant Megatron added for GPT-OSS-style
experts: g' = min(g, limit), u' = clamp(u, -limit, limit), g'*sigmoid(1.702 g')*(u'+1);
non-gated `gelu` (exact erf) and `relu`.

Three graph nodes, so a scheduler can place them independently:
    grouped_mlp_fwd    -> (out, h)        h: fc1's output (pre-activation, bias added), saved;
                                          its rows past offsets[-1] are unspecified
    grouped_mlp_dgrad  -> (grad_x, grad_h, act)   act: the activation, recomputed from h
    grouped_mlp_wgrad  -> (grad_w1, grad_w2, grad_b1, grad_b2)  (bias grads are [0] without bias)
The forward keeps x and h only for the backward (an unfused graph keeps the gate's activation and
the F-wide product alive as well); the data-gradient part recomputes the activation in the same
kernel pass that differentiates it and hands it to the weight-gradient part.
Where the kernels run is a backend's choice (`fxshard.ops.grouped_mlp_backends`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..errors import FxShardError
from .grouped_mlp_backends import ACTIVATIONS, backend_for, check_slots, expert_of_rows


def _bias_rows(bias: Tensor, offsets: Tensor, rows: int, capacity: int | None = None) -> Tensor:
    """[T, width]: each row's expert's bias, zero for rows no expert owns."""
    padded = torch.cat([bias, bias.new_zeros(1, bias.shape[1])])
    return padded.index_select(0, expert_of_rows(offsets, rows, capacity))


def check_arguments(x, offsets, w1, w2, activation, capacity=None):
    """Raise FxShardError unless grouped_mlp takes these (x [T, D], w1 [E, F, D], w2 [E, D, F], E offsets)."""
    if activation not in ACTIVATIONS:
        raise FxShardError(f"grouped_mlp: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    width = w2.shape[2] * (2 if ACTIVATIONS[activation].gated else 1)
    if w1.shape[1] != width or w1.shape[2] != x.shape[1] or w2.shape[1] != x.shape[1] or \
            w1.shape[0] != w2.shape[0] or offsets.shape[0] != w1.shape[0]:
        raise FxShardError(f"grouped_mlp({activation}) shapes disagree: x {tuple(x.shape)}, offsets "
                           f"{tuple(offsets.shape)}, w1 {tuple(w1.shape)} (want [E, {width}, D]), w2 "
                           f"{tuple(w2.shape)}")
    check_slots("grouped_mlp", x, w1.shape[0], capacity)


@torch.library.custom_op("fxshard::grouped_mlp_fwd", mutates_args=())
def grouped_mlp_fwd(x: Tensor, offsets: Tensor, w1: Tensor, w2: Tensor, b1: Optional[Tensor],
                    b2: Optional[Tensor], activation: str, limit: float,
                    capacity: Optional[int] = None) -> tuple[Tensor, Tensor]:
    check_arguments(x, offsets, w1, w2, activation, capacity)
    backend = backend_for(x, w1, w2)
    h = backend.gemm(x, offsets, w1, zero_tail=False, capacity=capacity)  # the activation kernels mask
    if b1 is not None:                                                     # the rows no expert owns
        h = h + _bias_rows(b1, offsets, x.shape[0], capacity)
    out = backend.gemm(backend.act(h, offsets, activation, limit, capacity), offsets, w2, capacity=capacity)
    if b2 is not None:
        out = out + _bias_rows(b2, offsets, x.shape[0], capacity)
    return out, h


@grouped_mlp_fwd.register_fake
def _fwd_fake(x, offsets, w1, w2, b1, b2, activation, limit, capacity=None):
    check_arguments(x, offsets, w1, w2, activation, capacity)
    return x.new_empty(x.shape[0], w2.shape[1]), x.new_empty(x.shape[0], w1.shape[1])


@torch.library.custom_op("fxshard::grouped_mlp_dgrad", mutates_args=())
def grouped_mlp_dgrad(grad_out: Tensor, h: Tensor, offsets: Tensor, w1: Tensor, w2: Tensor, activation: str,
                      limit: float, capacity: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor]:
    backend = backend_for(grad_out, w1, w2)
    grad_act = backend.gemm(grad_out, offsets, w2.transpose(1, 2), zero_tail=False,  # masked by act_backward
                            capacity=capacity)
    grad_h, act = backend.act_backward(h, grad_act, offsets, activation, limit, capacity)
    return backend.gemm(grad_h, offsets, w1.transpose(1, 2), capacity=capacity), grad_h, act


@grouped_mlp_dgrad.register_fake
def _dgrad_fake(grad_out, h, offsets, w1, w2, activation, limit, capacity=None):
    return (grad_out.new_empty(grad_out.shape[0], w1.shape[2]), torch.empty_like(h),
            h.new_empty(h.shape[0], w2.shape[2]))


@torch.library.custom_op("fxshard::grouped_mlp_wgrad", mutates_args=())
def grouped_mlp_wgrad(grad_out: Tensor, grad_h: Tensor, x: Tensor, act: Tensor, offsets: Tensor,
                      with_bias: bool, capacity: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    backend = backend_for(x, grad_h, grad_out)
    experts = offsets.shape[0]
    grad_w1 = backend.gemm_wgrad(grad_h, x, offsets, experts, capacity=capacity)
    grad_w2 = backend.gemm_wgrad(grad_out, act, offsets, experts, capacity=capacity)
    if not with_bias:
        return grad_w1, grad_w2, grad_h.new_zeros(0), grad_out.new_zeros(0)
    return grad_w1, grad_w2, _segment_sum(grad_h, offsets, capacity), _segment_sum(grad_out, offsets, capacity)


@grouped_mlp_wgrad.register_fake
def _wgrad_fake(grad_out, grad_h, x, act, offsets, with_bias, capacity=None):
    experts = offsets.shape[0]
    w1 = grad_h.new_empty(experts, grad_h.shape[1], x.shape[1])
    w2 = grad_out.new_empty(experts, grad_out.shape[1], act.shape[1])
    if not with_bias:
        return w1, w2, grad_h.new_empty(0), grad_out.new_empty(0)
    return w1, w2, grad_h.new_empty(experts, grad_h.shape[1]), grad_out.new_empty(experts, grad_out.shape[1])


def _segment_sum(rows: Tensor, offsets: Tensor, capacity: int | None = None) -> Tensor:
    """[E, width]: the sum of each expert's rows (rows no expert owns ignored)."""
    experts = offsets.shape[0]
    accumulate = torch.promote_types(rows.dtype, torch.float32)  # bf16 rows sum in fp32
    sums = rows.new_zeros(experts + 1, rows.shape[1], dtype=accumulate)
    sums.index_add_(0, expert_of_rows(offsets, rows.shape[0], capacity), rows.to(accumulate))
    return sums[:experts].to(rows.dtype)


def _setup_context(ctx, inputs, output):
    x, offsets, w1, w2, b1, b2, activation, limit, *capacity = inputs
    ctx.save_for_backward(x, offsets, w1, w2, output[1])
    ctx.set_materialize_grads(False)  # h's gradient arrives as None unless someone differentiates h
    ctx.activation, ctx.limit, ctx.with_bias = activation, limit, b1 is not None or b2 is not None
    ctx.capacity = capacity[0] if capacity else None


def _backward(ctx, grad_out, grad_h_output):
    x, offsets, w1, w2, h = ctx.saved_tensors
    if grad_h_output is not None:
        raise RuntimeError("grouped_mlp_fwd's h output is for the backward only; do not differentiate through it")
    if grad_out is None:
        return (None,) * 9
    slots = () if ctx.capacity is None else (ctx.capacity,)  # ragged programs keep their shorter calls
    grad_x, grad_h, act = grouped_mlp_dgrad(grad_out, h, offsets, w1, w2, ctx.activation, ctx.limit, *slots)
    grad_w1, grad_w2, grad_b1, grad_b2 = grouped_mlp_wgrad(grad_out, grad_h, x, act, offsets, ctx.with_bias, *slots)
    wants = ctx.needs_input_grad
    return (grad_x if wants[0] else None, None, grad_w1 if wants[2] else None, grad_w2 if wants[3] else None,
            grad_b1 if wants[4] else None, grad_b2 if wants[5] else None, None, None, None)


grouped_mlp_fwd.register_autograd(_backward, setup_context=_setup_context)


def grouped_mlp(x: Tensor, offsets: Tensor, w1: Tensor, w2: Tensor, b1: Tensor | None = None,
                b2: Tensor | None = None, activation: str = "swiglu", limit: float = 7.0,
                capacity: int | None = None) -> Tensor:
    """The fused expert MLP (see the module docstring); `limit` is quick_geglu's clamp; `capacity`
    selects the slot layout (None: ragged rows)."""
    return grouped_mlp_fwd(x, offsets, w1, w2, b1, b2, activation, float(limit), capacity)[0]


def grouped_mlp_reference(x, offsets, w1, w2, b1=None, b2=None, activation="swiglu", limit=7.0):
    """The unfused composition, differentiable through plain autograd: fxshard::grouped_mm, the
    activation written in PyTorch, fxshard::grouped_mm. What the fused op must equal."""
    from .grouped_mm import grouped_mm

    h = grouped_mm(x, offsets, w1)
    if b1 is not None:
        h = h + _bias_rows(b1, offsets, x.shape[0])
    out = grouped_mm(ACTIVATIONS[activation].torch(h, limit), offsets, w2)
    if b2 is not None:
        out = out + _bias_rows(b2, offsets, x.shape[0])
    return out
