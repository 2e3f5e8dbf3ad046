"""Auxiliary-loss-free MoE load balancing (torchtitan's; arXiv 2408.15664), traced into the step.

torchtitan's MoE layers built with `load_balance_coeff` route with a per-expert bias buffer
(`expert_bias_E`; `expert_bias` in releases before 0.3.0), and count in their training forward the
tokens each expert receives into another (`tokens_per_expert_E` / `tokens_per_expert`). An
optimizer step pre-hook, outside the model, then updates the bias from the counts of the whole
global batch and clears them:

    counts = the count buffer, summed over the data-parallel ranks
    delta = coeff * sign(mean(counts) - counts)
    bias += delta - mean(delta);  count buffer = 0

fxshard's compiled step runs no hooks, so the update is part of the program: the tracer appends
it (`balancing_update`) once per step, after the last microbatch's forward and backward, before the
optimizer phase, as plain graph nodes of the forward phase at layer "post" that every pass copies
like the loss; under Mesh(pp>1), whose traced program is one microbatch's, lower_schedule appends it
to each stage's program for the layers that stage holds, after its last forward. The sum over the
data-parallel ranks is one `fxshard::data_sum` of all (the stage's) layers' counts stacked, one
collective like torchtitan's: the identity on one device, an all-reduce over the data-parallel axis
once the fsdp pass has lowered it. The dump's notes list the balanced layers ("load_balancing").

Invariant: after each step, every rank's bias and count buffers hold what torchtitan's hook leaves
after the same step on the global batch (the bias updated from the counts summed over all ranks and
microbatches; the counts zero), and the next step routes with that bias. A step the non-finite guard
skips keeps them as they were (runtime/nonfinite.py), where torchtitan's hook would still run.
Where only some MoE layers have a coefficient, those are balanced (torchtitan's hook then balances
none); a coefficient of 0 clears the counts each step (torchtitan registers no hook).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
from torch import Tensor

from . import meta
from .errors import FxShardError, user_stacklevel
from .graph import inline

# (bias, counts) buffer names: torchtitan 0.3.0's, and its earlier releases'
_BUFFER_NAMES = (("expert_bias_E", "tokens_per_expert_E"), ("expert_bias", "tokens_per_expert"))


@dataclass(frozen=True)
class Balance:
    """One MoE layer's load balancing: its bias and count buffers (full names) and coefficient."""

    layer: str
    bias: str
    counts: str
    coeff: float


def balanced_layers(model: nn.Module) -> list[Balance]:
    """The layers of `model` that balance torchtitan's way: a real `load_balance_coeff` that is not
    None (torchtitan's hook multiplies by any number) and the two buffers, by their names in torchtitan
    (any module so written, a copy or a fork included). Buffer names are the model's (named_buffers:
    a tensor registered twice goes by its first name). A module with a coefficient and a bias but no
    count buffer is not balanced, and a warning says so."""
    names = {id(tensor): name for name, tensor in model.named_buffers()}
    found, unmatched = [], []
    for path, module in model.named_modules():
        coeff = getattr(module, "load_balance_coeff", None)
        if coeff is None or isinstance(coeff, bool):
            continue
        try:
            coeff = float(coeff)
        except (TypeError, ValueError):
            continue
        own = dict(module.named_buffers(recurse=False))
        pair = next(((bias, counts) for bias, counts in _BUFFER_NAMES if isinstance(own.get(bias), Tensor)
                     and isinstance(own.get(counts), Tensor)), None)
        if pair is None:
            if any(isinstance(own.get(bias), Tensor) for bias, _ in _BUFFER_NAMES):
                unmatched.append(path)
            continue
        found.append(Balance(path, names[id(own[pair[0]])], names[id(own[pair[1]])], coeff))
    for what in ("bias", "counts"):
        seen: dict[str, str] = {}
        for b in found:
            name = getattr(b, what)
            if name in seen:
                raise FxShardError(f"MoE layers {seen[name]!r} and {b.layer!r} share one load-balancing {what} buffer "
                                   f"({name}): torchtitan's balancing keeps one per layer. Give each layer its own "
                                   f"buffer, or build the model with load_balance_coeff=None")
            seen[name] = b.layer
    if unmatched:
        warnings.warn(f"fxshard: {len(unmatched)} module(s) ({unmatched[0]}{', ...' if len(unmatched) > 1 else ''}) "
                      f"have load_balance_coeff and a routing bias but no token-count buffer (tokens_per_expert_E or "
                      f"tokens_per_expert): fxshard does not know how they balance, and their bias stays as it is",
                      stacklevel=user_stacklevel())
    return found


@torch.library.custom_op("fxshard::data_sum", mutates_args=())
def data_sum(x: Tensor) -> Tensor:
    """`x` summed over the data-parallel ranks: the identity on one device (a copy). The fsdp pass
    lowers it to an all-reduce over its axis (passes/fsdp.py)."""
    return x.clone()


@data_sum.register_fake
def _data_sum_fake(x):
    return torch.empty_like(x)


DATA_SUM = torch.ops.fxshard.data_sum.default


def balancing_update(coeffs: list[float], counts: list[Tensor], biases: list[Tensor]) -> list[Tensor]:
    """The new biases, then the new counts (zero), of layers with `coeffs`: the module docstring's
    update, the counts of every layer summed over the data-parallel ranks in one `data_sum`."""
    total = torch.ops.fxshard.data_sum(torch.stack([c.float() for c in counts]))
    new_biases = []
    for coeff, layer_counts, bias in zip(coeffs, total.unbind(0), biases):
        delta = coeff * torch.sign(layer_counts.mean() - layer_counts)
        new_biases.append((bias + (delta - delta.mean())).to(bias.dtype))  # in fp32, rounded once (as add_)
    return [*new_biases, *(torch.zeros_like(c) for c in counts)]


def append_balancing(graph: fx.Graph, fake_mode, balances: list[Balance], counts: list[fx.Node],
                     biases: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """Insert `balancing_update` for `balances` (their current count and bias values as nodes) at the
    graph's insertion point, in the forward phase at layer "post"; returns the new biases and counts."""
    n, coeffs = len(balances), [b.coeff for b in balances]
    new = inline(graph, lambda *ts: balancing_update(coeffs, list(ts[:n]), list(ts[n:])), [*counts, *biases],
                 fake_mode=fake_mode, phase=meta.FWD, layer=meta.POST)
    return new[:n], new[n:]


def balancing_notes(balances: list[Balance]) -> list[str]:
    """The dump's line per balanced layer (Program.notes["load_balancing"])."""
    return [f"{b.layer}: {b.bias} += {b.coeff:g} * sign(mean - counts), centred, with the counts {b.counts} summed "
            f"over the data ranks; then {b.counts} = 0" for b in balances]
