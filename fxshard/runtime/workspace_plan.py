"""Where each copy-engine collective's region lies in its group's symmetric workspace.

A region can be handed to a later collective once nothing reads what it holds: copy_engine.py's first
barrier makes every rank's side stream wait until its compute stream has run everything before the
later collective's issue, so a region whose every reader comes before that issue is free by then, on
every rank (the program is the same on each). What a region holds is read by the nodes that use its
result or anything that aliases it (waits, views, getitems of splits, in-place updates; an op without
a schema counts as aliasing). A reader that is itself asynchronous (a send, or a collective that
stays on NCCL) reads its input on another stream until its wait, so it reads until its wait. A
reduce-scatter's region is read only by its own sum, on the side stream, so it is free at once; a result the program returns is copied out of its region (and free at
once too), so no step's state lives in a region. Regions are placed first-fit in program order, at
offsets aligned to 256 bytes; the next step's collectives find every region free (the step before
finished reading them).

Invariant: two collectives of one group whose regions' lifetimes overlap (each the closed interval
from its issue to the last reader of its result: a collective that reads an earlier result as its
input overlaps it) get disjoint byte ranges. The SPMD simulator checks what it buys: a
program run with every region really shared computes what it computes unlowered (tests/test_copy_engine.py).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .. import meta
from ..graph import may_alias_input
from ..errors import FxShardError
from ..ops.p2p import P2P_OPS

_c10d = torch.ops._c10d_functional
ALIGN = 256  # bytes: every region starts aligned for any dtype and for the copy engines


@dataclasses.dataclass
class RegionPlan:
    regions: dict = dataclasses.field(default_factory=dict)  # node -> byte offset in its group's workspace
    groups: dict = dataclasses.field(default_factory=dict)  # node -> group name
    copied_out: dict = dataclasses.field(default_factory=dict)  # node -> its result is copied out (returned)
    lifetimes: dict = dataclasses.field(default_factory=dict)  # node -> (issue position, last reader's position)
    sizes: dict = dataclasses.field(default_factory=dict)  # node -> region bytes
    workspace: dict = dataclasses.field(default_factory=dict)  # group name -> bytes the plan needs
    unshared: dict = dataclasses.field(default_factory=dict)  # group name -> bytes were no region reused


def region_bytes(node: fx.Node) -> int:
    """What the collective's region holds: its input (all-to-all, reduce-scatter) or its result (all-gather)."""
    value = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if not isinstance(value, torch.Tensor):
        raise FxShardError(f"copy-engine lowering: {node.name}'s input has no shape (node.meta['val']); lower "
                           "programs built by fxshard's passes")
    size = value.numel() * value.element_size()
    if node.target in (_c10d.all_gather_into_tensor.default, _c10d.all_gather_into_tensor_out.default):
        size *= node.args[1]
    return -(-size // ALIGN) * ALIGN


def group_of(node: fx.Node) -> str:
    return node.args[-1]


def plan_regions(graph: fx.Graph, collectives: list[fx.Node]) -> RegionPlan:
    """Offsets for `collectives` (nodes of `graph`: all_to_all_single, all_gather_into_tensor,
    reduce_scatter_tensor) so that no two whose lifetimes overlap share a byte of their group's workspace."""
    position = {node: index for index, node in enumerate(graph.nodes)}
    plan = RegionPlan()
    live: dict[str, list[tuple[int, int, int]]] = {}  # group -> (last reader, offset, end offset)
    for node in sorted(collectives, key=position.__getitem__):
        group, size, issued = group_of(node), region_bytes(node), position[node]
        last, returned = _last_reader(node, position, set(collectives))
        if node.target is _c10d.reduce_scatter_tensor.default or returned:
            last = issued  # read on the side stream by its own sum or copy, before the next collective starts
        held = [entry for entry in live.get(group, []) if entry[0] >= issued]
        offset = _first_fit(held, size)
        live[group] = held + [(last, offset, offset + size)]
        plan.regions[node], plan.groups[node], plan.copied_out[node] = offset, group, returned
        plan.lifetimes[node], plan.sizes[node] = (issued, last), size
        plan.workspace[group] = max(plan.workspace.get(group, 0), offset + size)
        plan.unshared[group] = plan.unshared.get(group, 0) + size
    return plan


def _first_fit(held: list[tuple[int, int, int]], size: int) -> int:
    """The lowest offset where `size` bytes overlap none of the `held` ranges."""
    offset = 0
    for _, start, end in sorted(held, key=lambda entry: entry[1]):
        if offset + size <= start:
            break
        offset = max(offset, end)
    return offset


def _last_reader(node: fx.Node, position: dict, lowered: set) -> tuple[int, bool]:
    """The position of the last node that reads `node`'s result through any alias (an asynchronous
    reader: its wait), and whether the program returns (an alias of) it."""
    last, returned = position[node], False
    aliases, seen = [node], {node}
    while aliases:
        value = aliases.pop()
        for user in value.users:
            if user.op == "output":
                returned = True
                continue
            last = max(last, _read_until(user, position, lowered))
            if user not in seen and may_alias_input(user):
                seen.add(user)
                aliases.append(user)
    return last, returned


def _read_until(user: fx.Node, position: dict, lowered: set) -> int:
    """Where `user` is done reading its inputs: at its own position, or, for a send or a collective that
    is not lowered (its input read on NCCL's stream), at its last wait (the end of the graph without one)."""
    asynchronous = user.op == "call_function" and user not in lowered and (
        user.target in meta.COLLECTIVE_ISSUES or user.target in P2P_OPS)
    if not asynchronous:
        return position[user]
    waits = [position[w] for w in user.users if w.target is _c10d.wait_tensor.default]
    return max(waits) if waits else len(position)
