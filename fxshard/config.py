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
    """

    dump_dir: str | None = None
    layers: tuple[str, ...] | None = None
    clip_grad_norm: float | None = None
    verbose: bool = False

    def __post_init__(self):
        if self.layers is not None:
            if isinstance(self.layers, str):
                object.__setattr__(self, "layers", (self.layers,))
            object.__setattr__(self, "layers", tuple(self.layers))
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise FxShardError(f"clip_grad_norm must be > 0 or None, got {self.clip_grad_norm!r}")
