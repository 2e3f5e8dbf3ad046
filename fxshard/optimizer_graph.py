"""The optimizer phase of a program: gradient norm, optional clipping, then the update per tensor.

Built from data (a TrainSpec) so that passes which change what the optimizer sees (FSDP's flat
shards) rebuild the phase with the same code the tracer used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback

from . import meta
from .graph import inline
from .optim import Optimizer
from .program import Update


@dataclass(frozen=True)
class TrainSpec:
    """What the optimizer phase does: the optimizer, the gradient-norm clip, and whether a step whose
    gradient norm is not finite leaves parameters and optimizer state unchanged (Config(nonfinite))."""

    optimizer: Optimizer
    clip_grad_norm: float | None = None
    guard_nonfinite: bool = False


def append_update(graph: fx.Graph, spec: TrainSpec, fake_mode, updates: Sequence[Update], params: list[fx.Node],
                  grads: list[fx.Node], states: dict[tuple[str, str], fx.Node], lr: fx.Node, step: fx.Node,
                  norm_groups: Sequence[tuple[str, ...]] = ()):
    """Insert the optimizer phase of `updates` at the graph's insertion point.

    `params[i]` and `grads[i]` are the tensor and gradient of `updates[i]`, `states[name, slot]` its
    optimizer state. The squared gradient norm is summed over each update's `norm_axes`, updates not
    `counted` left out of this rank's part. The ranks of a group must issue the same all-reduces in
    the same order: the groups of axes are reduced in sorted order, and `norm_groups` names those
    other ranks reduce though this one may update nothing summed over them (a pipeline stage without
    experts, where another stage's expert units sum over `ep`); this rank adds zero there.
    With `spec.guard_nonfinite`, the update is skipped, on every rank alike, where the (global) norm
    is not finite, and the fourth value is a bool vector node: which of this rank's counted gradients
    (names in its meta[meta.NONFINITE_TENSORS]) are not finite; else None.
    Returns (grad_norm, {name: new tensor}, {(name, slot): new state}, nonfinite flags or None).
    """
    names = [update.name for update in updates]
    slots = [[slot for (owner, slot) in states if owner == name] for name in names]
    axes_of = {update.name: update.norm_axes for update in updates}
    not_in_norm = frozenset(update.name for update in updates if not update.counted)
    all_groups = sorted({*axes_of.values(), *norm_groups})
    optimizer, clip = spec.optimizer, spec.clip_grad_norm
    count = len(names)
    counted_names = [name for name in names if name not in not_in_norm]

    def update(*flat):
        # Gradients come in the dtype they were computed or reduced in (bf16 under param_dtype=bf16
        # without a reduction); each optimizer applies them in the master's dtype. No fp32 copy of a
        # gradient is written for the norm (computed in fp32 from the gradient as it is) or for AdamW
        # (its fused op widens the gradient as it loads it): 8 bytes per parameter per step less.
        params, grads = flat[:count], flat[count:2 * count]
        state_values, (lr, step) = flat[2 * count:-2], flat[-2:]
        # every rank reduces every group, even one it has nothing to count for (collectives must match)
        # one reduction per gradient (vector_norm), not a squared copy of it summed afterwards
        local = {name: torch.linalg.vector_norm(g, dtype=torch.float32).square()
                 for name, g in zip(names, grads) if name not in not_in_norm}
        by_groups: dict[tuple[str, ...], list] = {group: [] for group in all_groups}
        for name in counted_names:
            by_groups[axes_of[name]].append(local[name])
        squares = grads[0].new_zeros((), dtype=torch.float32)
        for groups, counted in by_groups.items():
            part = torch.stack(counted or [torch.linalg.vector_norm(grads[0] * 0, dtype=torch.float32)]).sum()
            for group in groups:
                part = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(part, "sum", group))
            squares = squares + part
        grad_norm = squares.sqrt()
        if clip is not None:  # scaled in the master's dtype
            coefficient = torch.clamp(clip / (grad_norm + 1e-6), max=1.0)
            grads = [g.to(p.dtype) * coefficient.to(p.dtype) for p, g in zip(params, grads)]
        shared = optimizer.scalars(lr, step)
        flags = []
        if spec.guard_nonfinite:  # the norm is global: every rank skips alike
            shared["skip"] = torch.logical_not(torch.isfinite(grad_norm))
            flags = [torch.logical_not(torch.isfinite(torch.stack([local[n] for n in counted_names])))] \
                if counted_names else [torch.zeros(0, dtype=torch.bool, device=grad_norm.device)]
        new_params, new_states, position = [], [], 0
        for name, p, g, own_slots in zip(names, params, grads, slots):
            state = dict(zip(own_slots, state_values[position:position + len(own_slots)]))
            position += len(own_slots)
            with fx_traceback.annotate({meta.ANNOTATION_PARAM: name}):
                new_p, new_s = optimizer.update(p, g, state, shared)
            new_params.append(new_p)
            new_states.extend(new_s[slot] for slot in own_slots)
        return [grad_norm, *new_params, *new_states, *flags]

    state_nodes = [states[name, slot] for name, own in zip(names, slots) for slot in own]
    outputs = inline(graph, update, [*params, *grads, *state_nodes, lr, step], fake_mode=fake_mode,
                     phase=meta.OPTIM)
    nonfinite = outputs.pop() if spec.guard_nonfinite else None
    if nonfinite is not None:
        nonfinite.meta[meta.NONFINITE_TENSORS] = tuple(counted_names)
    grad_norm, new_params, new_state_list = outputs[0], outputs[1:1 + count], outputs[1 + count:]
    for name, node in zip(names, new_params):
        node.meta[meta.PARAM] = name
    keys = [(name, slot) for name, own in zip(names, slots) for slot in own]
    return grad_norm, dict(zip(names, new_params)), dict(zip(keys, new_state_list)), nonfinite
