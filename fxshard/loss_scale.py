"""Loss scaling for fp16 compute (Config(loss_scale)): torch.amp.GradScaler's arithmetic, in the step.

fp16 holds magnitudes from 6e-8 to 65504; gradients below the low end become zero. Scaling the loss by
S before the backward moves every gradient up by S, and the optimizer phase divides it out again, in
float32, before the gradient norm, clipping and the update.

- A static scale (`Config(loss_scale=1024.0)`) is a constant of the program: the loss tangent, the
  value the backward starts from, is `S / microbatches` instead of `1 / microbatches`, and the
  optimizer phase multiplies by `1 / S`. A power of two changes no bit of an fp32 step whose
  gradients stay in range.
- A dynamic scale (`Config(loss_scale="dynamic")` or a `LossScale`, the default under fp16) is
  training state: a program input and output of kind LOSS_SCALE holding [scale, good steps], read by
  the loss tangent and updated at the end of the optimizer phase as GradScaler updates its own. A
  step whose gradients are not finite (an overflow at this scale) is skipped, on every rank alike
  (Config(nonfinite) resolves to "skip"), and the scale multiplied by `backoff_factor`; after
  `growth_interval` applied steps in a row it is multiplied by `growth_factor`. Checkpoints save it
  with the step count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import FxShardError

NAME = "loss_scale"  # the LOSS_SCALE input's and output's name
# a scale S whose S and 1/S are both normal float32 numbers (the step multiplies by each in fp32)
LOWEST, HIGHEST = 2.0 ** -126, 2.0 ** 126
MAX_GROWTH_INTERVAL = 2 ** 24  # the count of good steps is a float32, exact up to here


def in_range(scale) -> bool:
    """Whether `scale` is a number the step can scale by and divide by in float32."""
    return isinstance(scale, (int, float)) and not isinstance(scale, bool) and LOWEST <= scale <= HIGHEST


@dataclass(frozen=True)
class LossScale:
    """A dynamic loss scale, with torch.amp.GradScaler's parameters and defaults."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self):
        def number(value):
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        if not in_range(self.init_scale):
            raise FxShardError(f"LossScale init_scale must be a number in [2**-126, 2**126] (it and its inverse "
                               f"float32's normal numbers), got {self.init_scale!r}")
        if not (number(self.growth_factor) and self.growth_factor > 1):
            raise FxShardError(f"LossScale growth_factor must be a number > 1, got {self.growth_factor!r}")
        if not (number(self.backoff_factor) and 0 < self.backoff_factor < 1):
            raise FxShardError(f"LossScale backoff_factor must be a number in (0, 1), got {self.backoff_factor!r}")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int) or \
                not 1 <= self.growth_interval <= MAX_GROWTH_INTERVAL:
            raise FxShardError(f"LossScale growth_interval must be an int in [1, 2**24] (the step counts good steps "
                               f"in float32), got {self.growth_interval!r}")

    def initial_state(self, device) -> torch.Tensor:
        """The LOSS_SCALE input's starting value: [init_scale, 0 good steps], float32."""
        return torch.tensor([self.init_scale, 0.0], dtype=torch.float32, device=device)

    def next_state(self, state: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        """GradScaler.update's rule, traced: a skipped step backs off and restarts the count; the
        `growth_interval`-th applied step in a row grows the scale (where the grown scale is finite)
        and restarts the count; else the count goes up by one."""
        scale, good = state[0], state[1] + 1
        grow = good >= self.growth_interval
        grown = scale * self.growth_factor
        grown = torch.where(torch.isfinite(grown), grown, scale)
        new_scale = torch.where(skip, scale * self.backoff_factor, torch.where(grow, grown, scale))
        new_good = torch.where(skip | grow, torch.zeros_like(good), good)
        return torch.stack([new_scale, new_good])


def resolve(loss_scale, param_dtype, reduce_dtype) -> float | LossScale | None:
    """Config(loss_scale) as the program applies it: None (no scaling), a static scale (a float other
    than 1), or a LossScale. None picks "dynamic" where fp16 computes or reduces, else no scaling."""
    if loss_scale is None:
        return LossScale() if torch.float16 in (param_dtype, reduce_dtype) else None
    if loss_scale == "dynamic":
        return LossScale()
    if isinstance(loss_scale, LossScale):
        return loss_scale
    if loss_scale is False:
        return None
    if in_range(loss_scale):
        return None if loss_scale == 1 else float(loss_scale)
    raise FxShardError(f"loss_scale={loss_scale!r}; choose \"dynamic\" (torch.amp.GradScaler's rule), "
                       f"fxshard.LossScale(init_scale=..., growth_interval=...), a number in [2**-126, 2**126] (a "
                       f"static scale: it and its inverse float32's normal numbers), False "
                       f"(none), or None (dynamic where param_dtype or reduce_dtype is torch.float16, else none)")
