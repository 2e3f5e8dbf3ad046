"""The optimizer phase of a program: gradient norm, optional clipping, then the update per tensor.

Built from data (a TrainSpec) so that passes which change what the optimizer sees (FSDP's flat
shards) rebuild the phase with the same code the tracer used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback

from . import meta
from .graph import inline
from .optim import Optimizer
from .program import Update

if TYPE_CHECKING:
    from .loss_scale import LossScale


@dataclass(frozen=True)
class TrainSpec:
    """What the optimizer phase does: the optimizer, the gradient-norm clip, and whether a step whose
    gradient norm is not finite leaves parameters and optimizer state unchanged (Config(nonfinite); the
    runtime keeps the buffers the step updates too: runtime/nonfinite.py keep_buffers_when_skipped)."""

    optimizer: Optimizer
    clip_grad_norm: float | None = None
    guard_nonfinite: bool = False
    loss_scale: "float | LossScale | None" = None  # Config(loss_scale) resolved: the gradients come in scaled by it

    @property
    def scales_dynamically(self) -> bool:
        """Whether the program carries a dynamic loss scale (a LOSS_SCALE input and output)."""
        from .loss_scale import LossScale

        return isinstance(self.loss_scale, LossScale)


@dataclass(frozen=True)
class Deferred:
    """Gradients that reach the optimizer phase unreduced, and the traceable function that issues a
    reduction there: `issue(name, unreduced gradient)` -> the issued functional collective (the phase
    waits on it). The updates that read none of them run while those reductions are in flight.

    Under the non-finite guard the skip is then decided before they land: from each rank's squared
    norm of its unreduced gradient, summed over the update's norm_axes as the reduced one is. Where the
    reduction is a mean over ranks within those axes, that sum bounds the reduced gradient's squared
    norm (||mean_r g_r||^2 <= sum_r ||g_r||^2), so where it is finite so is the gradient norm, and a
    gradient that is not finite on any rank makes it not finite too. The bound sums each rank's own
    squares, so it can overflow float32 (3.4e38) where the reduced norm does not: gradients near
    1.8e19 / sqrt(ranks) that agree over the ranks, or larger ones that cancel in the mean. The guard
    then skips a step the reduced norm alone would not have (runtime/nonfinite.py's error says so).
    Not with clipping, which needs the reduced norm before any update.

    `wait(name, issued)` waits for one (default: a plain wait_tensor). `after`: updates that run after
    the deferred ones instead of before (ZeRO-1/2: units with no collective after their update, under
    which the deferred units' all-gathers then run)."""

    names: frozenset[str]
    issue: Callable[[str, torch.Tensor], torch.Tensor]
    wait: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, issued: torch.ops._c10d_functional.wait_tensor(issued)
    after: frozenset[str] = frozenset()


def append_update(graph: fx.Graph, spec: TrainSpec, fake_mode, updates: Sequence[Update], params: list[fx.Node],
                  grads: list[fx.Node], states: dict[tuple[str, str], fx.Node], lr: fx.Node, step: fx.Node,
                  norm_groups: Sequence[tuple[str, ...]] = (), deferred: Deferred | None = None,
                  order: Sequence[str] | None = None, loss_scale: fx.Node | None = None):
    """Insert the optimizer phase of `updates` at the graph's insertion point.

    `params[i]` and `grads[i]` are the tensor and gradient of `updates[i]`, `states[name, slot]` its
    optimizer state. The squared gradient norm is summed over each update's `norm_axes`, updates not
    `counted` left out of this rank's part. The ranks of a group must issue the same all-reduces in
    the same order: the groups of axes are reduced in sorted order, and `norm_groups` names those
    other ranks reduce though this one may update nothing summed over them (a pipeline stage without
    experts, where another stage's expert units sum over `ep`); this rank adds zero there.
    An update whose `decay` is False runs with the optimizer's `without_decay()` (its `no_decay`).
    Updates run in `order` (names; default: as `updates` lists them), the gradient norm summed in
    `updates`' order either way. The gradients of `deferred.names` are unreduced: their reductions
    are issued at the start of the phase, and they are updated after the others but
    `deferred.after`; the gradient norm comes last. Otherwise the norm comes first, then the updates.
    With `spec.guard_nonfinite`, the update is skipped, on every rank alike, where the (global) norm
    is not finite (with deferred reductions: where the bound Deferred describes is not), and the fourth value is a bool vector node: whether the update was skipped, then
    which of this rank's counted gradients (names in its meta[meta.NONFINITE_TENSORS]) are not
    finite; else None.
    Under a loss scale (`spec.loss_scale`) the gradients come in multiplied by it: the norm and the
    updates see them divided by it, in float32 (where clipping scales them anyway, in the same
    multiply); a dynamic scale's state is `loss_scale` (the LOSS_SCALE input) and its next state the
    fifth value (else None).
    Returns (grad_norm, {name: new tensor}, {(name, slot): new state}, nonfinite flags or None,
    the loss scale's next state or None).
    """
    names = [update.name for update in updates]
    slots = [[slot for (owner, slot) in states if owner == name] for name in names]
    order = list(names if order is None else order)
    if sorted(order) != sorted(names):
        raise AssertionError(f"the update order {order} is not an order of the updates {names}")
    late = [name for name in order if deferred is not None and name in deferred.names]
    if late and spec.clip_grad_norm is not None:
        raise AssertionError("deferred gradient reductions with clip_grad_norm: every update needs the reduced norm")
    count = len(names)
    counted_names = [update.name for update in updates if update.counted]
    if spec.scales_dynamically != (loss_scale is not None):
        raise AssertionError(f"a dynamic loss scale needs its state node and only it: {spec.loss_scale}, {loss_scale}")
    tail = [lr, step] + ([loss_scale] if loss_scale is not None else [])

    def update(*flat):
        # Gradients come in the dtype they were computed or reduced in (bf16 under param_dtype=bf16
        # without a reduction); each optimizer applies them in the master's dtype. No fp32 copy of a
        # gradient is written for the norm (computed in fp32 from the gradient as it is) or for AdamW
        # (its fused op widens the gradient as it loads it): 8 bytes per parameter per step less.
        state_values, position, own_states = flat[2 * count:-len(tail)], 0, {}
        for name, own_slots in zip(names, slots):
            own_states[name] = dict(zip(own_slots, state_values[position:position + len(own_slots)]))
            position += len(own_slots)
        scale_state = flat[-1] if loss_scale is not None else None
        phase = _Phase(spec, updates, norm_groups, dict(zip(names, flat[:count])),
                       dict(zip(names, flat[count:2 * count])), own_states, *flat[-len(tail):][:2],
                       like=flat[count], scale_state=scale_state)
        if late:
            grad_norm, flags = phase.run_deferred(order, late, deferred)
        else:
            grad_norm, flags = phase.run(order)
        next_scale = [spec.loss_scale.next_state(scale_state, phase.shared["skip"])] if scale_state is not None else []
        return [grad_norm, *(phase.new_params[name] for name in names),
                *(phase.new_states[name][slot] for name, own in zip(names, slots) for slot in own), *flags,
                *next_scale]

    state_nodes = [states[name, slot] for name, own in zip(names, slots) for slot in own]
    outputs = inline(graph, update, [*params, *grads, *state_nodes, *tail], fake_mode=fake_mode,
                     phase=meta.OPTIM)
    next_scale = outputs.pop() if loss_scale is not None else None
    nonfinite = outputs.pop() if spec.guard_nonfinite else None
    if nonfinite is not None:
        nonfinite.meta[meta.NONFINITE_TENSORS] = tuple(counted_names)
    grad_norm, new_params, new_state_list = outputs[0], outputs[1:1 + count], outputs[1 + count:]
    for name, node in zip(names, new_params):
        node.meta[meta.PARAM] = name
    keys = [(name, slot) for name, own in zip(names, slots) for slot in own]
    return grad_norm, dict(zip(names, new_params)), dict(zip(keys, new_state_list)), nonfinite, next_scale


def _squared(g: torch.Tensor) -> torch.Tensor:
    """A gradient's squared norm in one reduction (vector_norm, not a squared copy summed afterwards):
    in fp32, or fp64 for fp64 gradients (vector_norm does not narrow); reported in fp32."""
    wide = torch.float64 if g.dtype == torch.float64 else torch.float32
    return torch.linalg.vector_norm(g, dtype=wide).square().to(torch.float32)


class _Phase:
    """The optimizer phase's body while `append_update` traces it: the tensors of one call (by update
    name) and the steps the two orders are made of (`run`, `run_deferred`), which fill `new_params`
    and `new_states`."""

    def __init__(self, spec: TrainSpec, updates: Sequence[Update], norm_groups, params: dict, grads: dict,
                 states: dict, lr: torch.Tensor, step: torch.Tensor, like: torch.Tensor,
                 scale_state: torch.Tensor | None = None):
        self.spec, self.updates = spec, {update.name: update for update in updates}
        self.counted = [update.name for update in updates if update.counted]
        self.groups = sorted({*(update.norm_axes for update in updates), *norm_groups})
        self.params, self.grads, self.states, self.lr, self.step = params, grads, states, lr, step
        self.like = like  # the first gradient as it came in (lr without updates): a group's zero when it counts nothing
        self.shared = spec.optimizer.scalars(lr, step)
        self.plain = None   # (optimizer without weight decay, its scalars), made when an update needs it
        self.new_params, self.new_states = {}, {}
        # the gradients' loss scale divided out: a float (static), a 0-d tensor (dynamic), or None
        self.inverse = (1.0 / scale_state[0] if scale_state is not None else
                        1.0 / spec.loss_scale if spec.loss_scale is not None else None)
        # what every gradient is still to be multiplied by (the loss scale's inverse, times clipping's
        # coefficient once `run` has the norm), and whether in at least float32 (1/scale is subnormal
        # in fp16) or in the parameter's dtype (clipping alone, as torch's clip_grad_norm_)
        self.multiplier, self.at_least_fp32 = self.inverse, self.inverse is not None
        self.grad_scale = None  # the multiplier as the 0-d float32 tensor an optimizer applies itself

    def norm(self, squares: torch.Tensor) -> torch.Tensor:
        """The gradient norm from the sum of the (scaled) gradients' squares."""
        return squares.sqrt() if self.inverse is None else squares.sqrt() * self.inverse

    def arguments(self, name: str, optimizer, scalars: dict) -> tuple[torch.Tensor, dict]:
        """The gradient and scalars `optimizer.update` takes for `name`: the gradient as it came, with
        the multiplier as `scalars["grad_scale"]` where the optimizer applies it as it loads the
        gradient (AdamW on fp32 masters: no clipped or unscaled copy is written), else multiplied here."""
        grad, multiplier = self.grads[name], self.multiplier
        if multiplier is None:
            return grad, scalars
        if optimizer.takes_grad_scale(self.params[name]):
            if self.grad_scale is None:
                self.grad_scale = (multiplier.to(torch.float32) if isinstance(multiplier, torch.Tensor) else
                                   torch.full((), multiplier, dtype=torch.float32, device=grad.device))
            return grad, {**scalars, "grad_scale": self.grad_scale}
        dtype = self.params[name].dtype
        dtype = torch.promote_types(dtype, torch.float32) if self.at_least_fp32 else dtype
        factor = multiplier.to(dtype) if isinstance(multiplier, torch.Tensor) else multiplier
        return grad.to(dtype) * factor, scalars

    def global_sum(self, local: dict) -> torch.Tensor:
        """The sum of `local`'s squares over every rank of each update's norm axes (every rank
        reduces every group, even one it has nothing to count for: collectives must match)."""
        by_groups: dict[tuple[str, ...], list] = {group: [] for group in self.groups}
        for name in self.counted:
            by_groups[self.updates[name].norm_axes].append(local[name])
        total = self.like.new_zeros((), dtype=torch.float32)
        for groups, counted in by_groups.items():
            part = torch.stack(counted or [_squared(self.like * 0)]).sum()
            for group in groups:
                part = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(part, "sum", group))
            total = total + part
        return total

    def nonfinite_flags(self, local: dict) -> list:
        """Under the guard, [whether the step is skipped, then whether each counted gradient is not
        finite]; made before the last updates (no region after them)."""
        if not self.spec.guard_nonfinite:
            return []
        each = [local[name] for name in self.counted]
        skip = self.shared["skip"].reshape(1)
        return [torch.cat([skip, torch.logical_not(torch.isfinite(torch.stack(each))) if each else skip.new_zeros(0)])]

    def rule(self, name: str):
        """(optimizer, scalars) of an update; `shared` has its skip by the time any runs."""
        if self.updates[name].decay:  # Update.decay is True for every update where weight_decay is 0
            return self.spec.optimizer, self.shared
        if self.plain is None:
            optimizer = self.spec.optimizer.without_decay()
            scalars = optimizer.scalars(self.lr, self.step)
            if "skip" in self.shared:
                scalars["skip"] = self.shared["skip"]
            self.plain = optimizer, scalars
        return self.plain

    def apply(self, chosen) -> None:
        for name in chosen:
            optimizer, scalars = self.rule(name)
            with fx_traceback.annotate({meta.ANNOTATION_PARAM: name}):
                grad, scalars = self.arguments(name, optimizer, scalars)
                self.new_params[name], self.new_states[name] = optimizer.update(
                    self.params[name], grad, self.states[name], scalars)

    def run(self, order: list[str]):
        """The norm first (clipping by it, deciding the skip from it), then every update in `order`."""
        local = {name: _squared(self.grads[name]) for name in self.counted}
        grad_norm = self.norm(self.global_sum(local))
        clip = self.spec.clip_grad_norm
        if clip is not None:  # the loss scale divided out in the same multiply (`arguments`)
            coefficient = torch.clamp(clip / (grad_norm + 1e-6), max=1.0)
            self.multiplier = coefficient if self.inverse is None else coefficient * self.inverse
        if self.spec.guard_nonfinite:  # the norm is global: every rank skips alike
            self.shared["skip"] = torch.logical_not(torch.isfinite(grad_norm))
        flags = self.nonfinite_flags(local)
        self.apply(order)
        return grad_norm, flags

    def run_deferred(self, order: list[str], late: list[str], deferred: Deferred):
        """Decide the skip from the unreduced gradients (Deferred's bound), issue the late reductions,
        update the others while they are in flight (but `deferred.after`), then the late ones, then
        `deferred.after`; the norm, a metric only, last."""
        local = {name: _squared(self.grads[name]) for name in self.counted if name not in late}
        counted_late = [name for name in late if self.updates[name].counted]
        if self.spec.guard_nonfinite:
            bound = self.global_sum({**local, **{name: _squared(self.grads[name]) for name in counted_late}})
            self.shared["skip"] = torch.logical_not(torch.isfinite(bound))
        issued = {name: deferred.issue(name, self.grads[name]) for name in late}
        self.apply([name for name in order if name not in late and name not in deferred.after])
        for name in late:
            self.grads[name] = deferred.wait(name, issued[name])
            if name in counted_late:
                local[name] = _squared(self.grads[name])
        flags = self.nonfinite_flags(local)
        self.apply(late)
        self.apply([name for name in order if name in deferred.after and name not in late])
        return self.norm(self.global_sum(local)), flags  # its all-reduce waits for nothing else
