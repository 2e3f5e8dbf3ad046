"""Where each element of a rank's training state lies in the model's global tensors.

A step's state tensors are whatever the passes made of the model's parameters: whole tensors, this
rank's experts (dim 0 split over `ep`), flat units (parameters laid end to end, padded, maybe cut
into shards anywhere, even inside a parameter), on one pipeline stage or several. A checkpoint names
none of that: its keys are the model's names with global shapes (`model.<param>`, `model.<buffer>`,
`optim.<param>.<slot>`). `state_pieces` maps one rank's state onto those keys as `Piece`s: runs of
elements that lie end to end in both, padding excluded. `boxes` cuts a flat run of a global tensor
into the rectangles torch.distributed.checkpoint stores.

Invariant (tests/test_checkpoint_items.py): over all ranks of a mesh, the pieces a rank `writes`
cover every element of every key exactly once, and each rank's pieces cover every element of its
own state tensors except padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..program import EXPERT_SHARDED, Input, InputKind, Program


@dataclass(frozen=True)
class Piece:
    """`numel` elements that lie end to end in the state tensor `state` from flat offset `local` and
    in the checkpoint tensor `key` from (row-major) flat offset `start`. `writes`: this rank is the one
    that saves them (replicas of a tensor load them all, one of them saves them)."""

    state: tuple[InputKind, str]
    local: int
    key: str
    start: int
    numel: int
    writes: bool


def model_key(name: str) -> str:
    return f"model.{name}"


def optimizer_key(name: str, slot: str) -> str:
    return f"optim.{name}.{slot}"


def global_tensors(traced: Program) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Checkpoint key -> (global shape, dtype) for the traced (unsharded, unsplit) program: every
    parameter and buffer, and every optimizer slot of each trainable parameter."""
    result = {}
    for spec in traced.inputs:
        if spec.kind in (InputKind.PARAM, InputKind.BUFFER):
            result[model_key(spec.name)] = (tuple(spec.shape), spec.dtype)
    for spec in traced.inputs:
        if spec.kind is InputKind.OPT_STATE:
            result[optimizer_key(spec.owner, spec.slot)] = (tuple(spec.shape), spec.dtype)
    return result


def state_pieces(program: Program, traced: Program, coords: dict[str, int]) -> list[Piece]:
    """This rank's state (program's PARAM, OPT_STATE and BUFFER inputs) as pieces of the checkpoint's
    global tensors. `traced` gives the global shapes; `coords` this rank's index along each mesh axis."""
    shapes = {spec.name: tuple(spec.shape) for spec in traced.inputs
              if spec.kind in (InputKind.PARAM, InputKind.BUFFER)}
    plan = program.stage
    pieces = []
    for spec in program.inputs:
        if spec.kind not in (InputKind.PARAM, InputKind.OPT_STATE, InputKind.BUFFER):
            continue
        slot, owner = (spec.slot, spec.owner) if spec.kind is InputKind.OPT_STATE else (None, spec.name)
        unit = program.unit_of(spec)
        state = (spec.kind, spec.name)
        # the flat range [low, low + numel) of the unit (or of the tensor) this state tensor holds
        sharded = spec.placement.kind == "sharded" and unit is not None
        low = coords.get(spec.placement.axis, 0) * unit.shard_numel if sharded else 0
        high = low + math.prod(spec.shape)
        members = unit.members if unit is not None else [_Whole(owner, tuple(spec.shape))]
        for member in members:
            start, stop = max(low, member.offset), min(high, member.offset + member.numel)
            if start >= stop:
                continue
            is_experts = unit.experts if unit is not None else _placement_of(program, spec) == EXPERT_SHARDED
            # this rank's experts are global rows [ep * local, (ep + 1) * local) of dim 0
            expert_rows = coords.get("ep", 0) * member.shape[0] if is_experts else 0
            inner = math.prod(shapes[member.name][1:])
            key = model_key(member.name) if slot is None else optimizer_key(member.name, slot)
            replicas = () if sharded else ("edp",) if is_experts else ("dp",)
            pieces.append(Piece(state, start - low, key, expert_rows * inner + start - member.offset,
                                stop - start, _writes(plan, member.name, coords, replicas)))
    return pieces


@dataclass(frozen=True)
class _Whole:
    """A state tensor that is one (maybe expert-sliced) tensor, seen as a unit of one member."""

    name: str
    shape: tuple[int, ...]
    offset: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _placement_of(program: Program, spec: Input):
    if spec.kind is not InputKind.OPT_STATE:
        return spec.placement
    return next(s.placement for s in program.inputs if s.kind is InputKind.PARAM and s.name == spec.owner)


def _writes(plan, name: str, coords: dict[str, int], replicas: tuple[str, ...]) -> bool:
    """Whether this rank saves its copy of `name`'s elements: on a pipeline, only the first stage
    holding it (a tied weight lives on several); within a stage, the first rank along the axes
    `replicas` over which the same elements are replicated."""
    if plan is not None and plan.owner(name) != plan.stage:
        return False
    return all(coords.get(axis, 0) == 0 for axis in replicas)


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The row-major flat range [start, stop) of a tensor of `shape` as few boxes, in order:
    (offsets, sizes, flat start of the box). Each box's elements are contiguous in the flat order
    too (a box is some whole trailing slabs, or a run inside one slab), so a box is a view of a
    flat buffer. A range inside an N-d tensor needs at most 2N - 1 boxes."""
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    first_full, end_full = -(-start // inner), stop // inner  # the whole rows [first_full, end_full)

    def inside(row: int, begin: int, end: int):
        return [((row, *offsets), (1, *sizes), row * inner + flat)
                for offsets, sizes, flat in boxes(shape[1:], begin, end)]

    if first_full > end_full:  # a run inside one row
        row = start // inner
        return inside(row, start - row * inner, stop - row * inner)
    result = []
    if start < first_full * inner:
        result += inside(first_full - 1, start - (first_full - 1) * inner, inner)
    if end_full > first_full:
        result.append(((first_full, *[0] * (len(shape) - 1)), (end_full - first_full, *shape[1:]), first_full * inner))
    if stop > end_full * inner:
        result += inside(end_full, 0, stop - end_full * inner)
    return result
