"""GPT: a dense decoder (token embedding, RMSNorm, causal RoPE attention, SwiGLU MLP, untied head)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.nn as nn
import torch.nn.functional as F
from .blocks import Attention, RMSNorm, SwiGLU, checkpointed, init_weights, rope_tables
from fxshard.errors import FxShardError


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 64
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_ff: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # activation checkpointing of each block: False, True (its inside computed again in the backward) or
    # "selective" (its matmuls' and attention's outputs kept, the rest computed again): blocks.checkpointed
    checkpoint_layers: bool | str = False

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        presets = {
            "tiny": cls(),
            "small": cls(vocab_size=32000, d_model=768, n_layer=12, n_head=12, d_ff=2048),     # ~134M
            "1b": cls(vocab_size=32000, d_model=2048, n_layer=18, n_head=16, d_ff=5632),       # ~1.06B
        }
        if name not in presets:
            raise FxShardError(f"unknown GPT preset {name!r}; choose from {sorted(presets)}")
        return replace(presets[name], **overrides)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg.d_model, cfg.n_head)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if not any(p.is_meta for p in self.parameters()):
            init_weights(self, cfg.n_layer)

    def forward(self, idx):
        x = self.tok_emb(idx)
        cos, sin = rope_tables(idx.shape[1], self.cfg.d_model // self.cfg.n_head, self.cfg.rope_theta, idx.device)
        for layer in self.layers:
            x = checkpointed(layer, x, cos, sin, mode=self.cfg.checkpoint_layers)
        return self.head(self.norm(x))

    def loss(self, batch):
        logits = self(batch["idx"])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["tgt"].flatten())
