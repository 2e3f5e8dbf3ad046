"""Pieces shared by the reference models: RMSNorm, rotary embeddings, causal attention, SwiGLU MLP."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
from fxshard.errors import FxShardError

aten = torch.ops.aten


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        x_float = x.float()
        normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [seq_len, head_dim // 2]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate the two halves of each head's features (GPT-NeoX layout). x: [B, H, S, D]."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)
    return rotated.type_as(x)


class Attention(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        if d_model % n_head:
            raise FxShardError(f"d_model {d_model} must be divisible by n_head {n_head} (each head takes "
                               f"d_model / n_head channels)")
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, cos, sin):
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_head, width // self.n_head).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, width))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.gate = nn.Linear(d_model, d_ff, bias=False)
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


# what "selective" checkpointing keeps: the matmuls' and attention's outputs (the compute-bound work);
# the rest of a block (norms, RoPE, the MLP's activation: memory-bound elementwise work) is computed again
SAVED_BY_SELECTIVE = [aten.mm.default, aten.addmm.default, aten.bmm.default,
                      aten._scaled_dot_product_flash_attention.default,
                      aten._scaled_dot_product_flash_attention_for_cpu.default,
                      aten._scaled_dot_product_efficient_attention.default,
                      aten._scaled_dot_product_cudnn_attention.default]
CHECKPOINT_MODES = (False, True, "full", "selective")


def checkpointed(layer: nn.Module, *args, mode: bool | str):
    """`layer(*args)`, under activation checkpointing per `mode` (a model config's checkpoint_layers):
    False: none; True or "full": everything inside computed again in the backward; "selective": the
    outputs of SAVED_BY_SELECTIVE kept (torch's selective checkpointing), the rest computed again."""
    if mode not in CHECKPOINT_MODES:
        raise FxShardError(f"checkpoint_layers={mode!r}: choose from {CHECKPOINT_MODES}")
    if not mode:
        return layer(*args)
    if mode == "selective":
        return checkpoint(layer, *args, use_reentrant=False, context_fn=selective_context)
    return checkpoint(layer, *args, use_reentrant=False)


def selective_context():
    """The context_fn of "selective" checkpointing: SAVED_BY_SELECTIVE's outputs kept."""
    return create_selective_checkpoint_contexts(SAVED_BY_SELECTIVE)


def init_weights(model: nn.Module, n_layer: int, std: float = 0.02) -> None:
    """Normal(0, std) for matrices, residual output projections scaled by 1/sqrt(2 n_layer)."""
    for name, p in model.named_parameters():
        if p.dim() < 2 or name.split(".")[-1].startswith("bias"):
            continue
        residual_out = name.endswith(("proj.weight", "down.weight")) or ".experts.fc2.weight" in name
        scale = 1 / math.sqrt(2 * n_layer) if residual_out else 1.0
        nn.init.normal_(p, mean=0.0, std=std * scale)
