"""Functional optimizers, traced into the program's `optim` phase.

Each optimizer is a small frozen description plus three pure functions: `init_state(param)` gives
the slots for one parameter, `scalars(lr, step)` the per-step values shared by all parameters (traced
once), and `update(param, grad, state, scalars)` the new parameter and slots. When the program guards
against non-finite gradients (Config(nonfinite)), `scalars["skip"]` is a 0-d bool tensor: where it is
true, `update` returns the parameter and slots unchanged.
The learning rate and the step count are 0-d tensors, program inputs, so a schedule changes them
without retracing. Semantics match `torch.optim.AdamW` / `torch.optim.SGD` (single-tensor path).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Callable, Union

import torch

from .errors import FxShardError

LearningRate = Union[float, Callable[[int], float]]


def _check_lr(lr) -> None:
    if not callable(lr) and not (_is_number(lr) and lr >= 0 and math.isfinite(lr)):
        raise FxShardError(f"lr must be a non-negative float or a callable step -> float, got {lr!r}")
    if callable(lr):
        try:
            inspect.signature(lr).bind(1)
        except TypeError as error:
            raise FxShardError(f"the lr schedule {getattr(lr, '__qualname__', lr)!r} cannot be called as lr(step) "
                               f"({error}); it is called with the 1-based step number, e.g. "
                               f"lambda step: 1e-3 * min(1, step / 100)") from None
        except ValueError:  # no signature to read (some builtins): its first call says
            pass


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_patterns(owner: str, optimizer) -> None:
    """`no_decay` as a tuple of strings (a single string would be read as its characters)."""
    patterns = optimizer.no_decay
    if isinstance(patterns, str) or not isinstance(patterns, (tuple, list)) or \
            not all(isinstance(p, str) and p for p in patterns):
        raise FxShardError(f"{owner} no_decay must be a tuple of parameter-name patterns, non-empty strings "
                           f"(fnmatch: '*.bias', '*norm*'), got {patterns!r}")
    object.__setattr__(optimizer, "no_decay", tuple(patterns))


class _Decay:
    """Weight decay by parameter name, shared by the optimizers: `no_decay` patterns (fnmatch, matched
    against the names `model.named_parameters()` gives) exempt parameters from weight decay, as a
    torch.optim parameter group with weight_decay=0 does (biases and norms, in most recipes)."""

    def decays(self, name: str) -> bool:
        """Whether the update of parameter `name` applies the weight decay: False where a `no_decay`
        pattern names it, unless the decay is 0 anyway (then every parameter updates alike, and fsdp
        need not give the named ones units of their own)."""
        return self.weight_decay == 0 or not any(fnmatchcase(name, p) for p in self.no_decay)

    def without_decay(self):
        """This optimizer for the parameters `no_decay` names: the same, with weight_decay 0."""
        return dataclasses.replace(self, weight_decay=0.0, no_decay=())

    def takes_grad_scale(self, param: torch.Tensor) -> bool:
        """Whether `update` applies `scalars["grad_scale"]` (a 0-d float32 multiplier of the gradient,
        clipping's and the loss scale's) itself, exactly as `grad.to(param.dtype) * grad_scale` would;
        else the optimizer phase multiplies the gradient before handing it over."""
        return False


def _check_numbers(owner: str, low: float, **values) -> None:
    """Each value a finite number >= `low` (torch.optim refuses the rest; a NaN would make every
    parameter NaN at the first update, while the gradients stay finite)."""
    for name, value in values.items():
        if not (_is_number(value) and math.isfinite(value) and value >= low):
            raise FxShardError(f"{owner} {name} must be a finite number >= {low}, got {value!r}")


@dataclass(frozen=True)
class AdamW(_Decay):
    """torch.optim.AdamW's update (decoupled weight decay, bias-corrected moments; default
    weight_decay 1e-2, as torch's), traced into the step's optimizer phase as one fused
    `fxshard::adamw_update` per tensor. `lr` is a number or a schedule `lr(step)` (1 for the first
    step); `no_decay` holds fnmatch patterns over `model.named_parameters()` names that train with
    weight_decay 0. Its state is two slots per parameter, `exp_avg` and `exp_avg_sq`."""

    lr: LearningRate = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    no_decay: tuple[str, ...] = ()  # parameter-name patterns without weight decay (_Decay)

    slots = ("exp_avg", "exp_avg_sq")

    def __post_init__(self):
        _check_lr(self.lr)
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2
                and all(_is_number(b) and 0.0 <= b < 1.0 for b in self.betas)):
            raise FxShardError(f"AdamW betas must be two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(self.betas))
        _check_numbers("AdamW", 0.0, eps=self.eps, weight_decay=self.weight_decay)
        _check_patterns("AdamW", self)

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}

    def scalars(self, lr, step):
        # the bias corrections in fp64, as torch.optim.AdamW's host floats: in fp32, 1 - 0.999 ** 1
        # cancels to 6e-6 relative error in the first steps' updates; the scalars the update reads stay fp32
        beta1, beta2 = self.betas
        step = step.to(torch.float64)
        return {"decay": 1 - lr * self.weight_decay,
                "step_size": (lr.to(torch.float64) / (1 - torch.pow(beta1, step))).to(lr.dtype),
                "bias_correction2_sqrt": torch.sqrt(1 - torch.pow(beta2, step)).to(lr.dtype)}

    def takes_grad_scale(self, param: torch.Tensor) -> bool:
        return param.dtype == torch.float32  # the masters the fused kernel updates

    def update(self, param, grad, state, scalars):
        from .ops.adamw import adamw_update  # one node per tensor; fused on CUDA; takes a bf16 grad as is

        beta1, beta2 = self.betas
        scale = (scalars["grad_scale"],) if "grad_scale" in scalars else ()  # the node as before where none
        param, exp_avg, exp_avg_sq = adamw_update(
            param, grad, state["exp_avg"], state["exp_avg_sq"], scalars["decay"], scalars["step_size"],
            scalars["bias_correction2_sqrt"], beta1, beta2, self.eps, scalars.get("skip"), *scale)
        return param, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


@dataclass(frozen=True)
class SGD(_Decay):
    """torch.optim.SGD's update, with its `momentum`, `dampening`, `nesterov` and (coupled, L2)
    `weight_decay`, all 0 / False by default as torch's; `lr` and `no_decay` as AdamW's. With
    momentum it keeps one slot per parameter, `momentum_buffer`."""

    lr: LearningRate = 1e-3
    momentum: float = 0.0
    weight_decay: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    no_decay: tuple[str, ...] = ()  # parameter-name patterns without weight decay (_Decay)

    def __post_init__(self):
        _check_lr(self.lr)
        _check_numbers("SGD", 0.0, momentum=self.momentum, weight_decay=self.weight_decay, dampening=self.dampening)
        _check_patterns("SGD", self)
        if not isinstance(self.nesterov, bool):
            raise FxShardError(f"SGD nesterov must be True or False, got {self.nesterov!r}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise FxShardError("SGD nesterov needs momentum > 0 and dampening == 0 (as torch.optim.SGD)")

    @property
    def slots(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum else ()

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"momentum_buffer": torch.zeros_like(param)} if self.momentum else {}

    def scalars(self, lr, step):
        return {"lr": lr, "is_first_step": step == 1}

    def update(self, param, grad, state, scalars):
        grad = grad.to(param.dtype)  # applied in the master's dtype
        d_p = grad + self.weight_decay * param if self.weight_decay else grad
        new_state = {}
        if self.momentum:
            # torch.optim.SGD starts the buffer as a copy of the first gradient, undamped.
            running = state["momentum_buffer"] * self.momentum + (1 - self.dampening) * d_p
            buf = torch.where(scalars["is_first_step"], d_p, running)
            new_state["momentum_buffer"] = buf
            d_p = d_p + self.momentum * buf if self.nesterov else buf
        new_param = param - scalars["lr"] * d_p
        skip = scalars.get("skip")
        if skip is not None:
            new_param = torch.where(skip, param, new_param)
            new_state = {slot: torch.where(skip, state[slot], value) for slot, value in new_state.items()}
        return new_param, new_state


Optimizer = Union[AdamW, SGD]


def lr_at(optimizer: Optimizer, step: int) -> float:
    """The learning rate for 1-based `step`."""
    lr = optimizer.lr(step) if callable(optimizer.lr) else optimizer.lr
    if not is_learning_rate(lr):
        raise FxShardError(f"the lr schedule returned {lr!r} at step {step}; it must return a finite float >= 0 "
                           f"(and below float32's largest, {FLOAT32_MAX:.3g}: the step reads it in float32)")
    return float(lr)


FLOAT32_MAX = 3.4028234663852886e38


def is_learning_rate(lr) -> bool:
    """A number the step can use as a learning rate: finite and >= 0 in float32 (the step's lr
    input), not a bool."""
    return (isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr)
            and 0 <= lr <= FLOAT32_MAX)
