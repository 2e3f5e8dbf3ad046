"""`fxshard::grouped_mlp`: an MoE expert MLP (grouped GEMM -> activation -> grouped GEMM) as one op.

    x        [T, D]        tokens sorted by expert
    offsets  [E] int32     cumulative row ends (expert e owns rows offsets[e-1]:offsets[e])
    w1       [E, H, D]     fc1, nn.Linear layout; H = 2F for gated activations (gate rows, then
                           linear rows: the plain "[W; V]" layout), H = F otherwise
    w2       [E, D, F]     fc2
    b1, b2   [E, H], [E, D] optional per-expert biases
    result   [T, D]        rows past offsets[-1] are zero

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

from .grouped_mlp_backends import ACTIVATIONS, backend_for, expert_of_rows


def _bias_rows(bias: Tensor, offsets: Tensor, rows: int) -> Tensor:
    """[T, width]: each row's expert's bias, zero for rows past offsets[-1]."""
    padded = torch.cat([bias, bias.new_zeros(1, bias.shape[1])])
    return padded.index_select(0, expert_of_rows(offsets, rows))


def _check(x, offsets, w1, w2, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    width = w2.shape[2] * (2 if ACTIVATIONS[activation].gated else 1)
    if w1.shape[1] != width or w1.shape[2] != x.shape[1] or w2.shape[1] != x.shape[1] or \
            w1.shape[0] != w2.shape[0] or offsets.shape[0] != w1.shape[0]:
        raise ValueError(f"grouped_mlp({activation}) shapes disagree: x {tuple(x.shape)}, offsets "
                         f"{tuple(offsets.shape)}, w1 {tuple(w1.shape)} (want [E, {width}, D]), w2 {tuple(w2.shape)}")


@torch.library.custom_op("fxshard::grouped_mlp_fwd", mutates_args=())
def grouped_mlp_fwd(x: Tensor, offsets: Tensor, w1: Tensor, w2: Tensor, b1: Optional[Tensor],
                    b2: Optional[Tensor], activation: str, limit: float) -> tuple[Tensor, Tensor]:
    _check(x, offsets, w1, w2, activation)
    backend = backend_for(x, w1, w2)
    h = backend.gemm(x, offsets, w1, zero_tail=False)  # the activation kernels mask rows past the end
    if b1 is not None:
        h = h + _bias_rows(b1, offsets, x.shape[0])
    out = backend.gemm(backend.act(h, offsets, activation, limit), offsets, w2)
    if b2 is not None:
        out = out + _bias_rows(b2, offsets, x.shape[0])
    return out, h


@grouped_mlp_fwd.register_fake
def _fwd_fake(x, offsets, w1, w2, b1, b2, activation, limit):
    _check(x, offsets, w1, w2, activation)
    return x.new_empty(x.shape[0], w2.shape[1]), x.new_empty(x.shape[0], w1.shape[1])


@torch.library.custom_op("fxshard::grouped_mlp_dgrad", mutates_args=())
def grouped_mlp_dgrad(grad_out: Tensor, h: Tensor, offsets: Tensor, w1: Tensor, w2: Tensor, activation: str,
                      limit: float) -> tuple[Tensor, Tensor, Tensor]:
    backend = backend_for(grad_out, w1, w2)
    grad_act = backend.gemm(grad_out, offsets, w2.transpose(1, 2), zero_tail=False)  # masked by act_backward
    grad_h, act = backend.act_backward(h, grad_act, offsets, activation, limit)
    return backend.gemm(grad_h, offsets, w1.transpose(1, 2)), grad_h, act


@grouped_mlp_dgrad.register_fake
def _dgrad_fake(grad_out, h, offsets, w1, w2, activation, limit):
    return (grad_out.new_empty(grad_out.shape[0], w1.shape[2]), torch.empty_like(h),
            h.new_empty(h.shape[0], w2.shape[2]))


@torch.library.custom_op("fxshard::grouped_mlp_wgrad", mutates_args=())
def grouped_mlp_wgrad(grad_out: Tensor, grad_h: Tensor, x: Tensor, act: Tensor, offsets: Tensor,
                      with_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    backend = backend_for(x, grad_h, grad_out)
    experts = offsets.shape[0]
    grad_w1 = backend.gemm_wgrad(grad_h, x, offsets, experts)
    grad_w2 = backend.gemm_wgrad(grad_out, act, offsets, experts)
    if not with_bias:
        return grad_w1, grad_w2, grad_h.new_zeros(0), grad_out.new_zeros(0)
    return grad_w1, grad_w2, _segment_sum(grad_h, offsets), _segment_sum(grad_out, offsets)


@grouped_mlp_wgrad.register_fake
def _wgrad_fake(grad_out, grad_h, x, act, offsets, with_bias):
    experts = offsets.shape[0]
    w1 = grad_h.new_empty(experts, grad_h.shape[1], x.shape[1])
    w2 = grad_out.new_empty(experts, grad_out.shape[1], act.shape[1])
    if not with_bias:
        return w1, w2, grad_h.new_empty(0), grad_out.new_empty(0)
    return w1, w2, grad_h.new_empty(experts, grad_h.shape[1]), grad_out.new_empty(experts, grad_out.shape[1])


def _segment_sum(rows: Tensor, offsets: Tensor) -> Tensor:
    """[E, width]: the sum of each expert's rows (rows past offsets[-1] ignored)."""
    experts = offsets.shape[0]
    accumulate = torch.promote_types(rows.dtype, torch.float32)  # bf16 rows sum in fp32
    sums = rows.new_zeros(experts + 1, rows.shape[1], dtype=accumulate)
    sums.index_add_(0, expert_of_rows(offsets, rows.shape[0]), rows.to(accumulate))
    return sums[:experts].to(rows.dtype)


def _setup_context(ctx, inputs, output):
    x, offsets, w1, w2, b1, b2, activation, limit = inputs
    ctx.save_for_backward(x, offsets, w1, w2, output[1])
    ctx.set_materialize_grads(False)  # h's gradient arrives as None unless someone differentiates h
    ctx.activation, ctx.limit, ctx.with_bias = activation, limit, b1 is not None or b2 is not None


def _backward(ctx, grad_out, grad_h_output):
    x, offsets, w1, w2, h = ctx.saved_tensors
    if grad_h_output is not None:
        raise RuntimeError("grouped_mlp_fwd's h output is for the backward only; do not differentiate through it")
    if grad_out is None:
        return (None,) * 8
    grad_x, grad_h, act = grouped_mlp_dgrad(grad_out, h, offsets, w1, w2, ctx.activation, ctx.limit)
    grad_w1, grad_w2, grad_b1, grad_b2 = grouped_mlp_wgrad(grad_out, grad_h, x, act, offsets, ctx.with_bias)
    wants = ctx.needs_input_grad
    return (grad_x if wants[0] else None, None, grad_w1 if wants[2] else None, grad_w2 if wants[3] else None,
            grad_b1 if wants[4] else None, grad_b2 if wants[5] else None, None, None)


grouped_mlp_fwd.register_autograd(_backward, setup_context=_setup_context)


def grouped_mlp(x: Tensor, offsets: Tensor, w1: Tensor, w2: Tensor, b1: Tensor | None = None,
                b2: Tensor | None = None, activation: str = "swiglu", limit: float = 7.0) -> Tensor:
    """The fused expert MLP (see the module docstring); `limit` is quick_geglu's clamp."""
    return grouped_mlp_fwd(x, offsets, w1, w2, b1, b2, activation, float(limit))[0]


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
