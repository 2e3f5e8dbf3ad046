"""MoEGPT: GPT with mixture-of-experts MLPs (top-k softmax router, optional shared expert).

The experts run through `fxshard.ops.grouped_mm` on tokens sorted by expert, the primitive that the
expert-parallel and fused-grouped-MLP passes rewrite. Every shape is static: routing sorts the T*k
(token, expert) assignments, so no token is dropped on a single device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxshard import moe
from fxshard.checkpoint import ExpertLayout
from fxshard.ops import grouped_mm

from .blocks import Attention, RMSNorm, SwiGLU, checkpointed, init_weights, rope_tables
from .grouped_linear import GroupedLinear
from fxshard.errors import FxShardError


@dataclass(frozen=True)
class MoEGPTConfig:
    vocab_size: int = 64
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_expert: int = 4
    top_k: int = 2
    d_ff_expert: int = 64
    d_ff_shared: int | None = 64      # None: no shared expert
    normalize_top_k: bool = True      # renormalize the k routing weights to sum to 1
    aux_loss_coef: float = 0.01       # load-balancing loss weight, per MoE layer
    expert_weights: str = "grouped"   # "grouped" ([E, out, in] parameters) or "indexed" (weight0...)
    glu_interleave_size: int | None = None  # fc1 rows stored GLU-interleaved in blocks of this size
    capacity_factor: float | None = None    # None: dropless; else fxshard.moe's per-expert capacity
    expert_slots: bool = False        # rows in capacity slots (needs capacity_factor): batched expert GEMMs
    # "learned": top-k of the router; "balanced" (benchmarks only, Megatron's force-load-balancing in
    # spirit): token i goes to experts (i*k + j) mod E, weighted by the router's probabilities of
    # them, so every expert receives exactly T*k/E rows and nothing is dropped at capacity 1.0
    routing: str = "learned"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    checkpoint_layers: bool | str = False  # as GPTConfig's: False, True or "selective"

    @classmethod
    def preset(cls, name: str, **overrides) -> "MoEGPTConfig":
        presets = {
            "tiny": cls(),
            "small": cls(vocab_size=32000, d_model=768, n_layer=12, n_head=12, n_expert=8, top_k=2,
                         d_ff_expert=1024, d_ff_shared=None),                                  # ~290M
            "1b": cls(vocab_size=32000, d_model=1024, n_layer=16, n_head=16, n_expert=32, top_k=4,
                      d_ff_expert=512, d_ff_shared=None),                                      # ~0.94B
        }
        if name not in presets:
            raise FxShardError(f"unknown MoEGPT preset {name!r}; choose from {sorted(presets)}")
        return replace(presets[name], **overrides)


class GroupedExperts(nn.Module):
    """E SwiGLU experts: fc1 [E, 2F, D] (gate rows, then up rows), fc2 [E, D, F], in any storage
    layout (models.GroupedLinear); the forward always sees grouped, plain-row weights."""

    def __init__(self, n_expert: int, d_model: int, d_ff: int, layout: str = "grouped",
                 glu_interleave_size: int | None = None):
        super().__init__()
        self.fc1 = GroupedLinear(n_expert, d_model, 2 * d_ff, layout=ExpertLayout(layout, glu_interleave_size),
                                 glu=True, init_std=0.02)
        self.fc2 = GroupedLinear(n_expert, d_ff, d_model, layout=ExpertLayout(layout), init_std=0.02)

    def forward(self, tokens, offsets, capacity=None):
        """`capacity`: the rows are in capacity slots of that size (fxshard.moe.dispatch(slots=True))."""
        slots = () if capacity is None else (capacity,)
        gate, up = grouped_mm(tokens, offsets, self.fc1.weight_grouped(), *slots).chunk(2, dim=-1)
        return grouped_mm(F.silu(gate) * up, offsets, self.fc2.weight_grouped(), *slots)


class MoE(nn.Module):
    def __init__(self, cfg: MoEGPTConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.d_model, cfg.n_expert, bias=False)
        self.experts = GroupedExperts(cfg.n_expert, cfg.d_model, cfg.d_ff_expert, cfg.expert_weights,
                                      cfg.glu_interleave_size)
        self.shared = SwiGLU(cfg.d_model, cfg.d_ff_shared) if cfg.d_ff_shared else None
        if cfg.routing not in ("learned", "balanced"):
            raise FxShardError(f"MoEGPTConfig(routing={cfg.routing!r}): choose 'learned' or 'balanced'")

    def forward(self, x):
        """Returns (output, load-balancing loss, dropped assignments)."""
        batch, seq, width = x.shape
        tokens = x.reshape(-1, width)
        n_expert, k = self.cfg.n_expert, self.cfg.top_k
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        if self.cfg.routing == "balanced":
            position = torch.arange(tokens.shape[0], device=x.device)[:, None] * k
            chosen = (position + torch.arange(k, device=x.device)) % n_expert
            weights = probs.gather(-1, chosen)
        else:
            weights, chosen = probs.topk(k, dim=-1)
        if self.cfg.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        routed = moe.dispatch(tokens, chosen, n_expert, self.cfg.capacity_factor, slots=self.cfg.expert_slots,
                              distinct=k <= n_expert)  # a top-k, or k consecutive experts mod n_expert
        expert_out = self.experts(routed.rows, routed.offsets, routed.capacity if routed.slots else None)
        out = moe.combine(expert_out, routed, weights, tokens.shape[0])
        if self.shared is not None:
            out = out + self.shared(tokens)
        # Switch-style balance loss over all assignments (before any drop):
        # E * sum_e (fraction of assignments to e) * (mean probability of e).
        flat_expert = chosen.reshape(-1)
        counts = torch.zeros(n_expert, dtype=torch.long, device=x.device).scatter_add(
            0, flat_expert, torch.ones_like(flat_expert))
        aux = n_expert * (counts.float() / flat_expert.numel() * probs.mean(0)).sum()
        return out.view(batch, seq, width), aux, routed.dropped


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEGPTConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg.d_model, cfg.n_head)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        moe_out, aux, dropped = self.moe(self.mlp_norm(x))
        return x + moe_out, aux, dropped


class MoEGPT(nn.Module):
    def __init__(self, cfg: MoEGPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if not any(p.is_meta for p in self.parameters()):
            init_weights(self, cfg.n_layer)

    def forward_with_aux(self, idx):
        """(logits, summed load-balancing loss of all MoE layers, dropped assignments of all layers)."""
        x = self.tok_emb(idx)
        cos, sin = rope_tables(idx.shape[1], self.cfg.d_model // self.cfg.n_head, self.cfg.rope_theta, idx.device)
        aux_total = x.new_zeros((), dtype=torch.float32)
        dropped_total = torch.zeros((), dtype=torch.long, device=idx.device)
        for layer in self.layers:
            x, aux, dropped = checkpointed(layer, x, cos, sin, mode=self.cfg.checkpoint_layers)
            aux_total = aux_total + aux
            dropped_total = dropped_total + dropped
        return self.head(self.norm(x)), aux_total, dropped_total

    def forward(self, idx):
        return self.forward_with_aux(idx)[0]

    def loss(self, batch):
        return self.loss_and_metrics(batch)[0]

    def loss_and_metrics(self, batch):
        """(loss, {"moe_dropped_tokens": assignments dropped over capacity, all layers}): a loss_fn
        for fxshard.shard that also reports drops in the step's metrics."""
        logits, aux, dropped = self.forward_with_aux(batch["idx"])
        ce = F.cross_entropy(logits.flatten(0, 1).float(), batch["tgt"].flatten())
        return ce + self.cfg.aux_loss_coef * aux, {"moe_dropped_tokens": dropped}
