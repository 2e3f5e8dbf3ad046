"""Config: every switch of the compiler in one frozen dataclass. Later features add fields, never rename."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import FxShardError


@dataclass(frozen=True)
class Config:
    """How `fxshard.shard` compiles a step.

    dump_dir: write the traced program and the program after every pass there (also `FXSHARD_DUMP`).
    layers: module paths (globs allowed, e.g. "blocks.*") whose modules are one layer each; default:
        the children of the model's largest ModuleList/Sequential of same-type blocks.
    clip_grad_norm: clip gradients to this global L2 norm before the update (None: no clipping).
    sharding: on a mesh, what FSDP shards over `dp` (Megatron's names): "no_shard" (DDP), "optim"
        (ZeRO-1), "optim_grads" (ZeRO-2), "optim_grads_params" (ZeRO-3).
    fsdp_prefetch: issue a unit's all-gather this many units ahead of its first use.
    """

    dump_dir: str | None = None
    layers: tuple[str, ...] | None = None
    clip_grad_norm: float | None = None
    sharding: str = "optim_grads_params"
    fsdp_prefetch: int = 1
    verbose: bool = False

    def __post_init__(self):
        if self.layers is not None:
            if isinstance(self.layers, str):
                object.__setattr__(self, "layers", (self.layers,))
            object.__setattr__(self, "layers", tuple(self.layers))
        strategies = ("no_shard", "optim", "optim_grads", "optim_grads_params")
        if self.sharding not in strategies:
            raise FxShardError(f"sharding={self.sharding!r}; choose one of {strategies}")
        if not isinstance(self.fsdp_prefetch, int) or self.fsdp_prefetch < 0:
            raise FxShardError(f"fsdp_prefetch must be an int >= 0, got {self.fsdp_prefetch!r}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise FxShardError(f"clip_grad_norm must be > 0 or None, got {self.clip_grad_norm!r}")
