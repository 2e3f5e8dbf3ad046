"""Attention with sinks (GPT-OSS) on the fused attention kernels: `sink_attention`, and the swap that
traces transformers' GPT-OSS eager attention with it.

GPT-OSS gives each head a learned sink logit `s_h`: a column appended to every row of the attention
scores, taken into the softmax and then dropped. transformers computes that only eagerly (the
score matrix written out, a softmax over it, then a matmul), so a step spends a large share of its
time in memory-bound softmax kernels over B x H x S x S scores (40% of a GPT-OSS step on one H200,
bench/RESULTS.md).

With L the log-sum-exp of a row's scores (what the fused kernels return), the row's probabilities
with the sink are exp(score - L') for L' = log(exp(L) + exp(s_h)), so

    out_sink = out * exp(L - L')         (out: the attention without the sink)

and the backward is the fused kernel's backward called with L' in place of L and out_sink in place
of out: it recomputes the probabilities from the log-sum-exp it is given (the sink's included), and
its row term D = rowsum(dout * out_sink) is the softmax Jacobian's (the sink column has no value, so
it adds nothing to D). The sink's own gradient is -sum over rows of exp(s_h - L') * D.

The trace calls the memory-efficient kernel on CUDA (the only one that takes a mask and returns its
log-sum-exp for any dtype); in bf16 passes/causal_attention.py and passes/flash_attention.py then move
full and sliding-window layers to flash, whose backward takes L' alike.

Invariant: `sink_attention` computes the function transformers' `eager_attention_forward` of GPT-OSS
computes (outputs and the gradients of queries, keys, values and sinks), up to floating-point
rounding: the kernels accumulate in fp32 where the eager softmax runs in the scores' dtype. It is
used only where that holds: no dropout, the weights not asked for (`output_attentions`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

aten = torch.ops.aten


class _SinkAttention(torch.autograd.Function):
    """out_sink = attention(q, k, v, bias) * exp(L - L'): module docstring. q, k, v [B, H, S, D] with
    as many key/value heads as query heads; bias additive, broadcastable to [B, H, S, S], or None;
    sinks [H]."""

    @staticmethod
    def forward(ctx, q, k, v, bias, sinks, scale):
        rows = q.shape[-2]
        if q.is_cuda:
            out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
                q, k, v, bias, True, 0.0, False, scale=scale)
        else:
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                       scale=scale)
            seed = offset = None
        with_sink = torch.logaddexp(lse, sinks.float()[None, :, None])  # lse [B, H, rows (padded on CUDA)]
        kept = torch.exp(lse[..., :rows] - with_sink[..., :rows])
        out_sink = out * kept.unsqueeze(-1).to(out.dtype)
        ctx.save_for_backward(q, k, v, bias, sinks, out_sink, with_sink, seed, offset)
        ctx.scale = scale
        return out_sink

    @staticmethod
    def backward(ctx, grad):
        q, k, v, bias, sinks, out_sink, with_sink, seed, offset = ctx.saved_tensors
        grad = grad.contiguous()
        if q.is_cuda:
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                grad, q, k, v, bias, out_sink, with_sink, seed, offset, 0.0, [True, True, True, False], False,
                scale=ctx.scale)
        else:
            dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad, q, k, v, out_sink, with_sink, 0.0, False, attn_mask=bias, scale=ctx.scale)
        rows = q.shape[-2]
        d = (grad.float() * out_sink.float()).sum(-1)  # [B, H, rows]: the softmax Jacobian's row term
        sink_probability = torch.exp(sinks.float()[None, :, None] - with_sink[..., :rows])
        dsinks = -(sink_probability * d).sum(dim=(0, 2)).to(sinks.dtype)
        return dq, dk, dv, None, dsinks, None


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                   sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax([q k^T * scale + bias, sinks]) without the sink column, times v; [B, H, S, D] (module
    docstring). k and v have as many heads as q."""
    if bias is not None:
        bias = bias.to(q.dtype)
        if q.is_cuda:  # padded before it is expanded: the heads stay a stride-0 view
            bias = _aligned(bias)
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return _SinkAttention.apply(q, k, v, bias, sinks, scale)


def _aligned(bias: torch.Tensor) -> torch.Tensor:
    """`bias` with its rows 16-element aligned, as the memory-efficient kernel requires (what torch's
    scaled_dot_product_attention does to a mask: pad the last dimension, view the columns back)."""
    columns = bias.shape[-1]
    if columns % 16 == 0 and bias.stride(-1) == 1 and all(s % 16 == 0 for s, n in zip(bias.stride()[:-1],
                                                                                         bias.shape[:-1]) if n > 1):
        return bias
    padded = torch.nn.functional.pad(bias, (0, -columns % 16))
    return padded[..., :columns]


def _gpt_oss_attention(original, swapped: set):
    """transformers' GPT-OSS `eager_attention_forward`, on `sink_attention` where it computes the same
    function: no dropout, and the weights (its second result, then None) not asked for, by the config
    or by the call. `swapped` collects the modules whose calls ran `sink_attention`."""

    def forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        if dropout or kwargs.get("output_attentions"):
            return original(module, query, key, value, attention_mask, scaling, dropout=dropout, **kwargs)
        swapped.add(module)
        groups = module.num_key_value_groups
        key = key.repeat_interleave(groups, dim=1) if groups > 1 else key  # transformers' repeat_kv
        value = value.repeat_interleave(groups, dim=1) if groups > 1 else value
        mask = attention_mask[:, :, :, : key.shape[-2]] if attention_mask is not None else None
        out = sink_attention(query, key, value, mask, module.sinks.to(query.dtype), scaling)
        return out.transpose(1, 2).contiguous(), None
    return forward


@contextlib.contextmanager
def swapped_attention(model: nn.Module) -> Iterator[list[str]]:
    """While fxshard traces `model`: transformers' GPT-OSS attention layers on the eager
    implementation (the only one transformers ships for sinks without extra kernels) run
    `sink_attention`. Not where the model asks for attention weights. Yields a list that holds, once
    the block ends, a "path: how" line per layer whose calls ran it."""
    layers = [(path, module) for path, module in model.named_modules()
              if type(module).__name__ == "GptOssAttention"
              and type(module).__module__.startswith("transformers.models.gpt_oss")]
    config = getattr(layers[0][1], "config", None) if layers else None
    if not layers or getattr(config, "_attn_implementation", None) != "eager" or \
            getattr(config, "output_attentions", False):
        yield []
        return
    from transformers.models.gpt_oss import modeling_gpt_oss

    original, swapped, lines = modeling_gpt_oss.eager_attention_forward, set(), []
    modeling_gpt_oss.eager_attention_forward = _gpt_oss_attention(original, swapped)
    try:
        yield lines  # filled once the trace is done: the layers whose calls did run sink_attention
    finally:
        modeling_gpt_oss.eager_attention_forward = original
        lines.extend(f"{path}: GptOssAttention, transformers' eager attention with sinks traced as the fused "
                     f"attention kernel and a sink correction (fxshard/sink_attention.py: same function)"
                     for path, module in layers if module in swapped)
