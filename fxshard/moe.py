"""The MoE token-routing primitive: dispatch tokens to experts (sorted, with a capacity) and combine.

Single-device semantics, static shapes, what `models.MoEGPT` uses and what the expert-parallel pass
is to rewrite (dispatch -> all-to-all -> experts -> all-to-all -> combine):

    dispatch(tokens [T, D], chosen [T, k], n_experts, capacity_factor, slots=False, distinct=False)
        -> Dispatch(rows [T*k, D] sorted by expert, offsets [E] int32 (kept rows per expert,
           cumulative), order [T*k], dropped [] int64, capacity int | None)
    combine(expert_out [T*k, D], dispatch, weights [T, k], tokens=T) -> [T, D]

With `slots=True` (needs a capacity C) the rows are laid out in capacity slots instead: rows
[E*C, D], expert e's kept rows first in rows e*C:(e+1)*C, the rest of each slot padding (a copy of
token 0: finite, and never read back: combine and the backward of dispatch read kept rows only).
The experts' ops then take `capacity=C` (fxshard.ops.grouped_mm / grouped_mlp), and every expert
GEMM can run as one batched GEMM over [E, C, .], much faster on GPUs than a grouped GEMM over
ragged groups (bench/RESULTS.md, 2026-11-23 session 6), at the cost of computing the padding.
Expert parallelism does not rewrite the slot layout yet (the EP pass refuses it).

Capacity rule (deterministic, the same on one device and under expert parallelism): with
`capacity_factor=None` nothing is dropped (dropless). Otherwise each expert keeps at most
C = ceil(capacity_factor * T * k / E) of the assignments it receives from this call's T tokens —
the first C in assignment order (token by token, and within a token in top-k order) — and drops
the rest. A dropped assignment contributes nothing to its token's output (the token keeps its other
experts, and the residual). Dropped rows are sorted past offsets[-1], where grouped GEMMs write
zeros. The router's load-balancing loss is computed from the assignments before dropping.
`fxshard.Config(moe_capacity_factor=f)` overrides the factor of every call while `shard` traces.

`distinct=True` promises that each token's k experts are distinct (a `topk`'s indices are): the
expert-parallel pass then sizes its all-to-all buffers for at most one row per token and expert, which
makes them smaller when an expert group holds fewer than k experts. Without it a token may name an
expert more than once (hash routing), and the buffers hold every row that could arrive.

While tracing, the nodes of a dispatch carry its static facts (experts, top_k, tokens, capacity,
distinct) in their metadata (`node.meta["custom"]["fxshard_moe"]`): the expert-parallel pass sizes
its all-to-all buffers from them.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import FxShardError
from .ops.gather_rows import gather_rows

ANNOTATION = "fxshard_moe"
_capacity_override: list[float] = []  # innermost last; set by capacity_factor_override


@contextlib.contextmanager
def capacity_factor_override(capacity_factor: float | None):
    """Every dispatch inside uses `capacity_factor` (None: leaves each call's own)."""
    if capacity_factor is None:
        yield
        return
    _capacity_override.append(capacity_factor)
    try:
        yield
    finally:
        _capacity_override.pop()


@dataclass
class Dispatch:
    """Packed rows (R = T*k) or, with `slots`, capacity slots (R = E*C: see the module docstring)."""

    rows: Tensor      # [R, D] tokens sorted by expert; kept rows first (in each slot)
    offsets: Tensor   # [E] int32: cumulative kept rows per expert
    order: Tensor     # [R]: assignment index (token * k + slot) of each row (padding rows: 0)
    kept: Tensor      # [R] bool, in row order: the row holds an assignment within capacity
    dropped: Tensor   # [] int64: assignments over capacity
    capacity: int | None
    rank_of: Tensor   # [T*k]: the row of each assignment (packed: the inverse of `order`; slots:
                      # a dropped assignment's is 0, read through `keep`)
    slots: bool = False
    keep: Tensor | None = None    # slots: [T*k] bool, the assignment is within capacity (else None)


def capacity_of(tokens: int, top_k: int, n_experts: int, capacity_factor: float | None) -> int | None:
    if capacity_factor is None:
        return None
    if not capacity_factor > 0:
        raise FxShardError(f"moe capacity_factor must be > 0 or None (dropless), got {capacity_factor!r}")
    return max(1, math.ceil(capacity_factor * tokens * top_k / n_experts))


def rank_within(keys: Tensor, groups: int) -> Tensor:
    """For each element of `keys` (ints in [0, groups)), how many earlier elements share its key: its
    position within its group, in index order. A stable sort, not a cumulative sum over a one-hot
    (that is a [len, groups] tensor, and 6 ms per call on an H200 at 32768 x 64)."""
    by_key = torch.argsort(keys, stable=True)
    sizes = torch.zeros(groups, dtype=torch.long, device=keys.device).scatter_add(0, keys, torch.ones_like(keys))
    first = sizes.cumsum(0) - sizes
    rank = torch.arange(keys.numel(), device=keys.device) - first[keys[by_key]]
    return torch.empty_like(keys).scatter(0, by_key, rank)


def inverse_permutation(order: Tensor) -> Tensor:
    """`inverse[order[i]] = i`."""
    return torch.empty_like(order).scatter(0, order, torch.arange(order.numel(), device=order.device))


def dispatch(tokens: Tensor, chosen: Tensor, n_experts: int, capacity_factor: float | None = None,
             slots: bool = False, distinct: bool = False) -> Dispatch:
    count, top_k = chosen.shape
    if _capacity_override:
        capacity_factor = _capacity_override[-1]
    capacity = capacity_of(count, top_k, n_experts, capacity_factor)
    if slots and capacity is None:
        raise FxShardError("moe.dispatch(slots=True) lays rows out in capacity slots and needs a capacity "
                           "factor; pass capacity_factor (e.g. 1.0), or slots=False for dropless routing")
    facts = {"experts": n_experts, "top_k": top_k, "tokens": count, "capacity": capacity, "slots": slots,
             "distinct": distinct}
    with torch.fx.traceback.annotate({ANNOTATION: facts}):
        if slots:
            return _dispatch_to_slots(tokens, chosen, n_experts, capacity)
        return _dispatch(tokens, chosen, n_experts, capacity)


def _dispatch(tokens: Tensor, chosen: Tensor, n_experts: int, capacity: int | None) -> Dispatch:
    top_k = chosen.shape[1]
    flat_expert = chosen.reshape(-1)
    if capacity is None:
        keep = torch.ones_like(flat_expert, dtype=torch.bool)
    else:  # the first `capacity` assignments of each expert, in assignment order
        keep = rank_within(flat_expert, n_experts) < capacity
    sort_key = torch.where(keep, flat_expert, torch.full_like(flat_expert, n_experts))  # dropped sort last
    order = torch.argsort(sort_key, stable=True)
    kept_counts = _kept_counts(flat_expert, keep, n_experts)
    offsets = kept_counts.cumsum(0).to(torch.int32)
    rank_of = inverse_permutation(order)
    rows = _Spread.apply(tokens, order, rank_of, top_k)
    return Dispatch(rows, offsets, order, keep[order], (~keep).sum(), capacity, rank_of)


def _kept_counts(flat_expert: Tensor, keep: Tensor, n_experts: int) -> Tensor:
    """[E] int64: the assignments each expert keeps."""
    return torch.zeros(n_experts, dtype=torch.long, device=flat_expert.device).scatter_add(0, flat_expert, keep.long())


def _dispatch_to_slots(tokens: Tensor, chosen: Tensor, n_experts: int, capacity: int) -> Dispatch:
    top_k = chosen.shape[1]
    flat_expert = chosen.reshape(-1)
    rank = rank_within(flat_expert, n_experts)
    keep = rank < capacity
    rows = n_experts * capacity
    # each kept assignment's slot row; dropped ones point at row 0 and are masked wherever read
    rank_of = torch.where(keep, flat_expert * capacity + rank, torch.zeros_like(rank))
    # each slot row's assignment: padding rows take assignment 0 (token 0), never read back
    target = torch.where(keep, rank_of, torch.full_like(rank_of, rows))
    assignments = torch.arange(flat_expert.numel(), device=tokens.device)
    order = torch.zeros(rows + 1, dtype=rank_of.dtype, device=tokens.device).scatter(0, target, assignments)[:rows]
    kept_counts = _kept_counts(flat_expert, keep, n_experts)
    offsets = kept_counts.cumsum(0).to(torch.int32)
    slot_row = torch.arange(rows, device=tokens.device) % capacity
    real = slot_row < kept_counts.repeat_interleave(capacity)  # kept counts are at most C
    rows_out = _Spread.apply(tokens, order, rank_of, top_k, keep)
    return Dispatch(rows_out, offsets, order, real, (~keep).sum(), capacity, rank_of, slots=True, keep=keep)


def combine(expert_out: Tensor, routed: Dispatch, weights: Tensor, tokens: int) -> Tensor:
    """Each token's weighted sum of its kept experts' outputs (dropped rows weigh zero)."""
    top_k = weights.shape[1]
    if routed.slots:  # a dropped assignment's rank_of names some other row: masked in the gather
        row_weights = _RowWeights.apply(weights.reshape(-1), routed.order, routed.rank_of, routed.keep, routed.kept)
    else:
        row_weights = weights.reshape(-1)[routed.order] * routed.kept
    scaled = expert_out * row_weights.unsqueeze(-1).to(expert_out.dtype)
    return _Gather.apply(scaled, routed.order, routed.rank_of, top_k, routed.keep)


# Dispatch and combine move rows with gathers only, forward and backward: a token's k rows are
# summed by a reduction over k, never by atomic adds into the token (which cost ~0.5 ms per call at
# 32768 bf16 rows on an H200 and sum in a run-to-run varying order).
class _Spread(torch.autograd.Function):
    """tokens [T, D] -> rows [len(order), D]: row r is token order[r] // k. Backward: the adjoint
    gather (with `keep`, the slot layout's, only kept assignments read their rows)."""

    @staticmethod
    def forward(ctx, tokens, order, rank_of, top_k, keep=None):
        ctx.save_for_backward(order, rank_of, keep)
        ctx.top_k = top_k
        return tokens.index_select(0, order // top_k)

    @staticmethod
    def backward(ctx, grad_rows):
        order, rank_of, keep = ctx.saved_tensors
        return _Gather.apply(grad_rows, order, rank_of, ctx.top_k, keep), None, None, None, None


class _RowWeights(torch.autograd.Function):
    """Slot layout: each row's routing weight (zero on padding rows). Backward: each assignment's row's
    gradient (zero for a dropped one). A gather both ways; indexing weights by `order` instead makes
    the backward an index backward with assignment 0 repeated on every padding row (1.7 ms per layer
    on an H200 at 32768 rows)."""

    @staticmethod
    def forward(ctx, weights, order, rank_of, keep, real):
        ctx.save_for_backward(rank_of, keep)
        return weights.index_select(0, order) * real

    @staticmethod
    def backward(ctx, grad_rows):
        rank_of, keep = ctx.saved_tensors
        return grad_rows.index_select(0, rank_of) * keep, None, None, None, None


class _Gather(torch.autograd.Function):
    """rows -> tokens [T, D]: token t sums rows rank_of[t*k : t*k + k] (with `keep`: only those of
    kept assignments; a dropped one's rank_of names some other row). Backward: spread."""

    @staticmethod
    def forward(ctx, rows, order, rank_of, top_k, keep=None):
        ctx.save_for_backward(order, rank_of, keep)
        ctx.top_k = top_k
        if keep is None:
            by_assignment = rows.index_select(0, rank_of)
        else:  # gather and mask in one pass
            by_assignment = gather_rows(rows, rank_of, keep)
        return by_assignment.view(-1, top_k, rows.shape[1]).sum(1)

    @staticmethod
    def backward(ctx, grad_tokens):
        order, rank_of, keep = ctx.saved_tensors
        return _Spread.apply(grad_tokens, order, rank_of, ctx.top_k, keep), None, None, None, None
